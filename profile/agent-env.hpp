#pragma once
// The agent's environment. It starts clean, as `docker run` does: a fixed PATH, HOME, TERM and
// LANG when the supervisor has them, the profile's `env`, then `--env K=V`; the supervisor's own
// environment (the operator's shell: cloud keys, tokens) reaches the agent only with
// `--env-inherit`. The supervisor's identity variables (SANDBOXER_BOX, ...) are added last by the
// box and cannot be set by any of these.
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.hpp"

namespace sbx::profile {

/// docker's default PATH, the agent's unless the profile or --env sets one.
inline constexpr const char* kDefaultAgentPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Whether `name` may be set in the agent's environment by a profile or --env; the error says why
/// not: empty, holds '=' or NUL, or is one the supervisor owns (SANDBOXER_TOKEN*, SANDBOXER_BOX,
/// SANDBOXER_BRANCH, SANDBOXER_WORKSPACE, SANDBOXER_CHANNEL_FD, SANDBOXER_RESUMED, SANDBOXER_SNAPSHOT).
base::Result<void> check_env_name(std::string_view name);
/// True for the names the supervisor sets or keeps to itself (see check_env_name).
bool env_name_is_reserved(std::string_view name);

/// Parses one `--env` value: "K=V", or "K" alone for K's value in `environ` (skipped, returning
/// "", when unset there, as docker does). Throws std::invalid_argument naming what is wrong.
std::string parse_env_assignment(const std::string& arg);

struct AgentEnvSpec {
  bool inherit = false;                     // --env-inherit: start from `environ` instead
  std::vector<std::string> supervisor_env;  // the supervisor's environment (KEY=VALUE)
  std::string home = "/root";               // the agent user's home
  std::map<std::string, std::string> profile_env;
  std::vector<std::string> extra;  // --env, KEY=VALUE, later ones win
};

/// The agent's environment before the box adds its identity variables: never any reserved name.
std::vector<std::string> build_agent_env(const AgentEnvSpec& spec);

/// The home directory of `uid` in this host's passwd, else "/".
std::string home_of(unsigned uid);

}  // namespace sbx::profile
