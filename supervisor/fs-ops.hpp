#pragma once
// File operations of the protocol, confined to a branch's roots: a path names `/workspace/...`
// (or a path relative to it) or `/tmp/...`; each is opened with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_MAGICLINKS) under the root's directory (on the host, or the running agent's own
// /tmp reached through its ns-init's root: Box::branch_tmp), so `..` and symlinks cannot leave
// it.
#include <sys/types.h>

#include <boost/json.hpp>
#include <cstdint>
#include <list>
#include <memory>
#include <string>

#include "os/sys.hpp"
#include "os/unique-fd.hpp"
#include "protocol/protocol.hpp"

namespace sbx::supervisor {

struct FsRoots {
  std::string workspace;  // host directory seen as /workspace
  std::string tmp;        // directory seen as /tmp (Box::branch_tmp)
};

/// Opens `path` with `flags` (O_CLOEXEC is added). Throws protocol::RequestError naming the path
/// and the reason: path_escape, not_found, ... `parent_out`: when set, opens the parent directory
/// instead and stores the last component there.
os::UniqueFd fs_open(const FsRoots& roots, const std::string& path, int flags, mode_t mode = 0644,
                     std::string* last_out = nullptr);

/// Opens the regular file at `path` to read or write it (`flags`: O_RDONLY or O_WRONLY with
/// O_CREAT, O_TRUNC, O_APPEND). Anything else there (a FIFO, a device, a socket, a directory) is
/// refused without being opened: RequestError "not_a_file" / "is_a_directory" naming the path and
/// the type ("not a regular file: a FIFO"). `created`, when given, says whether the file was made
/// by this open (O_CREAT, nothing there before).
os::UniqueFd fs_open_file(const FsRoots& roots, const std::string& path, int flags, mode_t mode = 0644,
                          bool* created = nullptr);

/// A file an fs.write made, removed again when this goes unless kept: a write that fails (a full
/// disk) or an upload cut off leaves nothing it made behind, and gives its space back. Removed
/// by its directory and name (opened beneath the root as any fs op), and only while that entry
/// is still the same file. A file that was there before is not this: it stays as the write left it.
class MadeFile {
 public:
  MadeFile() = default;
  /// The file `fd`, just made at `path`; an empty MadeFile where its directory cannot be opened.
  static MadeFile of(const FsRoots& roots, const std::string& path, int fd) noexcept;
  MadeFile(MadeFile&&) noexcept = default;
  MadeFile& operator=(MadeFile&& o) noexcept;
  ~MadeFile() { remove(); }
  /// The write succeeded: the file stays.
  void keep() noexcept { dir_.reset(); }
  /// The write succeeded: a replacement (fs_open_replacement) takes its target's name now, in one
  /// rename (whatever was there goes then, and not before); any other file stays, as keep(). The
  /// error where that rename failed: the replacement is removed and what was there stays.
  std::optional<std::string> commit() noexcept;

 private:
  void remove() noexcept;
  friend os::UniqueFd fs_open_replacement(const FsRoots&, const std::string&, std::optional<mode_t>, MadeFile&);
  os::UniqueFd dir_;
  std::string name_;
  std::string target_;  // a replacement's: the name it takes at commit()
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

/// A new file beside `path` (`.sbx-write-` and random hex, in its directory, opened beneath the
/// root as any fs op) that replaces the entry at `path` once written (made.commit()): a reader
/// sees the old file whole or the new one whole, and a write that fails or is cut off leaves the
/// old one as it was (made removes the new one). Its mode is `mode`, else the replaced regular
/// file's, else 0644; it gets the replaced file's owner. A directory at `path` is is_a_directory;
/// any other entry but a regular file (a FIFO, a device, a socket, a symlink) is not_a_file.
os::UniqueFd fs_open_replacement(const FsRoots& roots, const std::string& path, std::optional<mode_t> mode,
                                 MadeFile& made);

/// The type, size, mode and mtime of what `path` names; with `follow` false, of the entry itself
/// (a symlink there is not followed, and its text comes in `target`, `target_b64`).
boost::json::object fs_stat(const FsRoots& roots, const std::string& path, bool follow = true);
/// The largest page fs.list gives (its `limit`; a whole listing holds no more), and the most bytes of entries in one.
inline constexpr int64_t kMaxListLimit = 100000;
inline constexpr size_t kMaxListPageBytes = 512u << 10;
/// The entries of the directory at `path`, in the order the directory gives them: at most
/// `max_entries` (a directory holding more is `limit`, to be asked for in pages: its whole
/// listing, built on the loop, held up every other client ~2 s for 500,000 names).
boost::json::array fs_list(const FsRoots& roots, const std::string& path, size_t max_entries = kMaxListLimit);
/// A page of them (ListWindows::page): the first `limit` names past `after` in byte order,
/// sorted, up to kMaxListPageBytes of entries (an SDK takes text frames of 1 MiB), and whether
/// more follow.
struct ListPage {
  boost::json::array entries;
  bool more = false;
};
/// The paged listings going on, each with the lowest names past the page it gave, read with it (a
/// window). Reading a directory's names is the cost of a page (the kernel's readdir of them all:
/// 0.25 s of the loop for 500,000 names on tmpfs), so its next page, asked with `after` the last
/// name given, costs only its own entries while the directory is the same one, unchanged (its
/// inode, mtime and ctime: a name made or removed since is seen, as by a listing read anew); else,
/// or once the window runs short, the directory is read again past `after`. Kept by the server, not
/// a connection: the CLI asks each page on a connection of its own. A window goes when its listing
/// ends (a page without `more`), when kWindows newer ones are asked for, or after kIdleMs unused
/// (expire()).
///
/// A directory whose mtime or ctime is within `still_ns` (os::kTimesStillNs) of its read is not
/// trusted to show a later change: a name made in the same tick as the read, after it, can leave
/// both unchanged. Its window serves no next page: that page reads the directory again, until it
/// has been still that long. Where its ctime has a fraction of a second (a filesystem of fine
/// times, set from the kernel's coarse clock), `fine_still_ns` (os::kFineTimesStillNs) instead,
/// as the layer's sync does (os::still_window_ns).
class ListWindows {
 public:
  static constexpr size_t kWindows = 4;
  static constexpr uint64_t kIdleMs = 30000;
  /// The most a window holds, counted as each name's bytes and a std::string's while it is read.
  static constexpr size_t kBytes = 8u << 20;
  explicit ListWindows(size_t bytes = kBytes, int64_t still_ns = os::kTimesStillNs,
                       int64_t fine_still_ns = os::kFineTimesStillNs);
  ~ListWindows();
  ListWindows(const ListWindows&) = delete;
  ListWindows& operator=(const ListWindows&) = delete;
  ListPage page(const FsRoots& roots, const std::string& path, size_t limit, const std::string& after, uint64_t now_ms);
  void expire(uint64_t now_ms);
  size_t size() const { return windows_.size(); }
  /// Directory reads made for pages (tests).
  uint64_t reads() const { return reads_; }

  struct Window;

 private:
  size_t bytes_;
  int64_t still_ns_;
  int64_t fine_still_ns_;
  uint64_t reads_ = 0;
  std::list<std::unique_ptr<Window>> windows_;  // the most recently used first
};
void fs_remove(const FsRoots& roots, const std::string& path, bool recursive);
/// Makes the directory `path` with `mode` (not narrowed by the umask). A directory there already
/// is fine, as it is; anything else there is `exists`.
void fs_mkdir(const FsRoots& roots, const std::string& path, mode_t mode = 0755);
/// Makes a symlink at `path` whose text is `target` (any text up to 4095 bytes, kept as it is:
/// the fs ops resolve it later beneath the root, as any other). An entry there is `exists`.
void fs_symlink(const FsRoots& roots, const std::string& path, const std::string& target);
/// Sets the permission bits of `path` (a symlink there: of what it names, within the root).
void fs_chmod(const FsRoots& roots, const std::string& path, mode_t mode);
/// Renames the entry at `from` (a file, a directory, a symlink: the entry itself, never what a
/// symlink names) to `to`, in the same root. An entry at `to` is kept (`exists`) unless `replace`;
/// a rename across the roots is refused (`cross_root`), as is one onto another mount of the same
/// root (`cross_device`, a mount the agent made) and a directory into itself (`bad_request`).
void fs_rename(const FsRoots& roots, const std::string& from, const std::string& to, bool replace);

}  // namespace sbx::supervisor
