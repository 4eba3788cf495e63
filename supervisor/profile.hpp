#pragma once
// Sandbox profiles (profiles/*.json): named, versioned; parsed strictly, so an unknown field, a
// wrong type or an impossible value is refused with the field's path in the message.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace sbx::supervisor {

struct ProfileError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Profile {
  std::string name = "default";
  int version = 1;
  struct Resources {
    int64_t grace_ms = 10000;
  } resources;
  struct Isolation {
    bool namespaces = true;
  } isolation;
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
