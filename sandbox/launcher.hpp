#pragma once
// Starts a branch: ns-init as PID 1 of a new pid and mount namespace on a root of its own, or,
// where namespaces cannot be made, ns-init as a plain child subreaper ("flat" mode).
//
// ns-init's fds, by number (the contract with ns-init.cpp):
//   3 requests from the supervisor (JSON lines; the first line is the branch's config)
//   4 reports to the supervisor: a SOCK_SEQPACKET socket, one JSON line per message; a report
//     about an exec'd process carries that process's pipe or pty ends (SCM_RIGHTS), so that the
//     supervisor never reaches into ns-init for them and ns-init can be non-dumpable
//   5, 6, 7 the agent's stdin, stdout, stderr
//   8, 9 the agent channel: requests (agent writes), replies (agent reads); the agent gets them
//        as its fds 3 and 4 (SANDBOXER_CHANNEL_FD=3,4)
#include <sys/types.h>

#include <array>

#include <boost/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/result.hpp"
#include "os/sys.hpp"

namespace sbx::sandbox {

/// Where ns-init's binary (ns_init_binary) is bound inside a namespaced branch. A bundled one
/// (scripts/bundle) finds its libraries at $ORIGIN/../lib: the bundle's lib/ directory is bound at
/// /run/sandboxer/lib beside it.
inline constexpr const char* kNsInitPath = "/run/sandboxer/bin/ns-init";
inline constexpr const char* kNsInitLibDir = "/run/sandboxer/lib";
/// Each branch's own machine id: DIR/machine-id, bound over /etc/machine-id where the host root
/// has one (a fork's copies get new ones: the id names one running system).
inline constexpr const char* kMachineIdFile = "machine-id";

/// Paths of the agent's /proc and /sys that are read-only (bound onto themselves, remounted
/// read-only) or masked (an empty read-only tmpfs, or /dev/null), as runc does.
inline constexpr const char* kKernelReadOnlyPaths[] = {"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                                                       "/proc/sysrq-trigger"};
inline constexpr const char* kKernelMaskedPaths[] = {
    "/proc/acpi",        "/proc/asound",        "/proc/interrupts", "/proc/kcore",
    "/proc/keys",        "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
    "/proc/sched_debug", "/proc/scsi",          "/sys/firmware",    "/sys/devices/virtual/powercap"};

/// Writes DIR/machine-id (32 random hex digits, as machine-id(5)) unless it exists.
void ensure_machine_id(const std::string& dir);

/// The state dir's `branches` dir (where the branches' layers are), made 0700 where missing,
/// before anything is made in it by path: a symlink there is refused (ELOOP), never followed.
/// Each branch's launch then sets its mode (0700; 0711 without namespaces).
base::Result<void> make_branches_dir(const std::string& state_dir);

inline constexpr int kNsCtlIn = 3, kNsCtlOut = 4, kNsAgentIn = 5, kNsAgentOut = 6, kNsAgentErr = 7;
inline constexpr int kNsChanReq = 8, kNsChanRep = 9;
/// ns-init's fd 11 until its agent has started: a datagram socket to the supervisor, on which the
/// agent's child writes one byte before exec. The kernel attaches the writer's pid, translated into
/// the reader's pid namespace, so the supervisor learns the agent's pid even when it has exited
/// and been reaped before the supervisor reads the "started" report.
inline constexpr int kNsAgentPid = 11;
inline constexpr int kAgentChanReq = 3, kAgentChanRep = 4;

/// The seven pipes between the supervisor and a branch (see the fd list above; `rep` is a socket
/// pair). Their inodes are what criu names them by when they cross the boundary of a dumped tree.
struct BranchPipes {
  os::Pipe req, rep, in, out, err, chan_req, chan_rep;
  os::UniqueFd pid_read, pid_write;  // kNsAgentPid's socket pair; not a pipe criu names
  /// The branch's own network namespace, when one was asked for: made here, with its loopback up,
  /// and the reports socket made inside it, since criu dumps a unix socket only from the network
  /// namespaces of the tree it dumps. The branch's child (or criu restoring a copy) enters it.
  os::UniqueFd netns;
  /// The branch's ends, in the order of ns-init's fds 3..9.
  std::array<int, 7> child_ends() const;
  /// The pipes' inodes in the same order (equal for both ends of a pipe).
  std::array<uint64_t, 7> inodes() const;
};
/// The pipes, and with `own_netns` the network namespace (an error when it cannot be made).
os::Result<BranchPipes> make_branch_pipes(bool own_netns);

/// ns-init's program for a sandboxer-init at `self_exe` (ns_init_binary), and the arguments before
/// `--flat`: sandboxer-ns-init beside it (a small binary, most of its libraries linked in: an exec of ~1 ms),
/// else sandboxer-init's own `--ns-init` mode (an install that copied the one binary).
struct NsInitBinary {
  std::string path;
  std::vector<std::string> args;  // after argv[0]
};

struct BranchSpec {
  std::string name = "main";
  std::string dir;       // state dir of the branch: root/, workspace/, tmp/ below it
  std::string self_exe;  // sandboxer-init, by its path on the host (ns-init's is found beside it)
  NsInitBinary ns_init;  // ns-init's program (stable_ns_init); empty: ns_init_binary(self_exe)
  bool want_namespaces = true;
  std::vector<std::string> masks;  // host paths the agent must not see (state dir, tokens)
  std::vector<int> cgroup_join;    // borrowed: the branch's group, one fd per hierarchy
                                   // (CgroupDir::open_join_fds); the child is in each before the
                                   // agent exists
  bool cgroup_self_join = false;   // v1's `tasks`: the child writes "0" to each itself (no global
                                   // lock); else (v2 cgroup.procs) the parent writes the child's pid
  int cgroup_dir = -1;             // borrowed, v2: the group's directory; the child is cloned into it
                                   // (clone3 CLONE_INTO_CGROUP), cgroup_join only where clone3 fails
  bool new_net = false;            // a network namespace of its own (network: none, proxy): loopback only
  /// The branch's own cgroups, as its /sys/fs/cgroup shows them (nothing else of the host's): a
  /// name under it (a v1 controller, or "" for the whole of it on v2) and the group's directory
  /// on the host, bound read-only there. Empty: the host's /sys/fs/cgroup, read-only (in a
  /// container, the container's own view).
  std::vector<std::pair<std::string, std::string>> cgroup_view;
  std::string resolv_conf;  // network: a file bound over the agent's /etc/resolv.conf
  /// Where the namespaces or the mount plan fail: run the branch without them (flat), saying why
  /// in `why_not`; else the launch fails, naming the step and `flat_refusal`, why it may not
  /// (isolation.without_namespaces: flat_fallback_refusal).
  bool flat_fallback = false;
  std::string flat_refusal;
};

/// The top-level directories a branch has of its own; the host's others are bound read-only.
inline constexpr std::string_view kOwnTopDirs[] = {"proc", "dev", "sys", "tmp", "run", "workspace"};

/// The masks to mount for `masks`: each by its real path (os::real_path; one not there is left
/// out), once, and none beneath another that is a directory (whose mask hides it already). One
/// beneath would still be a mount of the branch's namespace, which criu dumps and a live copy
/// needs the mount point of: a token file `sandboxer run` made in the masked state home, gone once
/// its box ended, failed every restore of the box's snapshots after.
std::vector<std::pair<std::string, struct stat>> outermost_masks(const std::vector<std::string>& masks);

/// The branch's writable layer, below its dir: what a filesystem snapshot copies and what each
/// restored copy gets a copy of. `root` holds the mount points and symlinks of the agent's / in a
/// snapshot and in a copy criu restored (its --root); a branch launch_branch starts has a tmpfs
/// there instead, in its own mount namespace, and its root/ on disk stays empty.
inline constexpr const char* kLayerDirs[] = {"root", "workspace", "tmp", "run"};

/// The top of the root of the running branch whose ns-init is `ns_init` (its directories, the
/// mount points, and its symlinks), made again in the directory `dest` (a snapshot's root/):
/// criu restores a copy's mount tree onto them. The live root is a tmpfs no copy of the branch's
/// dir contains. `dest` is made if missing; entries already there stay.
os::Result<void> copy_root_top(pid_t ns_init, const std::string& dest);

struct LaunchedBranch {
  pid_t pid = -1;                         // ns-init, in the supervisor's pid namespace
  bool namespaced = false;                // own pid + mount namespace and root
  std::string why_not;                    // why not namespaced
  os::UniqueFd requests;                  // supervisor -> ns-init
  os::UniqueFd reports;                   // ns-init -> supervisor (non-blocking)
  os::UniqueFd in;                        // agent stdin, write end
  os::UniqueFd out, err;                  // agent stdout / stderr, read ends (non-blocking)
  os::UniqueFd chan_req;                  // agent channel requests, read end (non-blocking)
  os::UniqueFd chan_rep;                  // agent channel replies, write end
  std::array<uint64_t, 7> pipe_inodes{};  // see BranchPipes::inodes
  os::UniqueFd agent_pid;                 // see kNsAgentPid (non-blocking); closed once read
  os::UniqueFd netns;                     // its own network namespace (BranchPipes::netns), or none

  /// The agent's pid in the supervisor's pid namespace, as the kernel recorded it when the agent's
  /// child wrote on kNsAgentPid (-1: nothing there, as for a restored branch). Reads it once.
  pid_t take_agent_pid();

  /// Takes the supervisor's ends of `p`.
  void take(BranchPipes& p);
};

/// ns-init's program for a sandboxer-init at `self_exe` (NsInitBinary above).
NsInitBinary ns_init_binary(const std::string& self_exe);

/// The copy of `bin` (sandboxer-ns-init) that a box runs every branch's ns-init from, for its
/// whole life: `<state_home>/ns-init-<size>-<mtime>-<inode>` (0755, this user's), made at the first
/// start of each installed version and kept, with the newest four of the versions before it (and
/// any a running process runs). An upgrade that replaces the installed file leaves it linked: criu
/// dumps such an ns-init's program as a file (not a deleted one, which it would not dump past
/// 1 MiB, nor restore the bind of), and a copy of it is restored from the same file. `bin` itself
/// for sandboxer-init's own --ns-init mode; an error where no copy can be had (no state dir, one
/// mounted noexec, a full disk): the caller runs `bin`.
base::Result<NsInitBinary> stable_ns_init(const NsInitBinary& bin, const std::string& state_home);

/// Starts ns-init for `spec`. The caller then writes the branch's config (argv, env, cwd,
/// grace_ms) as the first line of `requests`. Where the namespaces or the mount plan fail, falls
/// back to flat mode and says why in `why_not` if `spec.flat_fallback`, else fails with the step
/// and no child left. The caller registers the pid with its reaper at once.
base::Result<LaunchedBranch> launch_branch(const BranchSpec& spec);

/// Whether this process may create pid + mount namespaces (tried in a throwaway child); the
/// error says why not.
base::Result<void> can_make_namespaces();

}  // namespace sbx::sandbox
