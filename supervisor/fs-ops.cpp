#include "supervisor/fs-ops.hpp"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string_view>
#include <vector>

#include "base/encoding.hpp"
#include "os/files.hpp"
#include "os/sys.hpp"

namespace sbx::supervisor {

using protocol::RequestError;

namespace {

constexpr size_t kMaxTarget = 4095;  // a symlink's text: PATH_MAX less its NUL

[[noreturn]] void fail(const std::string& path, int err) {
  std::string code = err == EXDEV || err == ELOOP    ? "path_escape"
                     : err == ENOENT                 ? "not_found"
                     : err == EACCES || err == EPERM ? "permission_denied"
                     : err == ENOTDIR                ? "not_a_directory"
                     : err == EISDIR                 ? "is_a_directory"
                     : err == ENOTEMPTY              ? "not_empty"
                     : err == EEXIST                 ? "exists"
                                                     : "io_error";
  std::string why = err == EXDEV || err == ELOOP ? "resolves outside the allowed roots" : std::strerror(err);
  throw RequestError(code, path + ": " + why);
}

// The root a path belongs to and the rest of it, relative ("." for the root itself).
std::pair<const std::string*, std::string> split(const FsRoots& roots, const std::string& path) {
  if (path.empty()) throw RequestError("bad_request", "field path: empty");
  if (path.find('\0') != std::string::npos) throw RequestError("bad_request", "field path: contains a NUL byte");
  auto under = [&](std::string_view prefix) {
    return path == prefix || (path.size() > prefix.size() && path.starts_with(prefix) && path[prefix.size()] == '/');
  };
  const std::string* root;
  std::string rest;
  if (path[0] != '/') {
    root = &roots.workspace;
    rest = path;
  } else if (under("/workspace")) {
    root = &roots.workspace;
    rest = path.substr(10);
  } else if (under("/tmp") && !roots.tmp.empty()) {
    root = &roots.tmp;
    rest = path.substr(4);
  } else {
    throw RequestError("path_escape", path + ": outside the allowed roots (/workspace, /tmp)");
  }
  size_t skip = rest.find_first_not_of('/');
  rest = skip == std::string::npos ? std::string() : rest.substr(skip);
  if (rest.empty()) return {root, std::string(1, '.')};
  return {root, rest};
}

// The workspace's own symlinks resolve, as long as they stay beneath it. An fd, or -1 and errno.
int open_beneath(int dirfd, const std::string& rel, int flags, mode_t mode) {
  auto fd = os::open_beneath(dirfd, rel, flags, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS);
  if (!fd) {
    errno = fd.error().value();
    return -1;
  }
  return fd->release();
}

os::UniqueFd open_root(const std::string& root, const std::string& path) {
  os::UniqueFd r(::open(root.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!r) fail(path, errno);
  return r;
}

void remove_tree(int dirfd, const std::string& name, const std::string& path, int depth) {
  if (depth > 256) throw RequestError("io_error", path + ": directory tree too deep");
  if (::unlinkat(dirfd, name.c_str(), 0) == 0) return;
  if (errno != EISDIR) fail(path, errno);
  int sub = open_beneath(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW, 0);
  if (sub < 0) fail(path, errno);
  os::UniqueFd dir(sub);
  auto names = os::names_in(dir.get());
  if (!names) fail(path, names.error().value());
  for (auto& n : *names) remove_tree(dir.get(), n, path + "/" + n, depth + 1);
  if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0) fail(path, errno);
}

// A symlink's text, read from its directory (never followed), as `target`.
void add_target(boost::json::object& o, int dirfd, const char* name) {
  char buf[kMaxTarget + 1];
  ssize_t n = ::readlinkat(dirfd, name, buf, sizeof buf);
  if (n < 0 || static_cast<size_t>(n) > kMaxTarget) return;
  base::put_bytes_field(o, "target", std::string_view(buf, static_cast<size_t>(n)));
}

const char* type_of(mode_t m) { return S_ISREG(m) ? "file" : S_ISDIR(m) ? "dir" : S_ISLNK(m) ? "symlink" : "other"; }

}  // namespace

os::UniqueFd fs_open(const FsRoots& roots, const std::string& path, int flags, mode_t mode, std::string* last_out) {
  auto [root, rel] = split(roots, path);
  auto rfd = open_root(*root, path);
  if (last_out) {
    auto slash = rel.rfind('/');
    std::string parent = slash == std::string::npos ? "." : rel.substr(0, slash);
    *last_out = slash == std::string::npos ? rel : rel.substr(slash + 1);
    if (*last_out == "." || *last_out == ".." || last_out->empty())
      throw RequestError("bad_request", path + ": names no entry of its own (a root, . or ..)");
    rel = parent;
    flags = O_RDONLY | O_DIRECTORY;
  }
  int fd = open_beneath(rfd.get(), rel, flags, mode);
  if (fd < 0) fail(path, errno);
  return os::UniqueFd(fd);
}

os::UniqueFd fs_open_file(const FsRoots& roots, const std::string& path, int flags, mode_t mode, bool* created) {
  // Nothing but a regular file is ever opened for its content: the entry is taken as O_PATH
  // (which opens no FIFO, device or socket: no open that blocks, no driver's open), checked, and
  // only then the same inode is opened to read or write. A swap between the two changes nothing.
  auto [root, rel] = split(roots, path);
  auto rfd = open_root(*root, path);
  int access = flags & O_ACCMODE;
  for (int attempt = 0; attempt < 8; ++attempt) {
    int pfd = open_beneath(rfd.get(), rel, O_PATH, 0);
    if (pfd < 0 && errno == ENOENT && (flags & O_CREAT)) {
      // A new file, made here: O_EXCL, so nothing that appeared meanwhile is written through.
      int fd =
          open_beneath(rfd.get(), rel, access | O_CREAT | O_EXCL | O_NOFOLLOW | O_NOCTTY | (flags & O_APPEND), mode);
      if (fd >= 0) {
        if (created) *created = true;
        return os::UniqueFd(fd);
      }
      if (errno == EEXIST) continue;
      fail(path, errno);
    }
    if (pfd < 0) fail(path, errno);
    os::UniqueFd p(pfd);
    struct stat st {};
    if (::fstat(p.get(), &st) != 0) fail(path, errno);
    if (S_ISDIR(st.st_mode))
      throw RequestError("is_a_directory", path + ": is a directory" + (access == O_RDONLY ? " (use fs.list)" : ""));
    if (!S_ISREG(st.st_mode))
      throw RequestError("not_a_file", path + ": not a regular file: " + os::file_type_name(st.st_mode));
    // O_NONBLOCK: a lease the agent holds on the file (fcntl F_SETLEASE) makes a blocking open wait
    // for it to be given up, 45 s (lease-break-time), on the loop: EWOULDBLOCK instead. A regular
    // file's reads and writes do not heed the flag.
    auto f = os::reopen(p.get(), (flags & ~(O_CREAT | O_EXCL)) | O_NOCTTY | O_NONBLOCK);
    if (!f && f.error().value() == EWOULDBLOCK)
      throw RequestError("busy",
                         path + ": the agent holds a lease on it (fcntl F_SETLEASE); try again once it lets go");
    if (!f) fail(path, f.error().value());
    return std::move(*f);
  }
  throw RequestError("io_error", path + ": it keeps changing while it is opened");
}

MadeFile MadeFile::of(const FsRoots& roots, const std::string& path, int fd) noexcept {
  MadeFile m;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return m;
  try {
    m.dir_ = fs_open(roots, path, O_PATH, 0, &m.name_);
  } catch (const std::exception&) {
    return m;
  }
  m.dev_ = st.st_dev;
  m.ino_ = st.st_ino;
  return m;
}

MadeFile& MadeFile::operator=(MadeFile&& o) noexcept {
  if (this != &o) {
    remove();
    dir_ = std::move(o.dir_);
    name_ = std::move(o.name_);
    target_ = std::move(o.target_);
    dev_ = o.dev_;
    ino_ = o.ino_;
  }
  return *this;
}

std::optional<std::string> MadeFile::commit() noexcept {
  if (!dir_ || target_.empty()) {
    keep();
    return std::nullopt;
  }
  // Still the file it made: the agent may have put something else under the replacement's name.
  struct stat st {};
  if (::fstatat(dir_.get(), name_.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_dev != dev_ || st.st_ino != ino_) {
    dir_.reset();
    return std::string("the new file ") + name_ + " was removed or replaced before it took the name";
  }
  if (::renameat(dir_.get(), name_.c_str(), dir_.get(), target_.c_str()) != 0) {
    std::string err = std::strerror(errno);
    remove();
    return err;
  }
  keep();
  return std::nullopt;
}

os::UniqueFd fs_open_replacement(const FsRoots& roots, const std::string& path, std::optional<mode_t> mode,
                                 MadeFile& made) {
  std::string last;
  auto dir = fs_open(roots, path, O_PATH, 0, &last);
  struct stat old {};
  bool replaces = ::fstatat(dir.get(), last.c_str(), &old, AT_SYMLINK_NOFOLLOW) == 0;
  if (!replaces && errno != ENOENT) fail(path, errno);
  if (replaces && S_ISDIR(old.st_mode)) throw RequestError("is_a_directory", path + ": is a directory");
  // As fs.write without atomic opens only a regular file: a FIFO, device, socket or symlink there
  // is refused, not replaced (nor written through).
  if (replaces && !S_ISREG(old.st_mode))
    throw RequestError("not_a_file", path + ": not a regular file: " + os::file_type_name(old.st_mode));
  mode_t m = mode.value_or(replaces ? old.st_mode & 07777 : 0644);
  std::string name = ".sbx-write-" + os::random_hex(8);
  os::UniqueFd fd(
      ::openat(dir.get(), name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC, 0600));
  if (!fd) fail(path, errno);
  struct stat st {};
  ::fstat(fd.get(), &st);
  made.remove();
  made.dir_ = std::move(dir);
  made.name_ = name;
  made.target_ = last;
  made.dev_ = st.st_dev;
  made.ino_ = st.st_ino;
  // Owner first (chown clears set-id bits), then the mode, past the umask.
  if (replaces && ::fchown(fd.get(), old.st_uid, old.st_gid) != 0) fail(path, errno);
  if (::fchmod(fd.get(), m) != 0) fail(path, errno);
  return fd;
}

void MadeFile::remove() noexcept {
  if (!dir_) return;
  struct stat st {};
  if (::fstatat(dir_.get(), name_.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == dev_ && st.st_ino == ino_)
    ::unlinkat(dir_.get(), name_.c_str(), 0);
  dir_.reset();
}

boost::json::object fs_stat(const FsRoots& roots, const std::string& path, bool follow) {
  struct stat st {};
  boost::json::object o;
  base::put_bytes_field(o, "path", path);
  // Not followed: the entry itself, from its directory (a root, or a path ending in '/', is
  // followed as lstat(2) would).
  if (!follow && split(roots, path).second != "." && !path.ends_with('/')) {
    std::string last;
    auto dir = fs_open(roots, path, O_PATH, 0, &last);
    if (::fstatat(dir.get(), last.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) fail(path, errno);
    if (S_ISLNK(st.st_mode)) add_target(o, dir.get(), last.c_str());
  } else {
    auto fd = fs_open(roots, path, O_PATH);
    if (::fstat(fd.get(), &st) != 0) fail(path, errno);
  }
  o["type"] = type_of(st.st_mode);
  o["size"] = static_cast<uint64_t>(st.st_size);
  o["mode"] = static_cast<uint64_t>(st.st_mode & 07777);
  o["mtime"] = static_cast<double>(st.st_mtim.tv_sec) + st.st_mtim.tv_nsec / 1e9;
  return o;
}

namespace {

// One entry of a listing. A name is any bytes but '/' and NUL: one that is not UTF-8 has its
// bytes in name_b64. An entry gone since the directory was read has its name only.
boost::json::object list_entry(int dir, const char* name) {
  boost::json::object o;
  base::put_bytes_field(o, "name", name);
  struct stat st {};
  if (::fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
    o["type"] = type_of(st.st_mode);
    o["size"] = static_cast<uint64_t>(st.st_size);
    o["mode"] = static_cast<uint64_t>(st.st_mode & 07777);
    if (S_ISLNK(st.st_mode)) add_target(o, dir, name);
  }
  return o;
}

}  // namespace

boost::json::array fs_list(const FsRoots& roots, const std::string& path, size_t max_entries) {
  auto fd = fs_open(roots, path, O_RDONLY | O_DIRECTORY);
  boost::json::array out;
  bool more = false;
  auto r = os::for_each_name(fd.get(), [&](const char* n) {
    if (out.size() == max_entries) {
      more = true;
      return false;
    }
    out.push_back(list_entry(fd.get(), n));
    return true;
  });
  if (!r) fail(path, r.error().value());
  if (more)
    throw RequestError("limit", path + ": holds more than " + std::to_string(max_entries) +
                                    " entries: ask for it in pages (fs.list with limit, then after the last name)");
  return out;
}

struct ListWindows::Window {
  std::string workspace, path;  // what it was read from
  dev_t dev = 0;
  ino_t ino = 0;
  timespec mtime{}, ctime{};
  std::string last;     // the last name given: the `after` its next page is asked with
  std::string names;    // the names past `last`, sorted, each ended by a NUL
  size_t next = 0;      // where in `names` the next page starts
  bool beyond = false;  // the directory has names past the window's last
  bool racy = false;    // changed too close to its read for its times to show a later change
  uint64_t used_ms = 0;
};

namespace {

using Window = ListWindows::Window;

// Reads into `w` the lowest names of `fd` (the directory `st` describes) past `after`, as many as
// `bound` holds: a heap of them, its top the highest kept; a name popped to keep the bound sets
// the ceiling, past which nothing is kept (the window stays one run of the sorted names, and says
// more are beyond it).
void read_window(Window& w, int fd, const struct stat& st, const std::string& after, size_t bound,
                 const std::string& path) {
  w.dev = st.st_dev;
  w.ino = st.st_ino;
  w.mtime = st.st_mtim;
  w.ctime = st.st_ctim;
  std::vector<std::string> names;
  size_t bytes = 0;
  std::string ceiling;
  bool beyond = false;
  auto r = os::for_each_name(fd, [&](const char* name) {
    std::string_view n = name;
    if (n <= after || (beyond && n >= ceiling)) return true;
    names.emplace_back(n);
    std::push_heap(names.begin(), names.end());
    bytes += n.size() + sizeof(std::string);
    while (bytes > bound && names.size() > 1) {
      std::pop_heap(names.begin(), names.end());
      bytes -= names.back().size() + sizeof(std::string);
      ceiling = std::move(names.back());
      names.pop_back();
      beyond = true;
    }
    return true;
  });
  if (!r) fail(path, r.error().value());
  std::sort_heap(names.begin(), names.end());
  // Swapped out, not cleared: the buffer of the window read before is given back.
  std::string().swap(w.names);
  size_t total = 0;
  for (auto& n : names) total += n.size() + 1;
  w.names.reserve(total);
  for (auto& n : names) w.names.append(n).push_back('\0');
  w.last = after;
  w.next = 0;
  w.beyond = beyond;
}

bool same_time(const timespec& a, const timespec& b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; }

// Whether the directory `st` describes changed within `still_ns` of now, taken after `st` (or in
// the future: a clock not ours); within `fine_still_ns` where its ctime has a fraction.
bool changed_lately(const struct stat& st, int64_t still_ns, int64_t fine_still_ns) {
  return std::max(os::ns_of(st.st_mtim), os::ns_of(st.st_ctim)) >
         os::realtime_ns() - os::still_window_ns(st, still_ns, fine_still_ns);
}

// Whether `w` holds the next page of this listing: the same directory, unchanged, asked past the
// name it gave last, with `limit` names in it (or all that are left).
bool serves(const Window& w, const FsRoots& roots, const std::string& path, const struct stat& st, size_t limit,
            const std::string& after) {
  if (w.racy || after.empty() || w.last != after || w.path != path || w.workspace != roots.workspace) return false;
  if (w.dev != st.st_dev || w.ino != st.st_ino || !same_time(w.mtime, st.st_mtim) || !same_time(w.ctime, st.st_ctim))
    return false;
  if (!w.beyond) return true;
  auto left = std::count(w.names.begin() + static_cast<ptrdiff_t>(w.next), w.names.end(), '\0');
  return static_cast<size_t>(left) >= limit;
}

// The next page from `w`: up to `limit` entries, at most kMaxListPageBytes of them.
ListPage serve(Window& w, int fd, size_t limit) {
  ListPage page;
  size_t bytes = 0;
  while (w.next < w.names.size() && page.entries.size() < limit) {
    const char* n = w.names.c_str() + w.next;
    size_t len = std::strlen(n);
    auto e = list_entry(fd, n);
    bytes += boost::json::serialize(e).size() + 1;
    if (bytes > kMaxListPageBytes && !page.entries.empty()) break;
    page.entries.push_back(std::move(e));
    w.last.assign(n, len);
    w.next += len + 1;
  }
  page.more = w.next < w.names.size() || w.beyond;
  return page;
}

}  // namespace

ListWindows::ListWindows(size_t bytes, int64_t still_ns, int64_t fine_still_ns)
    : bytes_(bytes), still_ns_(still_ns), fine_still_ns_(fine_still_ns) {}
ListWindows::~ListWindows() = default;

ListPage ListWindows::page(const FsRoots& roots, const std::string& path, size_t limit, const std::string& after,
                           uint64_t now_ms) {
  auto fd = fs_open(roots, path, O_RDONLY | O_DIRECTORY);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(path, errno);
  auto it = std::find_if(windows_.begin(), windows_.end(),
                         [&](const auto& w) { return serves(*w, roots, path, st, limit, after); });
  if (it == windows_.end()) {
    // A new listing, or one whose window no longer serves: read for it (in the window it had,
    // whose `last` is this `after`, else in a new one).
    it = std::find_if(windows_.begin(), windows_.end(), [&](const auto& w) {
      return !after.empty() && w->last == after && w->path == path && w->workspace == roots.workspace;
    });
    if (it == windows_.end()) {
      if (windows_.size() >= kWindows) windows_.pop_back();
      it = windows_.insert(windows_.end(), std::make_unique<Window>());
    }
    auto& w = **it;
    w.workspace = roots.workspace;
    w.path = path;
    try {
      bool racy = changed_lately(st, still_ns_, fine_still_ns_);  // now as the read begins, after `st`
      read_window(w, fd.get(), st, after, bytes_, path);
      w.racy = racy;
    } catch (...) {
      windows_.erase(it);
      throw;
    }
    ++reads_;
  }
  windows_.splice(windows_.begin(), windows_, it);
  auto& w = *windows_.front();
  w.used_ms = now_ms;
  auto page = serve(w, fd.get(), limit);
  if (!page.more) windows_.pop_front();
  return page;
}

void ListWindows::expire(uint64_t now_ms) {
  windows_.remove_if([&](const auto& w) { return now_ms - w->used_ms >= kIdleMs; });
}

void fs_remove(const FsRoots& roots, const std::string& path, bool recursive) {
  std::string last;
  auto dir = fs_open(roots, path, O_RDONLY, 0, &last);
  if (recursive) return remove_tree(dir.get(), last, path, 0);
  if (::unlinkat(dir.get(), last.c_str(), 0) == 0) return;
  if (errno == EISDIR && ::unlinkat(dir.get(), last.c_str(), AT_REMOVEDIR) == 0) return;
  fail(path, errno);
}

void fs_mkdir(const FsRoots& roots, const std::string& path, mode_t mode) {
  std::string last;
  auto dir = fs_open(roots, path, O_RDONLY, 0, &last);
  if (::mkdirat(dir.get(), last.c_str(), 0700) == 0) {
    // Its mode set on what was made, whatever the umask: the new directory, taken without
    // following what may have replaced it since.
    int fd = open_beneath(dir.get(), last, O_RDONLY | O_DIRECTORY | O_NOFOLLOW, 0);
    if (fd < 0) fail(path, errno);
    os::UniqueFd made(fd);
    if (::fchmod(made.get(), mode) != 0) fail(path, errno);
    return;
  }
  int err = errno;
  struct stat st {};
  if (err == EEXIST && ::fstatat(dir.get(), last.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(st.st_mode))
    throw RequestError("exists", path + ": exists and is not a directory: it is " + os::file_type_name(st.st_mode));
  if (err != EEXIST) fail(path, err);
}

void fs_symlink(const FsRoots& roots, const std::string& path, const std::string& target) {
  if (target.empty()) throw RequestError("bad_request", "field target: empty");
  if (target.find('\0') != std::string::npos) throw RequestError("bad_request", "field target: contains a NUL byte");
  if (target.size() > kMaxTarget)
    throw RequestError("bad_request",
                       "field target: " + std::to_string(target.size()) + " bytes, past " + std::to_string(kMaxTarget));
  std::string last;
  auto dir = fs_open(roots, path, O_RDONLY, 0, &last);
  if (::symlinkat(target.c_str(), dir.get(), last.c_str()) != 0) fail(path, errno);
}

void fs_chmod(const FsRoots& roots, const std::string& path, mode_t mode) {
  // The entry itself, or what a symlink names inside the same root (as fs.read and fs.write
  // reach it); O_PATH opens no FIFO or device, and the mode is set through the fd's magic link
  // (fchmod refuses an O_PATH fd), which names that inode and no other.
  auto fd = fs_open(roots, path, O_PATH);
  if (::chmod(os::FdPath(fd.get()).c_str(), mode) != 0) fail(path, errno);
}

void fs_rename(const FsRoots& roots, const std::string& from, const std::string& to, bool replace) {
  if (split(roots, from).first != split(roots, to).first)
    throw RequestError("cross_root", from + " -> " + to +
                                         ": the two are in different roots (/workspace, /tmp); copy it with fs.read "
                                         "and fs.write");
  std::string from_name, to_name;
  auto from_dir = fs_open(roots, from, O_RDONLY, 0, &from_name);
  auto to_dir = fs_open(roots, to, O_RDONLY, 0, &to_name);
  // Each end is a name in a directory held open: what a symlink at either end names is never
  // reached (the link itself moves, or is replaced).
  if (::renameat2(from_dir.get(), from_name.c_str(), to_dir.get(), to_name.c_str(), replace ? 0 : RENAME_NOREPLACE) ==
      0)
    return;
  int err = errno;
  if (err == ENOENT) {
    struct stat st {};
    if (::fstatat(from_dir.get(), from_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) fail(from, ENOENT);
    fail(to, ENOENT);
  }
  if (err == EXDEV)
    throw RequestError("cross_device",
                       from + " -> " + to + ": on different mounts (copy it with fs.read and fs.write)");
  if (err == EINVAL)
    throw RequestError("bad_request", from + " -> " + to +
                                          ": cannot be renamed there (a directory into itself, or a filesystem "
                                          "that cannot rename without replacing)");
  if (err == EEXIST) {
    struct stat st {};
    std::string there = ::fstatat(to_dir.get(), to_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0
                            ? std::string(os::file_type_name(st.st_mode))
                            : std::string("an entry");
    throw RequestError("exists", to + ": exists (" + there + "); set replace to replace it");
  }
  // What is at `to` does not fit what moves there: a directory not empty, or of the other type.
  if (err == ENOTEMPTY || err == EISDIR || err == ENOTDIR) fail(to, err);
  fail(from, err);
}

}  // namespace sbx::supervisor
