#include "profile/agent-env.hpp"

#include <pwd.h>

#include <cstdlib>
#include <stdexcept>

namespace sbx::profile {

namespace {

std::string_view key_of(std::string_view kv) { return kv.substr(0, kv.find('=')); }

// Sets KEY=VALUE in `env`, replacing an earlier value of KEY in place.
void put(std::vector<std::string>& env, std::string kv) {
  auto key = key_of(kv);
  for (auto& e : env)
    if (key_of(e) == key) {
      e = std::move(kv);
      return;
    }
  env.push_back(std::move(kv));
}

}  // namespace

bool env_name_is_reserved(std::string_view name) {
  if (name.starts_with("SANDBOXER_TOKEN")) return true;
  for (const char* n : {"SANDBOXER_BOX", "SANDBOXER_BRANCH", "SANDBOXER_WORKSPACE", "SANDBOXER_CHANNEL_FD",
                        "SANDBOXER_RESUMED", "SANDBOXER_SNAPSHOT"})
    if (name == n) return true;
  return false;
}

base::Result<void> check_env_name(std::string_view name) {
  if (name.empty()) return base::fail("an environment variable name is not empty");
  if (name.find('=') != std::string_view::npos) {
    // Appended rather than "\"" + name: GCC 12 at -O3 warns (-Wrestrict) on the latter.
    std::string msg(1, '"');
    msg.append(name).append("\": a name holds no '='");
    return base::fail(std::move(msg));
  }
  if (name.find('\0') != std::string_view::npos) return base::fail("a name holds no NUL byte");
  if (env_name_is_reserved(name))
    return base::fail(std::string(name) +
                      " is the supervisor's own (it sets it for the agent, or keeps it from the agent)");
  return {};
}

std::string parse_env_assignment(const std::string& arg) {
  auto eq = arg.find('=');
  std::string name = arg.substr(0, eq);
  if (auto ok = check_env_name(name); !ok) throw std::invalid_argument("--env " + arg + ": " + ok.error().message);
  if (arg.find('\0') != std::string::npos) throw std::invalid_argument("--env: a value holds no NUL byte");
  if (eq != std::string::npos) return arg;
  const char* v = std::getenv(name.c_str());
  return v ? name + "=" + v : "";
}

std::vector<std::string> build_agent_env(const AgentEnvSpec& spec) {
  std::vector<std::string> env;
  if (spec.inherit) {
    for (auto& kv : spec.supervisor_env)
      if (!env_name_is_reserved(key_of(kv))) put(env, kv);
  } else {
    env.push_back(std::string("PATH=") + kDefaultAgentPath);
    env.push_back("HOME=" + spec.home);
    for (auto& kv : spec.supervisor_env)
      if (key_of(kv) == "TERM" || key_of(kv) == "LANG") put(env, kv);
  }
  for (auto& [k, v] : spec.profile_env)
    if (!env_name_is_reserved(k)) put(env, k + "=" + v);
  for (auto& kv : spec.extra)
    if (!env_name_is_reserved(key_of(kv))) put(env, kv);
  return env;
}

std::string home_of(unsigned uid) {
  // getpwuid_r: the supervisor may have threads (the broker's).
  struct passwd pw {
  }, *res = nullptr;
  char buf[4096];
  if (::getpwuid_r(uid, &pw, buf, sizeof buf, &res) == 0 && res && res->pw_dir && *res->pw_dir) return res->pw_dir;
  return "/";
}

}  // namespace sbx::profile
