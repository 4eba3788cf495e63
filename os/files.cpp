#include "os/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "os/sys.hpp"
#include "os/unique-fd.hpp"

namespace sbx::os {

namespace fs = std::filesystem;

void CopyRecord::add(const std::string& path, const Entry& e) {
  if (entries.size() >= max_entries) {
    full = true;
    return;
  }
  entries[std::hash<std::string>{}(path)] = e;
}

const CopyRecord::Entry* CopyRecord::find(const std::string& path) const {
  auto it = entries.find(std::hash<std::string>{}(path));
  return it == entries.end() ? nullptr : &it->second;
}

Result<void> for_each_name(int fd, const std::function<bool(const char*)>& fn) {
  return for_each_entry(fd, [&](const char* name, unsigned char) { return fn(name); });
}

Result<void> for_each_entry(int fd, const std::function<bool(const char*, unsigned char)>& fn) {
  int lfd = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);
  DIR* d = lfd < 0 ? nullptr : ::fdopendir(lfd);
  if (!d) {
    int e = errno;
    if (lfd >= 0) ::close(lfd);
    return std::error_code(e, std::generic_category());
  }
  while (auto* e = ::readdir(d))
    if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..") && !fn(e->d_name, e->d_type)) break;
  ::closedir(d);
  return {};
}

Result<std::vector<std::string>> names_in(int fd) {
  std::vector<std::string> names;
  if (auto r = for_each_name(fd,
                             [&](const char* n) {
                               names.emplace_back(n);
                               return true;
                             });
      !r)
    return r.error();
  return names;
}

namespace {

// A copy of a tree the agent wrote (a branch's layer) into a place only the supervisor writes.
// Every entry is reached from its parent's fd without following symlinks, and every entry of the
// copy is created new (mkdirat, O_CREAT | O_EXCL, symlinkat, linkat): nothing already there is
// written through, so a symlink in the source (or anywhere) is copied as a symlink and never
// followed.
//
// What it writes is what the source takes, not what its sizes say: a file's holes stay holes,
// and an inode with several names in the tree is copied once, its other names linked to that
// copy. Else a layer of 1 MiB linked 300 times and a 1 GiB file of holes (980 KB used in the
// branch's 256M workspace) wrote 1.37 GB to the state dir's disk, and `truncate -s 10T` would
// have filled it. And nothing past `limit` is written at all: the copy stops before the extent
// that would pass it.
struct Copier {
  std::string err;  // what failed
  std::string code = "failed";
  uint64_t bytes = 0;  // file data written (link_tree: the sizes of the files linked)
  bool link = false;   // link_tree: regular files are hard links to the source's, not copies
  CopyBound bound;
  uint64_t inodes = 0;  // new inodes made
  // The copy's root (every path below is relative to it), and where the copy of each inode with
  // more than one name went first, by the source's device and inode: its directory and name.
  int droot = -1;
  std::map<std::pair<dev_t, ino_t>, std::pair<std::string, std::string>> firsts;
  CopyRecord* record = nullptr;  // what was read, where the caller keeps it (copy_tree)

  void note(const std::string& drel, const char* dname, const struct stat& st, uint64_t written) {
    if (!record) return;
    record->add(join(drel, dname),
                {st.st_ino, ns_of(st.st_ctim), st.st_size, written, static_cast<mode_t>(st.st_mode & S_IFMT)});
    ++record->renewed;
  }

  static constexpr int kMaxDepth = 256;

  bool fail(const std::string& what, int e) {
    err = what + ": " + std::strerror(e);
    return false;
  }

  static std::string join(const std::string& dir, const char* name) { return dir.empty() ? name : dir + "/" + name; }

  // Owner and mode of the copy as the source has them: chown first (it clears set-id bits).
  bool keep_owner(int fd, const struct stat& st, const std::string& shown) {
    if (::fchown(fd, st.st_uid, st.st_gid) != 0) return fail("chown " + shown, errno);
    if (::fchmod(fd, st.st_mode & 07777) != 0) return fail("chmod " + shown, errno);
    return true;
  }

  // Whether a new inode (the copy of `shown`) leaves the bound's inodes free: read every
  // kInodeStep new inodes, from the copy's root.
  bool new_inode(const std::string& shown) {
    if (!bound.keep_inodes || inodes++ % CopyBound::kInodeStep != 0) return true;
    auto room = free_room(droot);
    if (!room || !room->inodes) return true;  // unknown, or no fixed number
    if (*room->inodes >= bound.keep_inodes + CopyBound::kInodeStep) return true;
    err = "copy " + shown + ": its next inodes would leave fewer than " + std::to_string(bound.keep_inodes) +
          " free where it is copied to (" + std::to_string(*room->inodes) + " free, " + std::to_string(inodes - 1) +
          " made by the copy), " + bound.inodes_what;
    code = "no_space";
    return false;
  }

  // Whether `len` more bytes leave the bound's keep_bytes free, read from the copy's root now.
  bool room_for(uint64_t len, const std::string& shown) {
    if (!bound.keep_bytes) return true;
    auto room = free_room(droot);
    if (!room) return true;  // unknown: the write says
    uint64_t free = room->bytes;
    if (free >= *bound.keep_bytes && free - *bound.keep_bytes >= len) return true;
    err = "copy " + shown + ": its next " + std::to_string(len) + " bytes of data would leave less than " +
          std::to_string(*bound.keep_bytes) + " bytes free where it is copied to (" + std::to_string(free) + " free, " +
          std::to_string(bytes) + " written by the copy), " + bound.keep_what;
    code = "no_space";
    return false;
  }

  // Whether the copy was called off (CopyBound::cancel), saying so.
  bool cancelled(const std::string& shown) {
    if (!bound.cancel || !bound.cancel->load(std::memory_order_relaxed)) return false;
    err = "copy " + shown + ": called off";
    code = "cancelled";
    return true;
  }

  // `len` bytes at `at` of `in`, to the same offset of `out`, within the bound.
  bool extent(int in, int out, off_t at, off_t len, const std::string& shown) {
    if (cancelled(shown)) return false;
    if (static_cast<uint64_t>(len) > bound.bytes - bytes) {
      err = "copy " + shown + ": its next " + std::to_string(len) + " bytes of data would take the copy past " +
            std::to_string(bound.bytes) + " bytes (" + std::to_string(bytes) + " written), " + bound.what;
      code = bound.code;
      return false;
    }
    if (!room_for(static_cast<uint64_t>(len), shown)) return false;
    // Fewer bytes where the file shrank under us: what is there is kept.
    auto n = os::copy_range(in, out, static_cast<uint64_t>(at), static_cast<uint64_t>(len));
    if (!n) return fail("copy " + shown, n.error().value());
    bytes += *n;
    return true;
  }

  // The data of `in` (`size` bytes, as fstat said) into the new file `out`: each data extent at
  // its offset, then the size, so the holes between them stay holes.
  bool data(int in, int out, off_t size, const std::string& shown) {
    for (off_t pos = 0; pos < size;) {
      off_t start = ::lseek(in, pos, SEEK_DATA), end = size;
      if (start < 0 && errno == ENXIO) break;  // a hole to the end
      if (start < 0 && errno != EINVAL && errno != EOPNOTSUPP) return fail("seek in " + shown, errno);
      if (start < 0) {
        start = pos;  // no SEEK_DATA on this filesystem: all of it is data
      } else if ((end = ::lseek(in, start, SEEK_HOLE)) < 0) {
        if (errno == ENXIO) break;  // it shrank below `start` under us (truncated as it runs)
        return fail("seek in " + shown, errno);
      }
      if (start >= size) break;
      end = std::min(end, size);
      if (!extent(in, out, start, end - start, shown)) return false;
      pos = end;
    }
    if (::ftruncate(out, size) != 0) return fail("size the copy of " + shown, errno);
    return true;
  }

  // A further name of an inode copied already: a hard link to its copy, found beneath the
  // copy's root with no symlink followed. False with no error where it cannot be had (the
  // filesystem's most links): then it is copied again.
  bool linked(const std::pair<std::string, std::string>& first, int ddir, const char* dname, const std::string& shown,
              bool& done) {
    auto at = os::open_beneath(droot, first.first.empty() ? "." : first.first, O_PATH | O_DIRECTORY);
    if (!at) return fail("open the copy of " + shown + "'s first name", at.error().value());
    done = ::linkat(at->get(), first.second.c_str(), ddir, dname, 0) == 0;
    if (!done && errno != EMLINK) return fail("link the copy of " + shown, errno);
    return true;
  }

  bool file(int sdir, const char* name, int ddir, const char* dname, const std::string& drel,
            const std::string& shown) {
    // O_PATH first, then the very inode it holds: a FIFO or a device is never opened.
    auto p = os::open_beneath(sdir, name, O_PATH | O_NOFOLLOW);
    if (!p) return fail("open " + shown, p.error().value());
    struct stat st {};
    if (::fstat(p->get(), &st) != 0) return fail("stat " + shown, errno);
    if (!S_ISREG(st.st_mode)) return true;  // swapped for another type meanwhile: not copied
    if (link) {
      // By name (AT_EMPTY_PATH would need CAP_DAC_READ_SEARCH, which a container may lack);
      // linkat never follows a symlink, and link_tree's trees are the supervisor's own.
      if (::linkat(sdir, name, ddir, dname, 0) != 0) return fail("link " + shown, errno);
      bytes += static_cast<uint64_t>(st.st_size);
      return true;
    }
    auto key = std::make_pair(st.st_dev, st.st_ino);
    if (st.st_nlink > 1)
      if (auto it = firsts.find(key); it != firsts.end()) {
        bool done = false;
        if (!linked(it->second, ddir, dname, shown, done)) return false;
        if (done) {
          note(drel, dname, st, 0);
          return true;
        }
      }
    // O_NONBLOCK: a lease on the file (fcntl F_SETLEASE) held by an agent stopped for its
    // checkpoint, which cannot give it up, made the open wait lease-break-time, 45 s a file, the
    // tree stopped meanwhile. Refused at once (EWOULDBLOCK), naming the file.
    auto in = os::reopen(p->get(), O_RDONLY | O_NONBLOCK);
    if (!in && in.error().value() == EWOULDBLOCK)
      return fail("open " + shown + " (its agent holds a lease on it)", EWOULDBLOCK);
    if (!in) return fail("open " + shown, in.error().value());
    if (!new_inode(shown)) return false;
    os::UniqueFd out(::openat(ddir, dname, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) return fail("create the copy of " + shown, errno);
    uint64_t before = bytes;
    if (!data(in->get(), out.get(), st.st_size, shown) || !keep_owner(out.get(), st, shown)) return false;
    if (st.st_nlink > 1) firsts[key] = {drel, dname};
    note(drel, dname, st, bytes - before);
    return true;
  }

  bool symlink(int sdir, const char* name, const struct stat& st, int ddir, const char* dname, const std::string& drel,
               const std::string& shown) {
    std::vector<char> target(static_cast<size_t>(std::max<off_t>(st.st_size, 0)) + 2);
    ssize_t n = ::readlinkat(sdir, name, target.data(), target.size() - 1);
    if (n < 0) return fail("read the symlink " + shown, errno);
    target[static_cast<size_t>(n)] = 0;
    if (!new_inode(shown)) return false;
    if (::symlinkat(target.data(), ddir, dname) != 0) return fail("create the copy of " + shown, errno);
    if (::fchownat(ddir, dname, st.st_uid, st.st_gid, AT_SYMLINK_NOFOLLOW) != 0) return fail("chown " + shown, errno);
    note(drel, dname, st, 0);
    return true;
  }

  // The names in the directory `fd` (but . and ..).
  bool list(int fd, const std::string& shown, std::vector<std::string>& names) {
    auto r = names_in(fd);
    if (!r) return fail("list " + shown, r.error().value());
    names = std::move(*r);
    return true;
  }

  // Copies the directory `sfd` into `dfd` (new and empty, at `drel` below the copy's root), entry
  // by entry.
  bool dir(int sfd, int dfd, const std::string& drel, const std::string& shown, int depth) {
    if (depth > kMaxDepth) {
      err = "copy " + shown + ": the tree is deeper than " + std::to_string(kMaxDepth) + " directories";
      return false;
    }
    std::vector<std::string> names;
    if (!list(sfd, shown, names)) return false;
    for (auto& n : names)
      if (!entry(sfd, n.c_str(), dfd, n.c_str(), drel, shown + "/" + n, depth)) return false;
    return true;
  }

  // Copies the entry `name` of `sdir` as the new entry `dname` of `ddir`, which is at `drel`
  // below the copy's root.
  bool entry(int sdir, const char* name, int ddir, const char* dname, const std::string& drel, const std::string& shown,
             int depth) {
    if (cancelled(shown)) return false;
    struct stat st {};
    if (::fstatat(sdir, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return true;  // gone meanwhile
      return fail("stat " + shown, errno);
    }
    if (S_ISLNK(st.st_mode)) return symlink(sdir, name, st, ddir, dname, drel, shown);
    if (S_ISREG(st.st_mode)) return file(sdir, name, ddir, dname, drel, shown);
    if (!S_ISDIR(st.st_mode)) return true;  // sockets, FIFOs, devices, overlay whiteouts: not part of a copy
    auto sub = os::open_beneath(sdir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!sub) return fail("open " + shown, sub.error().value());
    if (::fstat(sub->get(), &st) != 0) return fail("stat " + shown, errno);
    if (!new_inode(shown)) return false;
    if (::mkdirat(ddir, dname, 0700) != 0) return fail("create the copy of " + shown, errno);
    auto out = os::open_beneath(ddir, dname, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!out) return fail("open the copy of " + shown, out.error().value());
    return dir(sub->get(), out->get(), join(drel, dname), shown, depth + 1) && keep_owner(out->get(), st, shown);
  }
};

// Brings a copy (a Copier's, recorded) to what its source holds now, keeping what did not change
// (sync_tree): the walk of a copy_tree, with each entry first checked against the record and the
// copy's own entry of that name.
struct Syncer {
  Copier& c;
  const CopyRecord& record;
  const SyncPolicy& policy;

  // Whether the data of the entry `name` of `sdir` and its copy in `ddir` read the same.
  static bool same_data(int sdir, int ddir, const char* name) {
    auto p = os::open_beneath(sdir, name, O_PATH | O_NOFOLLOW);
    if (!p) return false;
    auto in = os::reopen(p->get(), O_RDONLY | O_NONBLOCK);
    os::UniqueFd out(::openat(ddir, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!in || !out) return false;
    std::vector<char> a(256 << 10), b(256 << 10);
    for (;;) {
      ssize_t n = ::read(in->get(), a.data(), a.size());
      if (n < 0) return false;
      size_t got = 0;
      while (got < static_cast<size_t>(n)) {
        ssize_t m = ::read(out.get(), b.data() + got, static_cast<size_t>(n) - got);
        if (m <= 0) return false;
        got += static_cast<size_t>(m);
      }
      if (n == 0) return ::read(out.get(), b.data(), 1) == 0;
      if (std::memcmp(a.data(), b.data(), got) != 0) return false;
    }
  }

  // The record's entry for `rel` where the source entry `st` there is what its copy was made
  // from, and may be kept; else none.
  const CopyRecord::Entry* unchanged(const struct stat& st, const std::string& rel) {
    auto* e = record.find(rel);
    int64_t still = still_window_ns(st, policy.still_ns, policy.fine_still_ns);
    if (!e || e->ino != st.st_ino || e->type != (st.st_mode & S_IFMT) || e->size != st.st_size ||
        e->ctime_ns != ns_of(st.st_ctim) || e->ctime_ns > record.started_ns - still ||
        policy.always.contains({st.st_dev, st.st_ino}))
      return nullptr;
    return e;
  }

  // A kept file with further names: the copy's names of its inode are one inode, the first placed.
  bool keep_links(const struct stat& st, int sdir, int ddir, const char* dname, const std::string& drel,
                  const std::string& shown, int depth) {
    auto key = std::make_pair(st.st_dev, st.st_ino);
    auto it = c.firsts.find(key);
    if (it == c.firsts.end()) {
      c.firsts[key] = {drel, dname};
      return true;
    }
    auto at = os::open_beneath(c.droot, it->second.first.empty() ? "." : it->second.first, O_PATH | O_DIRECTORY);
    struct stat first {
    }, mine{};
    if (!at || ::fstatat(at->get(), it->second.second.c_str(), &first, AT_SYMLINK_NOFOLLOW) != 0 ||
        ::fstatat(ddir, dname, &mine, AT_SYMLINK_NOFOLLOW) != 0)
      return c.fail("stat the copy of " + shown, errno);
    if (first.st_ino == mine.st_ino) return true;
    // Its copy is another inode (the first name placed was copied anew): linked to that one.
    if (::unlinkat(ddir, dname, 0) != 0) return c.fail("remove the copy of " + shown, errno);
    return c.entry(sdir, dname, ddir, dname, drel, shown, depth);
  }

  bool remove(int ddir, const std::string& dname, const std::string& shown) {
    auto r = remove_tree_at(ddir, dname, "the copy of " + shown);
    if (!r) c.err = r.error().message;
    return r.has_value();
  }

  bool dir(int sfd, int dfd, const std::string& drel, const std::string& shown, int depth) {
    if (depth > Copier::kMaxDepth) {
      c.err = "copy " + shown + ": the tree is deeper than " + std::to_string(Copier::kMaxDepth) + " directories";
      return false;
    }
    std::vector<std::string> names;
    if (!c.list(sfd, shown, names)) return false;
    // The copy's entries with their types (the copy is the supervisor's: no stat of each needed).
    std::unordered_map<std::string, unsigned char> there;
    if (auto r = for_each_entry(dfd,
                                [&](const char* n, unsigned char type) {
                                  there.emplace(n, type);
                                  return true;
                                });
        !r)
      return c.fail("list the copy of " + shown, r.error().value());
    std::unordered_set<std::string> in_src(names.begin(), names.end());
    for (auto& [n, type] : there)
      if (!in_src.contains(n) && !remove(dfd, n, shown + "/" + n)) return false;
    for (auto& n : names) {
      auto it = there.find(n);
      if (!entry(sfd, n.c_str(), dfd, it == there.end() ? -1 : it->second, drel, shown + "/" + n, depth)) return false;
    }
    return true;
  }

  // The type (S_IFMT) of the copy's entry `n` of `dfd`, whose readdir type is `dtype` (-1: there
  // is none); 0 where there is none.
  static mode_t copy_type(int dfd, const char* n, int dtype) {
    if (dtype < 0) return 0;
    if (dtype != DT_UNKNOWN) return DTTOIF(dtype);
    struct stat dt {};
    return ::fstatat(dfd, n, &dt, AT_SYMLINK_NOFOLLOW) == 0 ? dt.st_mode & S_IFMT : 0;
  }

  bool entry(int sfd, const char* n, int dfd, int dtype, const std::string& drel, const std::string& shown, int depth) {
    if (c.cancelled(shown)) return false;
    struct stat st {};
    mode_t dmode = copy_type(dfd, n, dtype);
    bool has = dmode != 0;
    if (::fstatat(sfd, n, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno != ENOENT) return c.fail("stat " + shown, errno);
      return !has || remove(dfd, n, shown);  // gone meanwhile
    }
    bool same_type = has && dmode == (st.st_mode & S_IFMT);
    std::string rel = Copier::join(drel, n);
    if (S_ISDIR(st.st_mode) && same_type) {
      auto sub = os::open_beneath(sfd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
      if (!sub) return c.fail("open " + shown, sub.error().value());
      if (::fstat(sub->get(), &st) != 0) return c.fail("stat " + shown, errno);
      auto out = os::open_beneath(dfd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
      if (!out) return c.fail("open the copy of " + shown, out.error().value());
      return dir(sub->get(), out->get(), rel, shown, depth + 1) && c.keep_owner(out->get(), st, shown);
    }
    const CopyRecord::Entry* kept =
        (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)) && same_type ? unchanged(st, rel) : nullptr;
    if (kept && !(S_ISREG(st.st_mode) && policy.compare_data && !same_data(sfd, dfd, n))) {
      c.bytes += kept->bytes;
      if (c.record) c.record->add(rel, *kept);  // the next record (sync_tree's `next`)
      return !S_ISREG(st.st_mode) || st.st_nlink <= 1 || keep_links(st, sfd, dfd, n, drel, shown, depth);
    }
    if (has && !remove(dfd, n, shown)) return false;
    return c.entry(sfd, n, dfd, n, drel, shown, depth);
  }
};

}  // namespace

namespace {

base::Result<uint64_t> tree(const std::string& src, const std::string& dst, bool link, const CopyBound& bound,
                            CopyRecord* record = nullptr) {
  auto split = [](const std::string& p) {
    auto slash = p.rfind('/');
    if (slash == std::string::npos) return std::pair<std::string, std::string>(".", p);
    return std::pair<std::string, std::string>(slash == 0 ? "/" : p.substr(0, slash), p.substr(slash + 1));
  };
  auto [sparent, sname] = split(src);
  auto [dparent, dname] = split(dst);
  if (sname.empty() || sname == "." || sname == ".." || dname.empty() || dname == "." || dname == "..")
    return base::fail("copy " + src + " to " + dst + ": each must name an entry");
  // The parents are the caller's (the state dir); what is below them is reached by fd only.
  os::UniqueFd sdir(::open(sparent.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  os::UniqueFd ddir(::open(dparent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!sdir || !ddir) return base::fail("open " + (sdir ? dparent : sparent) + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstatat(sdir.get(), sname.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0)
    return base::fail("stat " + src + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode))
    return base::fail("copy " + src + ": it is " + os::file_type_name(st.st_mode) +
                      ", not a directory or a regular file");
  // A copy goes into a new place only: never merged into, or written through, what is there.
  if (::fstatat(ddir.get(), dname.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    return base::fail("copy " + src + " to " + dst + ": the destination exists already (it is " +
                      os::file_type_name(st.st_mode) + ")");
  }
  Copier c;
  c.link = link;
  c.bound = bound;
  c.droot = ddir.get();
  if (record) {
    record->entries.clear();
    record->full = false;
    record->started_ns = realtime_ns();
    c.record = record;
  }
  if (!c.entry(sdir.get(), sname.c_str(), ddir.get(), dname.c_str(), "", src, 0)) return base::fail(c.err, c.code);
  return c.bytes;
}

}  // namespace

base::Result<uint64_t> copy_tree(const std::string& src, const std::string& dst, const CopyBound& bound,
                                 CopyRecord* record) {
  return tree(src, dst, false, bound, record);
}

base::Result<uint64_t> sync_tree(const std::string& src, const std::string& dst, const CopyRecord& record,
                                 const SyncPolicy& policy, const CopyBound& bound, CopyRecord* next) {
  // Both are the caller's (the branch's layer dir, the snapshot's work dir); what is below them is
  // reached by fd only.
  os::UniqueFd sdir(::open(src.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  os::UniqueFd ddir(::open(dst.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!sdir || !ddir) return base::fail("open " + (sdir ? dst : src) + ": " + std::strerror(errno));
  os::UniqueFd dparent(::openat(ddir.get(), "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  struct stat st {};
  if (!dparent || ::fstat(sdir.get(), &st) != 0) return base::fail("stat " + src + ": " + std::strerror(errno));
  Copier c;
  c.bound = bound;
  c.droot = dparent.get();  // the record's paths start with the copy's own name
  if (next) {
    size_t max = next->max_entries;
    *next = CopyRecord{};
    next->max_entries = max;
    next->started_ns = realtime_ns();
    c.record = next;
  }
  Syncer s{c, record, policy};
  auto slash = dst.rfind('/');
  std::string root = slash == std::string::npos ? dst : dst.substr(slash + 1);
  if (!s.dir(sdir.get(), ddir.get(), root, src, 1) || !c.keep_owner(ddir.get(), st, src))
    return base::fail(c.err, c.code);
  if (c.bytes > bound.bytes)
    return base::fail("copy " + src + ": its data (" + std::to_string(c.bytes) + " bytes) takes the copy past " +
                          std::to_string(bound.bytes) + " bytes, " + bound.what,
                      bound.code);
  return c.bytes;
}

base::Result<uint64_t> link_tree(const std::string& src, const std::string& dst) { return tree(src, dst, true, {}); }

base::Result<uint64_t> copy_tree_into(const std::string& src, const std::string& dst, const CopyBound& bound) {
  // Both are the caller's (the snapshot's store, the branch's dir); what is below them is reached
  // by fd only.
  os::UniqueFd sdir(::open(src.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  os::UniqueFd ddir(::open(dst.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!sdir || !ddir) return base::fail("open " + (sdir ? dst : src) + ": " + std::strerror(errno));
  Copier c;
  c.bound = bound;
  c.droot = ddir.get();
  // The destination is new: empty, but for the lost+found of a filesystem just made on it.
  std::vector<std::string> there;
  if (!c.list(ddir.get(), dst, there)) return base::fail(c.err);
  bool has_lost_found = false;
  for (auto& n : there) {
    if (n == "lost+found") {
      has_lost_found = true;
      continue;
    }
    return base::fail("copy " + src + " into " + dst + ": the destination is not empty (it holds " + n + ")");
  }
  struct stat st {};
  if (::fstat(sdir.get(), &st) != 0) return base::fail("stat " + src + ": " + std::strerror(errno));
  std::vector<std::string> names;
  if (!c.list(sdir.get(), src, names)) return base::fail(c.err);
  for (auto& n : names) {
    if (has_lost_found && n == "lost+found") continue;  // the destination's own
    if (!c.entry(sdir.get(), n.c_str(), ddir.get(), n.c_str(), "", src + "/" + n, 1)) return base::fail(c.err, c.code);
  }
  if (!c.keep_owner(ddir.get(), st, src)) return base::fail(c.err);
  return c.bytes;
}

namespace {

// A mount's root (statx's attribute, Linux 5.8), or a directory on another filesystem than `dev`.
bool is_mount(int fd, dev_t dev) {
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_BASIC_STATS, &sx) != 0) return false;
  if ((sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) && (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT)) return true;
  return makedev(sx.stx_dev_major, sx.stx_dev_minor) != dev;
}

base::Result<void> remove_entry(int dirfd, const std::string& name, dev_t dev, const std::string& shown, int depth) {
  if (::unlinkat(dirfd, name.c_str(), 0) == 0 || errno == ENOENT) return {};
  if (errno != EISDIR) return base::sys_fail("remove " + shown, errno);
  if (depth > 256) return base::fail("remove " + shown + ": the tree is deeper than 256 directories");
  os::UniqueFd sub(::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!sub) return errno == ENOENT ? base::Result<void>() : base::sys_fail("open " + shown, errno);
  if (is_mount(sub.get(), dev)) return base::fail("remove " + shown + ": a filesystem is mounted there; not entered");
  auto names = names_in(sub.get());
  if (!names) return base::sys_fail("list " + shown, names.error());
  for (auto& n : *names)
    if (auto r = remove_entry(sub.get(), n, dev, shown + "/" + n, depth + 1); !r) return r;
  if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT)
    return base::sys_fail("remove " + shown, errno);
  return {};
}

}  // namespace

base::Result<void> remove_tree_at(int dirfd, const std::string& name, const std::string& shown) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
    return base::fail("remove " + shown + ": not an entry's name");
  struct stat st {};
  if (::fstat(dirfd, &st) != 0) return base::sys_fail("stat the directory of " + shown, errno);
  return remove_entry(dirfd, name, st.st_dev, shown, 0);
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
}

uint64_t tree_bytes(const std::string& path) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(path, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file(ec) && !it->is_symlink(ec)) total += it->file_size(ec);
  }
  return total;
}

}  // namespace sbx::os
