#pragma once
// Starts a branch: ns-init as PID 1 of a new pid and mount namespace on a root of its own, or,
// where namespaces cannot be made, ns-init as a plain child subreaper ("flat" mode).
//
// ns-init's fds, by number (the contract with ns-init.cpp):
//   3 requests from the supervisor (JSON lines; the first line is the branch's config)
//   4 reports to the supervisor (JSON lines)
//   5, 6, 7 the agent's stdin, stdout, stderr
#include <sys/types.h>

#include <boost/json.hpp>
#include <string>
#include <vector>

#include "os/sys.hpp"

namespace sbx::supervisor {

/// Where ns-init's binary (the supervisor's own) is bound inside a namespaced branch. A bundled
/// sandboxer-init (scripts/bundle) finds its libraries at $ORIGIN/../lib: its lib/ directory is
/// bound at /run/sandboxer/lib beside it.
inline constexpr const char* kNsInitPath = "/run/sandboxer/bin/sandboxer-init";
inline constexpr const char* kNsInitLibDir = "/run/sandboxer/lib";

inline constexpr int kNsCtlIn = 3, kNsCtlOut = 4, kNsAgentIn = 5, kNsAgentOut = 6, kNsAgentErr = 7;

struct BranchSpec {
  std::string name = "main";
  std::string dir;            // state dir of the branch: root/, workspace/, tmp/ below it
  std::string self_exe;       // sandboxer-init, by its path on the host (bound at kNsInitPath inside)
  bool want_namespaces = true;
  std::vector<std::string> masks;  // host paths the agent must not see (state dir, tokens)
  std::vector<int> cgroup_procs;   // borrowed: cgroup.procs of the branch's group, one per hierarchy;
                                   // the child joins each before it runs anything of its own
  bool new_net = false;            // a network namespace of its own (network: none): loopback only
};

struct LaunchedBranch {
  pid_t pid = -1;           // ns-init, in the supervisor's pid namespace
  bool namespaced = false;  // own pid + mount namespace and root
  std::string why_not;      // why not namespaced
  os::UniqueFd requests;    // supervisor -> ns-init
  os::UniqueFd reports;     // ns-init -> supervisor (non-blocking)
  os::UniqueFd in;          // agent stdin, write end
  os::UniqueFd out, err;    // agent stdout / stderr, read ends (non-blocking)
};

/// Starts ns-init for `spec`. The caller then writes the branch's config (argv, env, cwd,
/// grace_ms) as the first line of `requests`. Falls back to flat mode when the namespaces or the mount plan
/// fail, and says why in `why_not`. The caller registers the pid with its reaper at once.
os::Result<LaunchedBranch> launch_branch(const BranchSpec& spec);

/// Whether this process may create pid + mount namespaces (tried in a throwaway child).
bool can_make_namespaces(std::string* why_not);

}  // namespace sbx::supervisor
