#include "os/sys.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <signal.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>
#include <cstdlib>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

namespace sbx::os {

boost::system::error_code sys_error(int e) noexcept { return {e, boost::system::system_category()}; }

boost::system::error_code last_error() noexcept { return sys_error(errno); }

Result<Pipe> make_pipe(int flags) noexcept {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | flags) != 0) return last_error();
  return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

Result<void> write_all(int fd, std::string_view data) noexcept {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return last_error();
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return {};
}

Result<void> write_line(int fd, std::string_view line) noexcept {
  static const char nl = '\n';
  while (!line.empty()) {
    struct iovec v[2] = {{const_cast<char*>(line.data()), line.size()}, {const_cast<char*>(&nl), 1}};
    ssize_t n = ::writev(fd, v, 2);
    if (n < 0) {
      if (errno == EINTR) continue;
      return last_error();
    }
    if (static_cast<size_t>(n) > line.size()) return {};  // the newline went too
    line.remove_prefix(static_cast<size_t>(n));
  }
  return write_all(fd, "\n");
}

Result<std::string> read_all(int fd) {
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return last_error();
    }
    if (n == 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

namespace {
FreeRoom room_of(const struct statvfs& v) noexcept {
  FreeRoom r{.bytes = static_cast<uint64_t>(v.f_bavail) * v.f_frsize};
  if (v.f_files != 0) r.inodes = static_cast<uint64_t>(v.f_favail);
  return r;
}
}  // namespace

Result<FreeRoom> free_room(int fd) noexcept {
  struct statvfs v {};
  if (::fstatvfs(fd, &v) != 0) return last_error();
  return room_of(v);
}

Result<FreeRoom> free_room(const std::string& path) noexcept {
  struct statvfs v {};
  if (::statvfs(path.c_str(), &v) != 0) return last_error();
  return room_of(v);
}

int64_t realtime_ns() {
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return ns_of(now);
}

void for_each_line(std::string_view text, const std::function<void(std::string_view)>& fn) {
  while (!text.empty()) {
    size_t eol = text.find('\n');
    fn(text.substr(0, eol));
    text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
  }
}

std::vector<std::string_view> fields_of(std::string_view line, size_t most) {
  std::vector<std::string_view> out;
  for (size_t at = 0; out.size() < most;) {
    while (at < line.size() && line[at] == ' ') ++at;
    if (at >= line.size()) break;
    size_t sp = std::min(line.find(' ', at), line.size());
    out.push_back(line.substr(at, sp - at));
    at = sp;
  }
  return out;
}

Result<std::string> read_file(const std::string& path) {
  // Opened without waiting: a FIFO's open waits for a writer, forever where none comes (and a
  // supervisor that has not yet started its loop answers no signal meanwhile). Read as usual
  // after it: a pipe with a writer (`--token-file <(cmd)`) is read to its end.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) return last_error();
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return last_error();
  // (O_NONBLOCK means nothing to a regular file's reads: only others get it cleared.)
  if (!S_ISREG(st.st_mode))
    if (auto r = set_nonblocking(fd.get(), false); !r) return r.error();
  auto text = read_all(fd.get());
  // A FIFO no process writes reads as empty: say so, rather than give "".
  if (text && text->empty() && S_ISFIFO(st.st_mode)) return sys_error(ENODATA);
  return text;
}

bool only_ours_to_write(const struct stat& st) noexcept {
  return S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

Result<std::string> read_own_file_at(int dirfd, const std::string& name, size_t max_bytes) {
  auto fd = open_beneath(dirfd, name, O_RDONLY | O_NONBLOCK);
  if (!fd) return fd.error();
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0) return last_error();
  if (!only_ours_to_write(st)) return sys_error(EPERM);
  if (static_cast<uint64_t>(st.st_size) > max_bytes) return sys_error(EFBIG);
  auto text = read_all(fd->get());
  if (text && text->size() > max_bytes) return sys_error(EFBIG);  // grown since the fstat
  return text;
}

Result<void> write_file_atomic(const std::string& path, std::string_view data, mode_t mode, struct stat* written) {
  auto slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  // The directory by its path, as the caller trusts it (a symlinked state dir is fine).
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return last_error();
  return write_file_atomic_at(fd.get(), path.substr(slash == std::string::npos ? 0 : slash + 1), data, mode, written);
}

std::optional<std::pair<std::string, struct stat>> real_path(const std::string& path) {
  // A path that is not there (most of a branch's ~40 credential masks) is told by one stat;
  // realpath walks it a readlink a component.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  char* real = ::realpath(path.c_str(), nullptr);
  if (!real) return std::nullopt;
  std::pair<std::string, struct stat> out{real, st};
  ::free(real);
  return out;
}

Result<void> make_dirs(const std::string& path, mode_t mode) {
  if (path.empty()) return {};
  // The leaf first: as a rule it or its parent is there already (a start made ~20 mkdirs that
  // failed with EEXIST, walking from the root). The parents are made only where it is missing.
  int err = ::mkdir(path.c_str(), mode) == 0 ? 0 : errno;
  if (err == ENOENT) {
    size_t end = path.find_last_not_of('/');
    size_t slash = end == std::string::npos ? std::string::npos : path.rfind('/', end);
    if (slash != std::string::npos && slash > 0) {
      if (auto r = make_dirs(path.substr(0, slash), mode); !r) return r;
      err = ::mkdir(path.c_str(), mode) == 0 ? 0 : errno;
    }
  }
  if (err == 0) return {};
  if (err != EEXIST) return sys_error(err);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return last_error();
  if (!S_ISDIR(st.st_mode)) return sys_error(ENOTDIR);
  return {};
}

namespace {
// One component of a relative path: no "", ".", ".." and no '/'.
bool plain_name(std::string_view n) { return !n.empty() && n != "." && n != ".." && n.find('/') == n.npos; }
}  // namespace

static_assert(kResolveNoLinks == (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS));

Result<UniqueFd> open_beneath(int dirfd, const std::string& rel, int flags, mode_t mode, uint64_t resolve) noexcept {
  struct open_how how {};
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
  how.mode = (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? mode : 0;
  how.resolve = resolve;
  int fd;
  do fd = static_cast<int>(::syscall(SYS_openat2, dirfd, rel.c_str(), &how, sizeof how));
  while (fd < 0 && errno == EAGAIN);
  if (fd < 0) return last_error();
  return UniqueFd(fd);
}

Result<UniqueFd> open_dir(const std::string& path) noexcept {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return last_error();
  return fd;
}

Result<UniqueFd> make_dirs_at(int dirfd, const std::string& rel, mode_t mode) {
  UniqueFd cur(::fcntl(dirfd, F_DUPFD_CLOEXEC, 3));
  if (!cur) return last_error();
  size_t pos = 0;
  while (pos < rel.size()) {
    size_t end = rel.find('/', pos);
    if (end == std::string::npos) end = rel.size();
    std::string name = rel.substr(pos, end - pos);
    pos = end + 1;
    if (name.empty() || name == ".") continue;
    if (name == "..") return sys_error(EXDEV);
    bool made = ::mkdirat(cur.get(), name.c_str(), mode) == 0;
    if (!made && errno != EEXIST) return last_error();
    // A symlink is ELOOP, a file ENOTDIR: neither is used.
    auto next = open_beneath(cur.get(), name, O_RDONLY | O_DIRECTORY);
    if (!next) return next.error();
    if (made && ::fchmod(next->get(), mode) != 0) return last_error();
    cur = std::move(*next);
  }
  return cur;
}

namespace {

// The temporary, filled by `fill`, then renamed over `name`: write_file_atomic_at's and
// copy_file_atomic_at's common part.
template <class Fill>
Result<void> replace_atomic_at(int dirfd, const std::string& name, mode_t mode, struct stat* written, Fill fill) {
  if (!plain_name(name)) return sys_error(EINVAL);
  // Built by appending: GCC 12 at -O3 reports a false -Wrestrict on "." + std::string&&.
  std::string tmp = ".";
  tmp.append(name, 0, 64).append(".tmp-").append(random_hex(8));
  UniqueFd fd(::openat(dirfd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) return last_error();
  auto fail = [&](boost::system::error_code ec) {
    ::unlinkat(dirfd, tmp.c_str(), 0);
    return ec;
  };
  if (::fchmod(fd.get(), mode) != 0) return fail(last_error());
  if (Result<void> r = fill(fd.get()); !r) return fail(r.error());
  if (written && ::fstat(fd.get(), written) != 0) return fail(last_error());
  fd.reset();
  if (::renameat(dirfd, tmp.c_str(), dirfd, name.c_str()) != 0) return fail(last_error());
  return {};
}

}  // namespace

Result<void> write_file_atomic_at(int dirfd, const std::string& name, std::string_view data, mode_t mode,
                                  struct stat* written) {
  return replace_atomic_at(dirfd, name, mode, written, [&](int fd) { return write_all(fd, data); });
}

Result<void> copy_file_atomic_at(int dirfd, const std::string& name, int src, uint64_t size, mode_t mode) {
  return replace_atomic_at(dirfd, name, mode, nullptr, [&](int fd) -> Result<void> {
    auto n = copy_range(src, fd, 0, size);
    if (!n) return n.error();
    if (*n < size) return sys_error(ENODATA);  // `src` is shorter than `size`: it changed under us
    return {};
  });
}

Result<uint64_t> copy_range(int in, int out, uint64_t at, uint64_t len) {
  auto in_off = static_cast<off_t>(at), out_off = static_cast<off_t>(at);
  uint64_t done = 0;
  bool plain = false;  // copy_file_range refused this pair of filesystems: read and write then
  std::vector<char> buf;
  while (done < len) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(len - done, 1u << 30));
    ssize_t n = -1;
    if (!plain) {
      n = ::copy_file_range(in, &in_off, out, &out_off, want, 0);
      if (n < 0 && (errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP || errno == ENOSYS)) {
        plain = true;
        continue;
      }
    } else {
      if (buf.empty()) buf.resize(1 << 20);
      n = ::pread(in, buf.data(), std::min(buf.size(), want), in_off);
      for (ssize_t put = 0; n > 0 && put < n;) {
        ssize_t w = ::pwrite(out, buf.data() + put, static_cast<size_t>(n - put), out_off + put);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return last_error();
        put += w;
      }
      if (n > 0) in_off += n, out_off += n;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return last_error();
    if (n == 0) break;  // `in` ends here
    done += static_cast<uint64_t>(n);
  }
  return done;
}

FdPath::FdPath(int fd) noexcept { std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd); }

Result<UniqueFd> reopen(int fd, int flags) noexcept {
  UniqueFd out(::open(FdPath(fd).c_str(), flags | O_CLOEXEC));
  if (!out) return last_error();
  return out;
}

const char* file_type_name(mode_t mode) noexcept {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFLNK:
      return "a symlink";
    case S_IFIFO:
      return "a FIFO";
    case S_IFSOCK:
      return "a socket";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    default:
      return "a file of unknown type";
  }
}

Result<void> set_nonblocking(int fd, bool on) noexcept {
  int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0) return last_error();
  fl = on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK);
  if (::fcntl(fd, F_SETFL, fl) != 0) return last_error();
  return {};
}

Result<uint64_t> tcp_bytes_acked(int fd) noexcept {
  struct tcp_info ti {};
  socklen_t len = sizeof ti;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return last_error();
  // A kernel older than 4.1 fills a shorter struct, without the count.
  if (len < offsetof(struct tcp_info, tcpi_bytes_acked) + sizeof ti.tcpi_bytes_acked) return sys_error(ENOPROTOOPT);
  return ti.tcpi_bytes_acked;
}

std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  std::string dir = "/proc/" + std::to_string(pid) + "/task";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (auto* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(dir + "/" + e->d_name + "/children");
    pid_t c;
    while (f >> c) out.push_back(c);
  }
  ::closedir(d);
  return out;
}

std::vector<pid_t> descendants_of(pid_t pid, size_t limit) {
  std::vector<pid_t> all, stack = children_of(pid);
  while (!stack.empty() && all.size() < limit) {
    pid_t p = stack.back();
    stack.pop_back();
    all.push_back(p);
    for (pid_t c : children_of(p)) stack.push_back(c);
  }
  return all;
}

std::string exe_path() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

std::string exe_dir() {
  std::string p = exe_path();
  return p.empty() ? "." : p.substr(0, p.rfind('/'));
}

std::vector<std::string> shipped_dirs(const std::string& sub) {
  std::vector<std::string> dirs;
  if (std::string bin = exe_dir(); bin != ".") {
    dirs.push_back(bin + "/../share/sandboxer/" + sub);
    dirs.push_back(bin + "/../" + sub);
    dirs.push_back(bin + "/../../" + sub);
  }
  dirs.push_back("/etc/sandboxer/" + sub);
  dirs.push_back("/usr/share/sandboxer/" + sub);
  return dirs;
}

namespace {
// mountinfo writes a space, tab, newline and backslash in a path as \ooo (octal).
std::string unescape_mountinfo(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    auto octal = [&](size_t k, char hi) { return s[k] >= '0' && s[k] <= hi; };
    if (s[i] == '\\' && i + 3 < s.size() && octal(i + 1, '3') && octal(i + 2, '7') && octal(i + 3, '7')) {
      out += static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}
}  // namespace

std::vector<MountPoint> mounts_under(const std::string& dir, pid_t pid) {
  std::vector<MountPoint> out;
  auto text = read_file(pid > 0 ? "/proc/" + std::to_string(pid) + "/mountinfo" : std::string("/proc/self/mountinfo"));
  if (!text) return out;
  for_each_line(*text, [&](std::string_view line) {
    // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS
    auto f = fields_of(line);
    auto dash = std::find(f.begin(), f.end(), std::string_view("-"));
    if (f.size() < 5 || dash == f.end() || dash + 1 == f.end()) return;
    std::string path = unescape_mountinfo(f[4]);
    bool below = dir == "/" || (path.starts_with(dir) && path.size() > dir.size() && path[dir.size()] == '/');
    if (path != dir && !below) return;
    out.push_back({std::move(path), std::string(*(dash + 1))});
  });
  std::reverse(out.begin(), out.end());
  return out;
}

base::Result<void> release_mounts_under(const std::string& dir,
                                        const std::function<void(const MountPoint&)>& released) {
  for (auto& m : mounts_under(dir)) {
    if (::umount2(m.path.c_str(), UMOUNT_NOFOLLOW) != 0) {
      int err = errno;
      if (err == EINVAL) continue;  // no longer a mount point
      if (m.fstype != "tmpfs" || ::umount2(m.path.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0)
        return base::sys_fail("unmount " + m.path + " (" + m.fstype + ")", err, "busy");
    }
    released(m);
  }
  return {};
}

std::string random_hex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += hex[c >> 4];
    out += hex[c & 15];
  }
  return out;
}

namespace {
struct SigName {
  int sig;
  const char* name;
};
constexpr SigName kSignals[] = {
    {SIGHUP, "HUP"},       {SIGINT, "INT"},     {SIGQUIT, "QUIT"}, {SIGILL, "ILL"},   {SIGTRAP, "TRAP"},
    {SIGABRT, "ABRT"},     {SIGBUS, "BUS"},     {SIGFPE, "FPE"},   {SIGKILL, "KILL"}, {SIGUSR1, "USR1"},
    {SIGSEGV, "SEGV"},     {SIGUSR2, "USR2"},   {SIGPIPE, "PIPE"}, {SIGALRM, "ALRM"}, {SIGTERM, "TERM"},
    {SIGCHLD, "CHLD"},     {SIGCONT, "CONT"},   {SIGSTOP, "STOP"}, {SIGTSTP, "TSTP"}, {SIGTTIN, "TTIN"},
    {SIGTTOU, "TTOU"},     {SIGURG, "URG"},     {SIGXCPU, "XCPU"}, {SIGXFSZ, "XFSZ"}, {SIGVTALRM, "VTALRM"},
    {SIGPROF, "PROF"},     {SIGWINCH, "WINCH"}, {SIGIO, "IO"},     {SIGPWR, "PWR"},   {SIGSYS, "SYS"},
    {SIGSTKFLT, "STKFLT"},
};
}  // namespace

std::string signal_name(int sig) {
  for (auto& s : kSignals)
    if (s.sig == sig) return s.name;
  return std::to_string(sig);
}

std::optional<int> parse_signal(std::string_view s) {
  if (s.starts_with("SIG")) s.remove_prefix(3);
  for (auto& e : kSignals)
    if (s == e.name) return e.sig;
  int n = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (ec == std::errc() && p == s.data() + s.size() && n > 0 && n < NSIG) return n;
  return std::nullopt;
}

namespace {

// /proc/locks's lines, each without its leading "N:" (its place in the list); nullopt where it
// cannot be read. The kernel hands the file out a page (~70 locks) per read(2) and finds its
// place for the next read by counting locks from the start: one released meanwhile before that
// place shifts the next one into the page already read, and that read misses it (a box that
// runs on looked stopped to `ps` while other boxes ended). A list longer than one read is read
// again until two reads agree (at most 5 times), and what any read saw is kept.
std::optional<std::vector<std::string>> proc_locks() {
  std::set<std::string> seen;
  std::string previous;
  for (int pass = 0; pass < 5; ++pass) {
    UniqueFd fd(::open("/proc/locks", O_RDONLY | O_CLOEXEC));
    if (!fd) return std::nullopt;
    std::string text;
    int reads = 0;
    char buf[65536];
    for (ssize_t n; (n = ::read(fd.get(), buf, sizeof buf)) != 0;) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return std::nullopt;
      text.append(buf, static_cast<size_t>(n));
      ++reads;
    }
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);)
      if (size_t start = line.find_first_not_of(' ', line.find(':') + 1); start != std::string::npos)
        seen.insert(line.substr(start));
    if (reads <= 1 || text == previous) break;  // one read is one snapshot
    previous = std::move(text);
  }
  return std::vector<std::string>(seen.begin(), seen.end());
}

// A flock held on the inode of `fd`, as /proc/locks shows it (only the holders this pid
// namespace sees): its holder's pid ("" where it names none) and whether it is exclusive;
// nullopt where none shows, or /proc/locks cannot be read.
struct FlockEntry {
  std::string pid;
  bool exclusive = false;
};
std::optional<FlockEntry> flock_on(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::nullopt;
  auto locks = proc_locks();
  if (!locks) return std::nullopt;
  // "FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF" (major:minor in hex, the inode in decimal);
  // a waiter's line starts with "->".
  char key[64];
  std::snprintf(key, sizeof key, "%02x:%02x:%llu", ::major(st.st_dev), ::minor(st.st_dev),
                static_cast<unsigned long long>(st.st_ino));
  for (const std::string& line : *locks) {
    std::istringstream f(line);
    std::string type, mode, rw, pid, where;
    if ((f >> type >> mode >> rw >> pid >> where) && type == "FLOCK" && where == key)
      return FlockEntry{pid.find_first_not_of("0123456789") == std::string::npos && pid != "0" ? pid : "",
                        rw == "WRITE"};
  }
  return std::nullopt;
}

// How long lock_dir waits out a shared lock (dir_lock_held's question, held for a moment).
constexpr int kProbeWaitMs = 100;

}  // namespace

Result<UniqueFd> lock_dir(const std::string& dir, std::string* holder) {
  UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!d) return last_error();
  for (int waited_ms = 0;; ++waited_ms) {
    if (::flock(d.get(), LOCK_EX | LOCK_NB) == 0) return d;
    int err = errno;
    if (err != EWOULDBLOCK) return sys_error(err);
    // An exclusive holder (a box) refuses at once; a shared one is dir_lock_held asking, gone in
    // a moment: waited out. /proc/locks may miss either (proc_locks): then the wait ends it.
    auto entry = flock_on(d.get());
    if ((entry && entry->exclusive) || waited_ms >= kProbeWaitMs) {
      if (holder) *holder = entry ? entry->pid : "";
      return sys_error(err);
    }
    ::usleep(1000);
  }
}

bool dir_lock_held(const std::string& dir, std::string* holder) {
  UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!d) return false;
  // A shared lock asked for without waiting, and let go at once, says whether one is held:
  // /proc/locks may miss a held lock while other locks come and go (proc_locks), and lock_dir
  // waits such a moment out rather than refuse a box that starts in it. /proc/locks is read only
  // for the holder's pid, where it is wanted (three reads at most).
  if (::flock(d.get(), LOCK_SH | LOCK_NB) == 0) {
    (void)::flock(d.get(), LOCK_UN);
    return false;
  }
  if (errno != EWOULDBLOCK) return false;
  for (int i = 0; holder && i < 3; ++i)
    if (auto entry = flock_on(d.get()); entry && entry->exclusive) {
      *holder = entry->pid;
      break;
    }
  return true;
}

namespace {

// Whether the open file description behind /proc/PID/fd/FD holds an exclusive flock: its fdinfo
// lists the locks taken through it ("lock:\t1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"),
// read under the inode's lock context, so nothing other locks do meanwhile hides it.
bool fd_holds_flock(const std::string& proc, const char* fd) {
  auto info = read_file(proc + "/fdinfo/" + fd);
  if (!info) return false;
  std::istringstream lines(*info);
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with("lock:")) continue;
    std::istringstream f(line.substr(line.find(':', 5) + 1));
    std::string type, mode, rw;
    if ((f >> type >> mode >> rw) && type == "FLOCK" && rw == "WRITE") return true;
  }
  return false;
}

}  // namespace

std::vector<LockedDir> dirs_locked_by(const std::string& exe_name) {
  // The processes, not /proc/locks (which can miss a lock while others come and go: proc_locks):
  // each one running `exe_name`, and each directory it holds open with an exclusive flock.
  std::vector<LockedDir> out;
  DIR* procs = ::opendir("/proc");
  if (!procs) return out;
  while (dirent* p = ::readdir(procs)) {
    std::string_view pid = p->d_name;
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string_view::npos) continue;
    std::string proc = "/proc/" + std::string(pid);
    char exe[4096];
    ssize_t n = ::readlink((proc + "/exe").c_str(), exe, sizeof exe - 1);
    if (n <= 0) continue;
    std::string_view name(exe, static_cast<size_t>(n));
    name = name.substr(0, name.find(" (deleted)"));
    if (name.substr(name.rfind('/') + 1) != exe_name) continue;
    DIR* fds = ::opendir((proc + "/fd").c_str());
    if (!fds) continue;
    while (dirent* e = ::readdir(fds)) {
      std::string fd = proc + "/fd/" + e->d_name;
      struct stat st {};
      if (e->d_name[0] == '.' || ::stat(fd.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
          !fd_holds_flock(proc, e->d_name))
        continue;
      // Its path, then the same inode there from here (another mount namespace's path is not).
      n = ::readlink(fd.c_str(), exe, sizeof exe - 1);
      std::string path(exe, n > 0 ? static_cast<size_t>(n) : 0);
      struct stat here {};
      if (path.starts_with('/') && ::stat(path.c_str(), &here) == 0 && here.st_ino == st.st_ino &&
          here.st_dev == st.st_dev)
        out.push_back({static_cast<pid_t>(std::stol(std::string(pid))), std::move(path)});
    }
    ::closedir(fds);
  }
  ::closedir(procs);
  return out;
}

base::Result<OwnDir> open_own_dir(const std::string& dir) {
  OwnDir d{UniqueFd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC))};
  if (!d.fd) {
    int err = errno;
    if ((err == ELOOP || err == ENOTDIR) && ::lstat(dir.c_str(), &d.st) == 0)
      return base::fail(dir + " is " + file_type_name(d.st.st_mode) + ", not a directory");
    return base::sys_fail("open " + dir, err);
  }
  if (::fstat(d.fd.get(), &d.st) != 0) return base::sys_fail("stat " + dir, errno);
  if (d.st.st_uid != ::geteuid())
    return base::fail(dir + " belongs to uid " + std::to_string(d.st.st_uid) + ", not to this user (uid " +
                      std::to_string(::geteuid()) + ")");
  return d;
}

base::Result<void> own_private_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return base::sys_fail("create " + dir, errno);
  auto d = open_own_dir(dir);
  if (!d) return d.error();
  if ((d->st.st_mode & 077) != 0 && ::fchmod(d->fd.get(), 0700) != 0) return base::sys_fail("chmod 0700 " + dir, errno);
  return {};
}

std::string default_box_root() {
  if (auto* x = std::getenv("XDG_STATE_HOME"); x && *x) return std::string(x) + "/sandboxer/boxes";
  if (auto* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.local/state/sandboxer/boxes";
  return "/var/lib/sandboxer/boxes";
}

base::Result<std::string> state_home() {
  if (auto* x = std::getenv("XDG_STATE_HOME"); x && *x) return std::string(x) + "/sandboxer";
  if (auto* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.local/state/sandboxer";
  std::string dir = "/tmp/sandboxer-" + std::to_string(::geteuid());
  if (auto r = own_private_dir(dir); !r) return r.error();
  return dir;
}

}  // namespace sbx::os
