#pragma once
// Sandbox profiles (profiles/*.json): named, versioned; parsed strictly, so an unknown field, a
// wrong type or an impossible value is refused with the field's path in the message.
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace sbx::profile {

struct ProfileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- network and credentials (egress policy and credential broker) ----
struct NetworkPolicy {
  enum class Mode { Host, None, Proxy };
  Mode mode = Mode::Host;
  std::vector<std::string> allow, deny;        // exact hosts, IP literals, "*.suffix"
  std::vector<std::string> allow_cidrs;        // special-purpose ranges (private, loopback, ...) it may reach
  std::map<std::string, std::string> resolve;  // host -> address the broker connects to (pinning)
  int proxy_port = 3128;                       // the broker's port inside the agent's netns
  int64_t max_header_bytes = 16 * 1024;
  int64_t max_body_bytes = 8 * 1024 * 1024;
  int64_t timeout_ms = 30000;  // to read a request's header, to connect, for a whole response
};
// Inline: sandbox/policy.cpp names the mode, and sandboxer-ns-init, which links that file, would
// otherwise take in profile.cpp whole, with the egress parser (sandbox/CMakeLists.txt).
inline const char* network_mode_name(NetworkPolicy::Mode m) {
  return m == NetworkPolicy::Mode::Proxy ? "proxy" : m == NetworkPolicy::Mode::None ? "none" : "host";
}

struct Credential {
  std::string name;                     // also the first path segment at the broker
  std::string source_file, source_env;  // exactly one is set
  std::string scheme = "https", host;   // the binding: only this destination gets the secret
  int port = 443;
  std::string path_prefix;
  std::string header = "authorization";
  std::string format = "Bearer {}";
  std::string placeholder;      // what the agent holds instead of the secret
  std::string placeholder_env;  // env var of the agent set to the placeholder
  std::string base_url_env;     // env var of the agent set to the broker's URL for it
  std::string ca_file;          // trust anchors for the upstream (default: system store)
};
// ---- end network and credentials ----

struct Profile {
  std::string name = "default";
  // The JSON document it was parsed from, with --set overrides merged in: what a box started
  // elsewhere from one of its snapshots is given (the snapshot's manifest carries it).
  std::string document = "{}";
  int version = 1;
  struct Resources {
    int64_t memory = 0;      // bytes; 0: no ceiling of our own
    double cpus = 0;         // cores; 0: no ceiling
    int64_t pids = 0;        // 0: no ceiling
    int64_t open_files = 0;  // RLIMIT_NOFILE; 0: inherited
    int64_t disk = 0;        // workspace size in bytes; 0: the state dir's filesystem
    int64_t timeout_ms = 0;  // wall clock; 0: none
    int64_t idle_ms = 0;     // no output and no CPU for this long; 0: none
    int64_t grace_ms = 10000;
    int64_t pids_grace_ms = 2000;  // forks failing at the pids ceiling this long end the tree
    int64_t copies = 16;           // restored or forked copies alive at once in the box (each with the
                                   // full ceilings above); a restore or fork past it is refused
    int64_t snapshots = 32;        // snapshots kept in the box's store; a checkpoint or import past it
                                   // is refused
    bool ksm = true;               // live copies' anonymous memory mergeable by the host's KSM
  } resources;
  struct Isolation {
    std::string level = "process";  // process, container, gvisor, microvm: the least the host must give
    bool namespaces = true;         // own pid + mount namespace
    // Where the host refuses them (or their mount plan fails): "run" the agent without them,
    // "refuse" to, or "auto" (refuse where the supervisor is root on a host with no container
    // around it: sandbox::flat_fallback_allowed).
    std::string without_namespaces = "auto";
    std::optional<uint32_t> uid, gid;                      // unset: the agent runs as the supervisor's user
    std::optional<std::vector<std::string>> capabilities;  // kept (CAP_ names); unset: all
    struct Landlock {
      std::vector<std::string> rw, ro;
    };
    std::optional<Landlock> landlock;
    // More host paths hidden from the agent, as the credential paths are (sandbox::credential_paths):
    // a file reads as empty, a directory as an empty one; a path not on the host costs nothing.
    std::vector<std::string> masks;
    std::string seccomp = "default";  // "default", "none", or a policy file
  } isolation;
  NetworkPolicy network;                  // network and credentials ("none" etc. is short for a mode)
  std::vector<Credential> credentials;    // network and credentials
  std::string persistence = "ephemeral";  // ephemeral, persistent, checkpoint
  // The agent's environment beyond the clean base (agent-env.hpp); an override merges by name,
  // and a null value removes one.
  std::map<std::string, std::string> env;
  struct Journal {
    int64_t disk_cap = 0;     // bytes the journal may keep on disk; past it the oldest sealed segments go
    int64_t queue = 4 << 20;  // bytes of events kept in memory while the disk is full; past it the agent is frozen
  } journal;
  struct Metrics {
    int64_t interval_ms = 5000;  // cadence of `metrics` events; 0: none
  } metrics;
  // Agents that outlive their host (docs/architecture.md, "Checkpoints"): snapshots the box takes
  // of its main branch by itself, and the resume from the newest at the next start.
  struct Checkpoint {
    int64_t every_ms = 0;              // a live checkpoint of the main branch on this period; 0: none
    int64_t keep = 3;                  // the box's own snapshots kept (periodic, on_stop, on_idle); named ones stay
    bool on_stop = false;              // checkpoint before the agent is ended by SIGTERM, within the grace period
    bool on_idle = false;              // checkpoint at the idle limit, then end the agent (hibernation)
    int64_t probe_timeout_ms = 10000;  // criu's kernel probe: a checkpoint is refused past this
    /// Whether the box persists its agent: it takes snapshots of its own and resumes from them.
    bool enabled() const { return every_ms > 0 || on_stop || on_idle; }
  } checkpoint;
};

/// Parses a profile document; throws ProfileError naming the field.
Profile parse_profile(std::string_view json_text);
/// A shipped profile compiled into the binary (profiles/*.json at build time).
struct BuiltinProfile {
  const char* name;
  const char* text;
};
const std::vector<BuiltinProfile>& builtin_profiles();

/// A profile's text and where it came from: a file's path, or "built-in NAME".
struct ProfileSource {
  std::string where;
  std::string text;
};
/// Finds `name_or_path`: a path to a file (read as it is), or a name looked up in
/// $SANDBOXER_PROFILE_DIR, then the shipped profile directories (os::shipped_dirs), then among
/// the profiles compiled in. Throws ProfileError naming where it looked when none has it.
ProfileSource find_profile(const std::string& name_or_path);
/// find_profile, then parse_profile; a parse error names where the text came from.
Profile load_profile(const std::string& name_or_path);
/// Applies "a.b=value" overrides (the value parsed as JSON, or taken as a string).
void apply_override(Profile& p, const std::string& assignment);

/// "10s", "500ms", "2h", "1m", "1d" or a number of seconds; throws ProfileError.
int64_t parse_duration_ms(std::string_view s, const std::string& field);
/// "512M", "4G", "64k", "1.5G" or a number of bytes; throws ProfileError.
int64_t parse_size(std::string_view s, const std::string& field);

}  // namespace sbx::profile
