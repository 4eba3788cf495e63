#pragma once
// Whole trees of files: copied by fd without following symlinks, measured, removed.
#include <sys/types.h>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/result.hpp"
#include "os/sys.hpp"

namespace sbx::os {

/// Calls fn(name) for each entry of the directory `fd` but . and .., in the order the directory
/// gives them from its offset on (a directory just opened: all of them), read through a duplicate
/// of `fd` that is closed after (`fd` stays open: what is listed can be opened relative to it
/// meanwhile); false from fn stops. The error: the listing's errno.
Result<void> for_each_name(int fd, const std::function<bool(const char*)>& fn);
/// The same, with each entry's type as readdir gives it (DT_DIR, DT_REG, ...; DT_UNKNOWN where the
/// filesystem does not say).
Result<void> for_each_entry(int fd, const std::function<bool(const char*, unsigned char)>& fn);
/// The names so listed.
Result<std::vector<std::string>> names_in(int fd);

/// How much a copy may write: at most `bytes` of file data in all (each inode once, its holes
/// not), else it stops before the data that would pass them and fails with code `code`, naming
/// the bound as `what` says (e.g. "the branch's disk ceiling (resources.disk)").
/// With `keep_bytes`, it leaves that much space free on the destination's filesystem, read from
/// it before each extent (so that other writers count too: two copies that each were given the
/// free space less the journal's room once, at their start, together took the journal's room);
/// code no_space, said by `keep_what`.
/// With `keep_inodes`, it leaves that many inodes free there: it stops before a new file,
/// directory or symlink once fewer than keep_inodes + kInodeStep are free (read every kInodeStep
/// new inodes; a filesystem that has no fixed number of inodes, as btrfs, bounds nothing); code
/// no_space, said by `inodes_what`. An agent's empty files cost no bytes: without this, a copy of
/// millions of them took every inode of the state dir's filesystem.
struct CopyBound {
  uint64_t bytes = UINT64_MAX;
  std::string what;
  std::string code = "limit";
  std::optional<uint64_t> keep_bytes;
  std::string keep_what;
  uint64_t keep_inodes = 0;
  std::string inodes_what;
  static constexpr uint64_t kInodeStep = 64;
  /// Set (by another thread), the copy stops before its next entry or extent: code cancelled.
  const std::atomic<bool>* cancel = nullptr;
};

/// What a copy_tree read of each regular file and symlink, by its path below the directory the
/// copy's root is in (its own name first): the source's inode, type, ctime and size as fstat gave
/// them before its data was read, and the data bytes its copy took (0 for a further name of an
/// inode, linked). For a later sync_tree of the same trees. Kept by a 64-bit hash of the path
/// (~80 bytes an entry), and at most `max_entries` of them: past that, what is not recorded is
/// copied again by the sync, as a changed entry is (a layer of millions of files costs the
/// supervisor no more than that many entries' memory).
struct CopyRecord {
  struct Entry {
    ino_t ino = 0;
    int64_t ctime_ns = 0;
    off_t size = 0;
    uint64_t bytes = 0;
    mode_t type = 0;  // S_IFREG or S_IFLNK
  };
  std::unordered_map<uint64_t, Entry> entries;
  size_t max_entries = SIZE_MAX;
  bool full = false;       // entries were left out past max_entries
  int64_t started_ns = 0;  // CLOCK_REALTIME as the copy began
  /// Of the entries, those the walk that made the record copied (a sync_tree's: not kept).
  uint64_t renewed = 0;
  void add(const std::string& path, const Entry& e);
  const Entry* find(const std::string& path) const;
};

/// Recursive copy of a directory tree (dirs, regular files, symlinks; owner and mode of each kept)
/// into `dst`, which must not exist: a copy is never merged into what is there. Nothing below
/// `src` or `dst` is reached through a symlink (symlinks are copied as symlinks); other file types
/// (sockets, FIFOs, devices) are skipped. `src` itself must be a directory or a regular file, not
/// a symlink. A file's data extents are copied and its holes stay holes (lseek SEEK_DATA /
/// SEEK_HOLE; a plain copy where the filesystem has neither), and names of one inode within the
/// tree stay names of one inode (its data copied once, the other names hard links to it).
/// Returns the bytes of file data written, or what failed (the bound's code past `bound`).
base::Result<uint64_t> copy_tree(const std::string& src, const std::string& dst, const CopyBound& bound = {},
                                 CopyRecord* record = nullptr);

/// Which entries sync_tree may keep.
struct SyncPolicy {
  /// A source changed this close before the record began (or after) is copied again: on a
  /// filesystem of coarse timestamps a change in the same tick as its read leaves its ctime as it was.
  int64_t still_ns = kTimesStillNs;
  /// The same for a source whose ctime has a fraction of a second (kFineTimesStillNs).
  int64_t fine_still_ns = kFineTimesStillNs;
  /// Inodes (device, inode) copied again whatever their times say: files mapped shared and
  /// writable, whose writes through a page written before move no time (only a page's first write
  /// fault does, and on ext4 the first after it was written back; tmpfs writes none back).
  std::set<std::pair<dev_t, ino_t>> always;
  /// Where a filesystem's times are not known to follow its files' data (a network or FUSE one): a
  /// file kept by its times is also kept only where its data reads the same as its copy's.
  bool compare_data = false;
};

/// Brings `dst`, a copy_tree of `src` made with `record`, to what `src` holds now, as a new
/// copy_tree of it would be: a file or symlink whose source at the same path is the same inode,
/// with the type, ctime and size recorded (a write, chmod, chown, link, unlink or rename moves the
/// ctime), is kept unless `policy` says otherwise; every other entry is copied anew, and what
/// `src` no longer holds is removed. Directories get their owner and mode again; names of one
/// inode stay names of one inode. Returns the data bytes of the whole copy (kept and new), within
/// `bound`, or what failed. `src` must be a directory, as `dst` is. With `next`, the synced copy's
/// own record goes there (begun as the sync began; the entries kept carried over, those copied
/// anew as read now), for a later sync of the same trees: a sync while the source still runs
/// leaves the last one, once it is stopped, only what changed meanwhile.
base::Result<uint64_t> sync_tree(const std::string& src, const std::string& dst, const CopyRecord& record,
                                 const SyncPolicy& policy, const CopyBound& bound = {}, CopyRecord* next = nullptr);

/// copy_tree with each regular file a hard link to the source's (one inode, no data copied):
/// both on one filesystem, for a tree that is read but never written in place. Returns the bytes
/// of the regular files linked.
base::Result<uint64_t> link_tree(const std::string& src, const std::string& dst);

/// The same as copy_tree for the contents of the directory `src`, into the directory `dst`, which
/// exists and is empty (a mount point just made for them, such as a copy's workspace with its
/// disk ceiling) but for a filesystem's own lost+found; `dst` gets `src`'s owner and mode.
base::Result<uint64_t> copy_tree_into(const std::string& src, const std::string& dst, const CopyBound& bound = {});

/// rm -rf; errors are ignored.
void remove_tree(const std::string& path);

/// Removes the entry `name` of the directory `dirfd` and, where it is a directory, everything
/// below it, children first, each reached from its parent's fd: no symlink is followed (one is
/// removed as itself, and a directory swapped for one meanwhile is not opened through it) and no
/// mount is entered (one is named, and nothing above it removed). Stops at the first failure,
/// named by `shown` (the entry's path for a person) and the names below it; an entry already gone
/// is no failure.
base::Result<void> remove_tree_at(int dirfd, const std::string& name, const std::string& shown);

/// Bytes of regular files under `path`.
uint64_t tree_bytes(const std::string& path);

}  // namespace sbx::os
