#pragma once
// The policy applied to the agent between fork and exec (in ns-init), in this order:
//   cgroup (ns-init joined the branch's group before it ran, so the agent is born inside),
//   oom_score_adj 1000, the capability bounding set cleared to the profile's, gid/groups/uid,
//   the kept capabilities (ambient for a non-root agent), RLIMIT_CORE=0 and the profile's
//   rlimits, no_new_privs, Landlock (the best ABI the kernel has), seccomp last.
// Everything that allocates (the seccomp program, the Landlock ruleset, capability masks) is
// prepared before the fork; the child only makes plain syscalls.
#include <linux/filter.h>
#include <sys/types.h>

#include <boost/json.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "os/unique-fd.hpp"
#include "profile/profile.hpp"

namespace sbx::sandbox {

struct HostCapabilities;

/// Checks `p` against this host before anything starts: an rlimit above the hard limit, an
/// unknown capability name, a seccomp file that does not parse, a network mode this supervisor
/// cannot enforce. Throws ProfileError naming the field.
void check_profile_for_host(const profile::Profile& p);

/// Whether this process can apply `p`'s user (CAP_SETGID, and CAP_SETUID for another uid) and
/// capabilities (CAP_SETPCAP narrows the bounding set) to an agent: a supervisor that is not root,
/// outside a user namespace of its own, holds none of them. Throws ProfileError naming what is
/// missing and how to run such a box (check_profile_for_host calls it; `sandboxer doctor` too).
void check_supervisor_privileges(const profile::Profile& p);

/// Whether a branch's agent shares the supervisor's network namespace: `network: host`, or no
/// namespaces at all. There it could read the API's loopback traffic (the bearer token crosses
/// it in clear) with a raw socket, so it never keeps CAP_NET_RAW, whatever the profile says.
bool shares_host_network(const profile::Profile& p, bool namespaced);

/// The policy part of ns-init's branch config, from the profile. `landlock_abi` is the kernel's;
/// `host_net` (shares_host_network) adds CAP_NET_RAW to the capabilities always dropped;
/// `seccomp` is the profile's program, built by the supervisor (cached_seccomp; empty: none),
/// which ns-init loads as it is ("seccomp_bpf", base64).
boost::json::object policy_to_json(const profile::Profile& p, int landlock_abi, bool host_net,
                                   const std::vector<struct sock_filter>& seccomp);

/// What is enforced, for `box.started` (field -> how, or "not enforced: why").
boost::json::object describe_enforcement(const profile::Profile& p, const boost::json::object& cgroup_state,
                                         int landlock_abi, bool namespaced);

/// Host paths holding credentials the agent must never see (masked by mounts): the CLI's token
/// store, SSH and cloud credentials of the supervisor's user and of root, a pod's service-account
/// tokens, the host's password hashes, TLS private keys and SSH host keys.
std::vector<std::string> credential_paths();

/// This process's effective and permitted capability sets (a bit per capability), or nullopt
/// where capget fails.
struct CapSets {
  uint64_t effective = 0, permitted = 0;
};
std::optional<CapSets> own_capabilities();

struct PreparedPolicy {
  bool set_oom_score = true;
  bool have_ids = false;
  uid_t uid = 0;
  gid_t gid = 0;
  // In a user namespace whose /proc/PID/setgroups says "deny" (the rule for one whose gid_map an
  // unprivileged user wrote: `unshare --map-root-user`, rootless), setgroups(2) fails for every
  // process in it: the supplementary groups cannot be dropped, and are left as they are.
  bool setgroups_denied = false;
  bool caps = false;       // false: capabilities untouched
  uint64_t keep_mask = 0;  // capabilities kept (bit per capability); never one of "drop"
  int cap_last = 0;        // highest capability number of this kernel
  bool set_nofile = false;
  uint64_t nofile = 0;
  os::UniqueFd landlock;                    // ruleset fd, or none
  std::vector<struct sock_filter> seccomp;  // empty: no filter
};

/// Builds the policy in ns-init before the fork. Throws std::runtime_error naming the problem
/// (a seccomp program that is not a whole one, a seccomp description instead of a program).
PreparedPolicy prepare_policy(const boost::json::object& policy);

/// In the forked child: applies `p` in the documented order with plain syscalls (no allocation).
/// Returns 0, or an errno with `*step` set to the step's index (see policy_step_name).
int apply_policy(const PreparedPolicy& p, int* step) noexcept;
const char* policy_step_name(int step) noexcept;

/// In a fresh network namespace: sets `lo` up (no allocation). Returns 0 or an errno.
int bring_up_loopback() noexcept;

/// The seccomp program of a policy description ({"policy": "default"|"none"} or
/// {"policy": "file", "deny": [...], "enosys": [...]}), exported by libseccomp. Empty for none.
std::vector<struct sock_filter> build_seccomp(const boost::json::object& desc);
/// The most instructions a seccomp program may have (the kernel's BPF_MAXINSNS).
inline constexpr size_t kMaxSeccompInstructions = 4096;
/// `bytes` as a program: nullopt unless they are 1 to kMaxSeccompInstructions whole instructions.
std::optional<std::vector<struct sock_filter>> seccomp_program_from(std::string_view bytes);
/// A program's bytes, as seccomp_program_from takes them back.
std::string_view seccomp_program_bytes(const std::vector<struct sock_filter>& prog) noexcept;

/// The program of a policy description, as build_seccomp gives it, kept in `cache_dir` (the
/// user's state dir) for the next box: a file `seccomp-<hash>.bpf`, 0600, whose first line is
/// what the program was built from (the description, libseccomp's version and the API level it
/// found, the architecture, the kernel's release and version) and is compared whole before the
/// rest is used. A file that is not this user's, others can write, is a symlink, or names other
/// inputs is not read (and is replaced). Building is ~0.1 ms of libseccomp's work per branch
/// start (docs/architecture.md, "Start-up"); reading the cache a few syscalls.
struct SeccompProgram {
  std::vector<struct sock_filter> program;  // empty: no filter
  bool from_cache = false;
  std::string cache_error;  // why the cache was not used or written ("": it was)
};
SeccompProgram cached_seccomp(const boost::json::object& desc, const std::string& cache_dir);

/// Reads a seccomp policy file into a description; throws ProfileError naming the field.
boost::json::object seccomp_description(const std::string& setting);

/// The syscalls the default policy refuses with EPERM (clone with namespace flags, socket() of
/// AF_PACKET/AF_ALG/AF_VSOCK and clone3 -> ENOSYS are extra rules).
const std::vector<std::string>& default_denied_syscalls();

}  // namespace sbx::sandbox
