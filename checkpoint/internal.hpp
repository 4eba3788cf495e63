#pragma once
// Helpers shared by the checkpointer's files (checkpointer.cpp, restore.cpp, store.cpp); not for
// use outside checkpoint/.
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

#include <boost/json.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "archive/archive.hpp"
#include "base/result.hpp"

namespace sbx::checkpoint::detail {

inline std::shared_ptr<spdlog::logger> log() {
  static auto l = spdlog::default_logger()->clone("criu");
  return l;
}

/// What tells a file changed: its identity, size and change times.
inline bool same_file(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
         a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec &&
         a.st_ctim.tv_sec == b.st_ctim.tv_sec && a.st_ctim.tv_nsec == b.st_ctim.tv_nsec;
}

inline double now_ms() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

inline double round_ms(double v) { return static_cast<double>(static_cast<int64_t>(v * 10 + 0.5)) / 10; }

inline boost::json::object error_reply(const std::string& code, const std::string& msg) {
  return {{"ok", false}, {"error", {{"code", code}, {"message", msg}}}};
}

/// The roles of the seven pipes between the supervisor and a branch, in the order of ns-init's
/// fds 3..9 (sandbox/launcher.hpp): how a live snapshot's manifest names their inodes.
inline constexpr const char* kPipeRoles[] = {"requests", "reports",          "stdin",          "stdout",
                                             "stderr",   "channel_requests", "channel_replies"};
/// Those of them that are unix sockets: the reports (a snapshot before that has no "sockets").
inline constexpr const char* kSocketRoles[] = {"reports"};
/// criu's key for a branch's own network namespace, dumped as external (the supervisor makes
/// one for each branch and copy: sandbox::make_branch_pipes) and given back at restore.
inline constexpr const char* kNetnsKey = "branch-net";
/// criu's keys (with the index in the manifest's cgroup_view) for the branch's own groups, bound
/// in its /sys/fs/cgroup: dumped as external, each copy given its own.
inline const std::string kCgroupKey = "cg-";

/// Continues every process of the tree below `root` (whose pidfd is `root_fd`), through pidfds.
void continue_tree(pid_t root, int root_fd);

/// What the processes of the tree below `root` hold that its layer's copy and criu must heed,
/// read from /proc (each process's maps once).
struct TreeFiles {
  /// With `ghosts`, the first file or directory one of them holds open, maps, runs or is in whose
  /// last link is gone, on a mount that process sees read-only, said as "process PID (COMM) holds
  /// \"PATH\" (on the read-only mount POINT)". criu carries such a file in a dump's images (a
  /// ghost file) and its restore writes it back beside its old path, remounting that mount
  /// writable for it: where the mount is a read-only bind of the host's own directory (a library
  /// an upgrade replaced in /usr), into the host's directory.
  std::optional<std::string> host_ghost;
  /// The files (device, inode) they map shared and writable: written through such a mapping, a
  /// file's times move at a page's first write fault only (on ext4 again after the page was
  /// written back; tmpfs writes none back), so a layer copy kept by its times (os::sync_tree)
  /// copies them again.
  std::set<std::pair<dev_t, ino_t>> mapped;
  /// With `ghosts`, the regular files whose last link is gone that they hold open, map or run, on
  /// any mount but the kernel's internal ones: criu carries each in the dump's images, whole (its
  /// --ghost-limit is a file's size). Their count, their sizes' sum, and the largest, said as
  /// "process PID (COMM) holds \"PATH\"".
  struct Deleted {
    std::set<std::pair<dev_t, ino_t>> files;
    uint64_t bytes = 0;
    uint64_t largest_bytes = 0;
    std::string largest;
  } deleted;
};
TreeFiles tree_files(pid_t root, int root_fd, bool ghosts);

/// An archive received into the store's dir `dir` (the file `tmp`): extracted and checked while a
/// second thread hashes it (its id), then filed as <id>.tar.zst with its extraction as <id>.d,
/// neither replacing what is there. Errors: bad_snapshot, untrusted; `tmp` is left to the caller.
struct Filed {
  std::string id;
  boost::json::object manifest;  // with "verified"
  bool existing = false;         // the store had this archive already
  bool linked = false;           // <id>.tar.zst is the operator's file, linked (Checkpointer::unshare_archive)
  struct stat linked_stat {};    // its stat once filed
};
/// With `operator_file`, the archive is that file (--restore): linked into `tmp` where it is on
/// the store's mount and only the supervisor's user can write it, else copied beside its extraction.
base::Result<Filed> extract_and_file(const std::string& tmp, const std::string& dir,
                                     const archive::ImportPolicy& policy, const std::string& operator_file = {});

}  // namespace sbx::checkpoint::detail
