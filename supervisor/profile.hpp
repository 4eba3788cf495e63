#pragma once
// Sandbox profiles (profiles/*.json): named, versioned; parsed strictly, so an unknown field, a
// wrong type or an impossible value is refused with the field's path in the message.
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace sbx::supervisor {

struct ProfileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- network and credentials (egress policy and credential broker) ----
struct NetworkPolicy {
  enum class Mode { Host, None, Proxy };
  Mode mode = Mode::Host;
  std::vector<std::string> allow, deny;       // exact hosts, IP literals, "*.suffix"
  std::map<std::string, std::string> resolve;  // host -> address the broker connects to (pinning)
  int proxy_port = 3128;                       // the broker's port inside the agent's netns
  int64_t max_header_bytes = 16 * 1024;
  int64_t max_body_bytes = 8 * 1024 * 1024;
  int64_t timeout_ms = 30000;  // to read a request's header, to connect, for a whole response
};
const char* network_mode_name(NetworkPolicy::Mode m);

struct Credential {
  std::string name;                     // also the first path segment at the broker
  std::string source_file, source_env;  // exactly one is set
  std::string scheme = "https", host;   // the binding: only this destination gets the secret
  int port = 443;
  std::string path_prefix;
  std::string header = "authorization";
  std::string format = "Bearer {}";
  std::string placeholder;              // what the agent holds instead of the secret
  std::string placeholder_env;          // env var of the agent set to the placeholder
  std::string base_url_env;             // env var of the agent set to the broker's URL for it
  std::string ca_file;                  // trust anchors for the upstream (default: system store)
};
// ---- end network and credentials ----

struct Profile {
  std::string name = "default";
  int version = 1;
  struct Resources {
    int64_t grace_ms = 10000;
  } resources;
  struct Isolation {
    bool namespaces = true;
  } isolation;
  NetworkPolicy network;                 // network and credentials
  std::vector<Credential> credentials;   // network and credentials
};

/// Parses a profile document; throws ProfileError naming the field.
Profile parse_profile(std::string_view json_text);
/// Loads `name_or_path`: a path to a file, or a name looked up in the profile directories.
Profile load_profile(const std::string& name_or_path);
/// Applies "a.b=value" overrides (the value parsed as JSON, or taken as a string).
void apply_override(Profile& p, const std::string& assignment);

/// "10s", "500ms", "2h", "1m", "1d" or a number of seconds; throws ProfileError.
int64_t parse_duration_ms(std::string_view s, const std::string& field);

}  // namespace sbx::supervisor
