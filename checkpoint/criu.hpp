#pragma once
// Runs the criu binary as a child of the supervisor (fork + exec; the caller registers the pid
// with the Reaper at once, which collects its exit: criu is never waited for anywhere else).
#include <sys/types.h>

#include <boost/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/result.hpp"
#include "os/sys.hpp"
#include "os/unique-fd.hpp"

namespace sbx::checkpoint {

/// The first fd number the inherited fds are placed at in criu (`--inherit-fd fd[N]:...`).
inline constexpr int kCriuFirstFd = 10;

struct CriuRun {
  std::vector<std::string> args;   // after the binary's name
  std::vector<int> fds;            // placed at kCriuFirstFd + i in criu
  int netns = -1;                  // run criu (and so the tree it restores) in this network
                                   // namespace (sandbox::BranchPipes::netns), or in ours
  std::string hostname;            // if set: a fresh UTS namespace with this hostname
  bool writable_proc_sys = false;  // run criu in a mount namespace of its own without a read-only
                                   // /proc/sys over /proc (a container's): restoring a tree that
                                   // has a UTS namespace of its own writes kernel/hostname there
  std::string output;              // criu's stdout and stderr go to this file
  std::vector<int> cgroup_join;    // criu joins these cgroups first, writing "0" to each fd
                                   // (CgroupDir::open_join_fds), so the tree it restores is
                                   // counted in the copy's own group
  bool cgroup_ns = false;          // a cgroup namespace of its own once in cgroup_join's groups (or
                                   // ours), which the tree it restores gets: criu restores none
                                   // with --manage-cgroups=ignore. Where unshare fails, criu's
                                   // output says so and the copy sees the host's paths
  int run_tmpfs = -1;              // a detached tmpfs (KdatCache::fd): a clone of it is mounted on
                                   // /run in a mount namespace of criu's own, so criu keeps its
                                   // kerndat cache there from one run to the next
  std::string tmp_overlay;         // a live copy's dir D: in criu's own mount namespace, D/tmp gets
                                   // the copy's /tmp overlay (the host's /tmp under D/tmp-upper, as
                                   // a launched branch's), which criu binds into the tree (mnt[tmp]).
                                   // Where overlay cannot be had (an upper directory on
                                   // overlayfs), a bind of D/tmp-upper: a /tmp of the copy's own.
                                   // Without a mount namespace of criu's own, no copy
  bool own_pid_ns = false;         // criu is PID 1 of a pid namespace of its own, with /proc
                                   // mounted anew: what it signals is its own children only. For
                                   // a criu that touches no tree (the kerndat fill, KdatCache)
};

/// criu probes the kernel at every start (kerndat: namespaces, iptables, /dev/net/tun...) and
/// keeps what it found in /run/criu.kdat only where /run is a tmpfs, which it is not on every
/// host; then each criu pays ~30 ms of it again (8 copies of a fork: 8 restores and 8 lazy-pages
/// daemons). The box holds a small tmpfs that is mounted nowhere (fsopen/fsmount: it goes when
/// the box's last fd of it closes, and nothing of it stays behind on the host), and every criu it
/// runs (dump, restore, lazy-pages) sees a clone of it as its /run. No tmpfs (an old kernel, a
/// seccomp filter that refuses the new mount calls): criu probes as before.
///
/// The probe is also where criu can kill the agent. criu 4.2's compat-vDSO probe
/// (vdso_mmap_compat in criu/vdso.c) does not check its fork: when that fork fails, as at a pids
/// ceiling the agent has reached (a container's, which the supervisor shares), it calls
/// kill(-1, SIGKILL), which ends every process of criu's pid namespace but its init. So the box
/// fills the cache with a criu of its own pid namespace (CriuRun::own_pid_ns) before any criu
/// that touches a tree runs, and those load the cache and never probe.
class KdatCache {
 public:
  /// The tmpfs's mount fd, made at the first call; -1 where it cannot be made.
  int fd();

 private:
  bool tried_ = false;
  os::UniqueFd fd_;
};

/// The criu binary on PATH, or nullopt.
std::optional<std::string> find_criu();

/// Starts criu; returns its pid. Errors before exec (unshare, exec) come back as the error, with
/// the step that failed in `*failed_step` where given ("mount the copy's /tmp").
os::Result<pid_t> spawn_criu(const std::string& criu, const CriuRun& run, const char** failed_step = nullptr);

/// The most useful line of a criu log for an error message: the first "Error" line (the cause),
/// else the last line.
std::string criu_error_from_log(const std::string& log_path);

/// criu's own profile of a dump or a restore, from the stats-dump or stats-restore image it
/// writes in its work dir (a StatsEntry protobuf; criu's images/stats.proto), in
/// milliseconds and pages: for a dump {"freezing", "frozen", "memdump", "memwrite",
/// "pages_scanned", "pages_written"}, for a restore {"forking", "restore", "pages_restored"}.
/// Empty when the file is missing or not what criu writes.
boost::json::object criu_stats(const std::string& path);

/// Whether copies can be restored with lazy pages here (userfaultfd open to the supervisor, and
/// not turned off by SANDBOXER_LAZY_PAGES=0); the error says why not, for restore.done.
base::Result<void> lazy_pages_possible();

/// Marks every anonymous private mapping in the mm-*.img files of a criu images dir mergeable
/// (MADV_MERGEABLE in a VMA's madv flags, which criu's restorer applies), so that the kernel's
/// KSM merges identical pages of the copies restored from it; returns how many mappings it marked.
/// Each file is replaced atomically; marking twice changes nothing.
base::Result<int64_t> mark_mergeable(const std::string& images_dir);

/// The host's KSM (/sys/kernel/mm/ksm/run): "running", "stopped" (run is not 1: nothing is
/// merged until root sets it) or "unavailable" (no KSM in this kernel).
std::string ksm_state();

}  // namespace sbx::checkpoint
