#pragma once
#include <linux/filter.h>

#include <boost/json.hpp>
#include <string>
#include <vector>

#include "profile/profile.hpp"

namespace sbx::sandbox {

/// The ns-init mode of sandboxer-init: PID 1 of a branch's pid namespace (or, with `flat`, a
/// child subreaper). Reaps the agent's orphans, forwards signals to the agent's process group,
/// runs the shutdown (TERM, grace, KILL) and reports the agent's raw wait status. See launcher.hpp
/// for its fds.
int ns_init_main(bool flat);

/// ns-init's configuration for a branch's agent: the first line the supervisor writes on its
/// requests pipe (fd 3), read by ns_init_main. The agent's command, environment and working
/// directory; the profile's grace period and its process policy for this host (policy.hpp:
/// `landlock_abi` is the kernel's, `namespaced` whether the branch has namespaces of its own,
/// `seccomp` the profile's program: cached_seccomp). The box's main branch and every cold copy
/// are started with it.
boost::json::object ns_init_config(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                                   const std::string& cwd, const profile::Profile& profile, int landlock_abi,
                                   bool namespaced, const std::vector<struct sock_filter>& seccomp);

}  // namespace sbx::sandbox
