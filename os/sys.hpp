#pragma once
// Thin, non-throwing helpers over syscalls. Errors come back as boost::system::result.
#include <sys/stat.h>
#include <sys/types.h>

#include <time.h>
#include <boost/system/result.hpp>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/result.hpp"
#include "os/unique-fd.hpp"

namespace sbx::os {

template <class T>
using Result = boost::system::result<T>;

/// An error_code from errno as it is now.
boost::system::error_code last_error() noexcept;

/// An error_code for the errno value `e` (ENOENT, ENOTSUP, ...), as last_error gives errno's.
boost::system::error_code sys_error(int e) noexcept;

/// A pipe with both ends close-on-exec; `flags` adds O_NONBLOCK etc.
Result<Pipe> make_pipe(int flags = 0) noexcept;

/// Writes all of `data`, retrying on EINTR and short writes (blocking fds).
Result<void> write_all(int fd, std::string_view data) noexcept;

/// Writes `line` and a newline after it, in one writev where the fd takes it (no copy of the
/// line to add the newline); retries like write_all.
Result<void> write_line(int fd, std::string_view line) noexcept;

/// Reads until EOF (blocking fd).
Result<std::string> read_all(int fd);

/// Reads a whole file (or a pipe to its end). A FIFO is opened without waiting for a writer: one
/// that no process writes gives ENODATA at once.
Result<std::string> read_file(const std::string& path);

/// A time as nanoseconds since the epoch (a stat's st_ctim, a clock's reading), and the realtime
/// clock's now so.
inline int64_t ns_of(const timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec; }
int64_t realtime_ns();
/// How long after a change a file's or directory's times may not show a later one: on a
/// filesystem of coarse timestamps (ext4 of 128-byte inodes keeps seconds, FAT two) a change in
/// the same tick as a read leaves them as they were. What changed this close to a read is read
/// again (as git's "racily clean" entries).
inline constexpr int64_t kTimesStillNs = 2'000'000'000;
/// The same where a time has a fraction of a second, so that its filesystem keeps finer ones (one
/// of seconds keeps none): set from the kernel's coarse clock, at most a tick (1-10 ms) behind the
/// realtime clock a read's time comes from.
inline constexpr int64_t kFineTimesStillNs = 100'000'000;
/// Of `coarse_ns` and `fine_ns` (kTimesStillNs, kFineTimesStillNs), the window for the file `st`
/// describes: the fine one where its ctime has a fraction of a second (a ctime no one can set).
inline int64_t still_window_ns(const struct stat& st, int64_t coarse_ns, int64_t fine_ns) {
  return st.st_ctim.tv_nsec != 0 ? fine_ns : coarse_ns;
}

/// Calls fn(line) for each line of `text` (a /proc file's), without its '\n'.
void for_each_line(std::string_view text, const std::function<void(std::string_view)>& fn);
/// The space-separated fields of `line` (a run of spaces is one separator), the first `most` of
/// them; fewer where it has fewer.
std::vector<std::string_view> fields_of(std::string_view line, size_t most = SIZE_MAX);

/// What a writer that is not root may still take of the filesystem of `fd` (or `path`): its bytes
/// (f_bavail), and its inodes where it has a fixed number of them (none on btrfs).
struct FreeRoom {
  uint64_t bytes = 0;
  std::optional<uint64_t> inodes;
};
Result<FreeRoom> free_room(int fd) noexcept;
Result<FreeRoom> free_room(const std::string& path) noexcept;

/// Whether `st` is a regular file of this user's that no one else may write (no write bit for
/// its group or others): what a file must be before the supervisor trusts what it says.
bool only_ours_to_write(const struct stat& st) noexcept;

/// The whole of `name`, one component below `dirfd`, opened with open_beneath (below): no symlink
/// followed, no FIFO waited on. EPERM where it is not only_ours_to_write, EFBIG past `max_bytes`.
/// For the caches the supervisor keeps in the user's state dir.
Result<std::string> read_own_file_at(int dirfd, const std::string& name, size_t max_bytes);

/// Writes a whole file atomically: a temporary beside it, then rename. The directory is reached
/// by path (it must be one only the supervisor writes); the file itself goes through
/// write_file_atomic_at, so a symlink at its place or at any temporary name is never followed.
/// `written`, where given, receives the fstat of the file written (its device and inode name it
/// even after another writer's rename has replaced it at `path`).
Result<void> write_file_atomic(const std::string& path, std::string_view data, mode_t mode = 0644,
                               struct stat* written = nullptr);

/// mkdir -p, by path: for directories only the supervisor writes (use make_dirs_at below where an
/// agent writes).
Result<void> make_dirs(const std::string& path, mode_t mode = 0755);

/// `path` with every symlink resolved and no `.` or `..` (realpath(3)), with its stat; nullopt
/// where it cannot be resolved (it does not exist, or a directory on the way cannot be searched).
std::optional<std::pair<std::string, struct stat>> real_path(const std::string& path);

// Files the supervisor writes where an agent writes too (a branch's /run, /tmp, workspace) are
// reached from a directory fd the supervisor trusts, never by a path an agent could bend with a
// symlink: nothing below `dirfd` is followed, and nothing leaves it.

/// openat2's RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS (linux/openat2.h).
inline constexpr uint64_t kResolveNoLinks = 0x08 | 0x04 | 0x02;

/// Opens `rel` below `dirfd` with openat2 and `resolve` (by default kResolveNoLinks: no `..` out,
/// no symlink on the way or at the end, ELOOP); retried while a rename races it (EAGAIN).
/// O_CLOEXEC is added.
Result<UniqueFd> open_beneath(int dirfd, const std::string& rel, int flags, mode_t mode = 0,
                              uint64_t resolve = kResolveNoLinks) noexcept;

/// Opens a directory the caller trusts by its path (the state dir, a branch's dir), with
/// O_DIRECTORY | O_NOFOLLOW: the fd the *_at helpers start from.
Result<UniqueFd> open_dir(const std::string& path) noexcept;

/// mkdir -p of `rel` below `dirfd`, one component at a time: mkdirat (`mode`, set with fchmod
/// on a new directory), and an existing component is used only when it is a directory (ENOTDIR
/// for a file, ELOOP for a symlink). Returns the last directory, open.
Result<UniqueFd> make_dirs_at(int dirfd, const std::string& rel, mode_t mode = 0755);

/// Writes `name` (one component) in `dirfd` atomically: a temporary with a random name, created
/// O_EXCL | O_NOFOLLOW and given `mode` with fchmod, then renamed over `name` (rename replaces a
/// symlink there and never follows it).
Result<void> write_file_atomic_at(int dirfd, const std::string& name, std::string_view data, mode_t mode = 0644,
                                  struct stat* written = nullptr);

/// The same with the first `size` bytes of the file open at `src` for the data, copied with
/// copy_range: ENODATA where `src` ends before `size`.
Result<void> copy_file_atomic_at(int dirfd, const std::string& name, int src, uint64_t size, mode_t mode = 0644);

/// Copies `len` bytes at offset `at` of the regular file `in` to the same offset of `out`, in the
/// kernel (copy_file_range; pread and pwrite where a pair of filesystems refuses it). Returns the
/// bytes copied: fewer where `in` ends first.
Result<uint64_t> copy_range(int in, int out, uint64_t at, uint64_t len);

/// "/proc/self/fd/N": the magic link to what fd N holds, which a path-taking call (open, chmod,
/// linkat) follows to that inode and no other, where the call has no form that takes an O_PATH fd.
struct FdPath {
  explicit FdPath(int fd) noexcept;
  const char* c_str() const noexcept { return path; }
  char path[32];
};

/// Opens the inode an O_PATH fd holds, again, with `flags` (through its FdPath): what was
/// checked with fstat is exactly what gets opened.
Result<UniqueFd> reopen(int fd, int flags) noexcept;

/// What a file type is called in messages: "a FIFO", "a socket", "a character device", ...
const char* file_type_name(mode_t mode) noexcept;

/// A directory opened without following a symlink at its last component, checked by that fd to
/// be a directory owned by this user.
struct OwnDir {
  UniqueFd fd;
  struct stat st {};
};
/// Fails naming what `dir` is instead ("DIR is a symlink, not a directory", "DIR belongs to uid
/// N, not to this user (uid M)", "open DIR: ...").
base::Result<OwnDir> open_own_dir(const std::string& dir);

/// Makes `dir` (0700) if it is missing, then checks, by the fd it opens, that it is a directory
/// (not a symlink), owned by this user and reachable by nobody else (a wider mode is narrowed).
/// In a world-writable place another user may have made it first: then it fails, saying so.
base::Result<void> own_private_dir(const std::string& dir);

/// Takes an exclusive flock(2) on the directory `dir` itself, for as long as the fd returned
/// stays open (no file is made: a new inode costs some filesystems ~0.3 ms). Held by another
/// process: EWOULDBLOCK, with the holder's pid as /proc/locks shows it in `holder` ("" where it
/// shows none); a shared lock (dir_lock_held asking) is waited out, 100 ms at most.
Result<UniqueFd> lock_dir(const std::string& dir, std::string* holder = nullptr);

/// Whether a process holds lock_dir's lock on `dir` now (its pid in `holder`, "" where unknown):
/// a shared lock asked for without waiting and let go at once; the holder's pid from /proc/locks.
/// Nothing is made or changed.
bool dir_lock_held(const std::string& dir, std::string* holder = nullptr);

/// A mount as /proc/self/mountinfo lists it: where (its escapes undone) and its filesystem type.
struct MountPoint {
  std::string path;
  std::string fstype;
};

/// The mounts at `dir` or below it in this process's mount namespace, the last mounted first (a
/// mount before the one under it, the top of a stack first): the order to unmount them in. `dir`
/// is an absolute path without symlinks, as mountinfo names mount points. Empty if /proc is not
/// there to read. `pid`: in that process's mount namespace instead (its /proc/PID/mountinfo).
std::vector<MountPoint> mounts_under(const std::string& dir, pid_t pid = 0);

/// Unmounts every mount at or below `dir`, in mounts_under's order, calling `released` for each:
/// a plain unmount (an ext4 writes its data back and frees its loop device); a tmpfs still busy
/// is detached. Stops at the first it cannot unmount (a busy ext4: mounting its image again would
/// corrupt it): "unmount PATH (TYPE): REASON", code "busy".
base::Result<void> release_mounts_under(const std::string& dir, const std::function<void(const MountPoint&)>& released);

/// A directory a process holds lock_dir's lock on.
struct LockedDir {
  pid_t pid = 0;
  std::string path;  // as this process sees it (the same directory: checked by its inode)
};

/// The directories that processes running the program named `exe_name` (the last part of
/// /proc/PID/exe) hold lock_dir's lock on, from their open fds and the locks each fd's fdinfo
/// lists; those whose fds this process may not read, or whose path names another directory here
/// (another mount namespace's), are left out.
std::vector<LockedDir> dirs_locked_by(const std::string& exe_name);

/// Where a box started without --state-dir keeps its state dir (one directory each, named at
/// random): $XDG_STATE_HOME/sandboxer/boxes, else ~/.local/state/sandboxer/boxes, else
/// /var/lib/sandboxer/boxes. `sandboxer ps` lists the running ones there.
std::string default_box_root();

/// This user's state directory: $XDG_STATE_HOME/sandboxer, else ~/.local/state/sandboxer, else
/// (no home) /tmp/sandboxer-UID, checked with own_private_dir (whose failure it returns).
base::Result<std::string> state_home();

Result<void> set_nonblocking(int fd, bool on = true) noexcept;

/// The bytes sent on TCP socket `fd` that the peer's kernel has acknowledged (tcp_info's
/// tcpi_bytes_acked). They move while the peer reads, however slowly; once its receive buffer is
/// full, only when it reads. ENOTSOCK/ENOPROTOOPT for a socket that is not TCP.
Result<uint64_t> tcp_bytes_acked(int fd) noexcept;

/// The pids of the direct children of `pid` (all threads), from /proc/PID/task/*/children.
std::vector<pid_t> children_of(pid_t pid);

/// Every descendant of `pid` (not `pid` itself), parents before their children; at most `limit`.
std::vector<pid_t> descendants_of(pid_t pid, size_t limit = 100000);

/// This process's executable (/proc/self/exe), and the directory it is in ("" / "." if unknown).
std::string exe_path();
std::string exe_dir();
/// Where the shipped files under `sub` ("profiles", "images", "scripts") may be, in the order to
/// try: an install prefix or a build tree (BIN/../share/sandboxer/SUB, which the build stages),
/// a bundle (BIN/../SUB), the source tree a build directory sits in (BIN/../../SUB), then
/// /etc/sandboxer/SUB and /usr/share/sandboxer/SUB. BIN is the running binary's directory.
std::vector<std::string> shipped_dirs(const std::string& sub);

/// Random bytes as lowercase hex (getrandom).
std::string random_hex(size_t bytes);

/// The name of a signal without "SIG" ("TERM"), or its number as text.
std::string signal_name(int sig);
/// Parses "TERM", "SIGTERM" or "15"; nullopt if unknown.
std::optional<int> parse_signal(std::string_view s);

}  // namespace sbx::os
