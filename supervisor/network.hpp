#pragma once
// A branch's network per the profile: `host` (no isolation), `none` (a network namespace of its
// own with loopback only) or `proxy` (the same, plus the broker's sockets created inside it).
//
// The broker's listening sockets are made by a short-lived thread that setns()es into the
// agent's network namespace: a socket keeps the namespace it was made in, so the broker serves
// them from the supervisor while its own outbound connections leave from the supervisor's
// namespace. No veth, no routes, no iptables: the agent's only way out is the broker.
#include <uv.h>

#include <boost/json.hpp>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "broker/broker.hpp"
#include "loop/uv-handle.hpp"
#include "profile/profile.hpp"
#include "sandbox/launcher.hpp"

namespace sbx::supervisor {

class BranchNetwork {
 public:
  using Emit = std::function<void(boost::json::object)>;

  /// Before launch: asks for a network namespace, writes the branch's resolv.conf, and hides the
  /// credentials' files from the agent.
  static void prepare(const profile::Profile& profile, sandbox::BranchSpec& spec);
  /// The host files a branch of `profile` must not see (the credentials' files): masked in its
  /// view, so a checkpoint lists them among the mount points each copy needs.
  static std::vector<std::string> masked_files(const profile::Profile& profile);

  /// After launch, before the agent starts (or a restored copy runs): brings up loopback in the
  /// branch's namespace and, for `proxy`, reads the secrets and starts the broker there, at the
  /// profile's address and port. Events reach `emit` on the loop; refusals name `proc`.
  /// Throws std::runtime_error naming what failed (never with a secret in it).
  BranchNetwork(uv_loop_t* loop, const profile::Profile& profile, const sandbox::LaunchedBranch& branch, Emit emit,
                const std::string& proc = "main");
  ~BranchNetwork();
  BranchNetwork(const BranchNetwork&) = delete;
  BranchNetwork& operator=(const BranchNetwork&) = delete;

  /// The agent's environment: proxy variables, placeholders and base URLs in; the supervisor's
  /// own proxy settings and credential sources out.
  void edit_env(std::vector<std::string>& env) const;

  /// For `box.started`.
  boost::json::object describe() const;

 private:
  void drain() noexcept;

  const profile::Profile& profile_;
  Emit emit_;
  loop::UvHandle<uv_async_t> async_;
  std::mutex mu_;
  std::vector<boost::json::object> queue_;
  std::unique_ptr<broker::Broker> broker_;
};

/// Reads a credential's value from its file or the supervisor's environment. Throws
/// std::runtime_error naming the credential and the source, never the value.
std::string load_secret(const profile::Credential& c);

}  // namespace sbx::supervisor
