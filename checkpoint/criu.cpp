#include "checkpoint/criu.hpp"

#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <string_view>
#include <utility>

#include "os/child-error.hpp"
#include "os/signal-mask.hpp"
#include "os/sys.hpp"

namespace sbx::checkpoint {

std::optional<std::string> find_criu() {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
  std::stringstream ss(p);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    std::string c = dir + "/criu";
    if (::access(c.c_str(), X_OK) == 0) return c;
  }
  return std::nullopt;
}

namespace {

// The steps of criu's child before exec, as it reports them (os::child_fail).
enum : int {
  kStepUnshare = 1,
  kStepSetns = 2,
  kStepExec = 3,
  kStepHostname = 4,
  kStepJoinCgroup = 5,
  kStepMountProc = 6,
  kStepTmp = 7
};

// A live copy's /tmp (CriuRun::tmp_overlay), its strings made before criu's fork.
struct TmpOverlay {
  std::string target, upper, data, volatile_data;
  explicit TmpOverlay(const std::string& dir)
      : target(dir + "/tmp"),
        upper(dir + "/tmp-upper"),
        data("lowerdir=/tmp,upperdir=" + upper + ",workdir=" + dir + "/tmp-work"),
        volatile_data(data + ",volatile") {}
};

// In the child, in criu's mount namespace of its own: the copy's tmp/ gets the overlay (the
// mount is private to that namespace, and goes with it once criu has bound it into the tree),
// `volatile` as in the launcher's plan; where overlay cannot be had, a bind of tmp-upper/, nosuid
// and nodev: a /tmp of the copy's own, holding its files (the checkpointer then takes tmp-upper/,
// as the copy's /tmp is not tmp/ itself).
bool make_tmp(const TmpOverlay& t) noexcept {
  for (const std::string* data : {&t.volatile_data, &t.data})
    if (::mount("overlay", t.target.c_str(), "overlay", MS_NOSUID | MS_NODEV, data->c_str()) == 0) return true;
  return ::mount(t.upper.c_str(), t.target.c_str(), nullptr, MS_BIND, nullptr) == 0 &&
         ::mount(nullptr, t.target.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, nullptr) == 0;
}

const char* step_name(int step) noexcept {
  switch (step) {
    case kStepUnshare:
      return "make its UTS namespace";
    case kStepSetns:
      return "enter the copy's network namespace";
    case kStepExec:
      return "exec";
    case kStepHostname:
      return "set the copy's hostname";
    case kStepJoinCgroup:
      return "join the copy's cgroup";
    case kStepMountProc:
      return "mount its /proc";
    case kStepTmp:
      return "mount the copy's /tmp";
    default:
      return "before exec";
  }
}

// In the child, in a mount namespace of its own: a clone of the detached tmpfs `run_tmpfs` on
// /run (KdatCache). Best effort: without it criu probes the kernel as it always did.
void mount_run_tmpfs(int run_tmpfs) noexcept {
  int clone = ::open_tree(run_tmpfs, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
  if (clone < 0) return;
  (void)::move_mount(clone, "", AT_FDCWD, "/run", MOVE_MOUNT_F_EMPTY_PATH);
  ::close(clone);
}

}  // namespace

int KdatCache::fd() {
  if (std::exchange(tried_, true)) return fd_ ? fd_.get() : -1;
  os::UniqueFd fs(::fsopen("tmpfs", FSOPEN_CLOEXEC));
  if (!fs) return -1;
  // criu's cache is one small file (under 1 KiB); root's only.
  if (::fsconfig(fs.get(), FSCONFIG_SET_STRING, "size", "256k", 0) != 0 ||
      ::fsconfig(fs.get(), FSCONFIG_SET_STRING, "mode", "0700", 0) != 0 ||
      ::fsconfig(fs.get(), FSCONFIG_CMD_CREATE, nullptr, nullptr, 0) != 0)
    return -1;
  fd_ = os::UniqueFd(::fsmount(fs.get(), FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC));
  return fd_ ? fd_.get() : -1;
}

os::Result<pid_t> spawn_criu(const std::string& criu, const CriuRun& run, const char** failed_step) {
  std::vector<std::string> args = {criu};
  args.insert(args.end(), run.args.begin(), run.args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // criu finds its helpers (tar, ip, iptables) on PATH.
  std::string path_env =
      std::string("PATH=") + (std::getenv("PATH") ? std::getenv("PATH") : "/usr/sbin:/usr/bin:/sbin:/bin");
  char* envp[] = {path_env.data(), nullptr};

  os::UniqueFd out(::open(run.output.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!out) return os::last_error();
  auto ep = os::make_pipe();
  if (!ep) return ep.error();
  std::vector<int> src = run.fds;
  int n = static_cast<int>(src.size());
  std::optional<TmpOverlay> tmp;
  if (!run.tmp_overlay.empty()) tmp.emplace(run.tmp_overlay);

  // A pid namespace of its own comes with a mount namespace of its own, for its /proc.
  pid_t pid = run.own_pid_ns
                  ? static_cast<pid_t>(::syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0))
                  : ::fork();
  if (pid < 0) return os::last_error();
  if (pid == 0) {
    // No allocation from here on: errors go to the pipe as (step, errno) (os/child-error.hpp).
    os::reset_signals_for_child();
    // Into the copy's cgroup before anything is restored: its memory is charged there.
    for (int fd : run.cgroup_join)
      if (::write(fd, "0", 1) != 1) os::child_fail(ep->write.get(), kStepJoinCgroup, errno);
    if (run.cgroup_ns && ::unshare(CLONE_NEWCGROUP) != 0) {
      static constexpr char kNoCgns[] =
          "sandboxer: unshare(CLONE_NEWCGROUP) failed: the copy has no cgroup namespace\n";
      (void)!::write(out.get(), kNoCgns, sizeof kNoCgns - 1);
    }
    // A tree dumped in the host's network and UTS namespaces is restored into criu's own: so
    // criu itself starts in fresh ones (the network's made beforehand, with the copy's reports
    // socket in it: sandbox::make_branch_pipes), and the copy gets them.
    if (run.netns >= 0 && ::setns(run.netns, CLONE_NEWNET) != 0) os::child_fail(ep->write.get(), kStepSetns, errno);
    if (!run.hostname.empty()) {
      if (::unshare(CLONE_NEWUTS) != 0) os::child_fail(ep->write.get(), kStepUnshare, errno);
      if (::sethostname(run.hostname.data(), run.hostname.size()) != 0)
        os::child_fail(ep->write.get(), kStepHostname, errno);
    }
    // Docker (and most runtimes) bind /proc/sys read-only over /proc; criu sets a restored UTS
    // namespace's hostname through /proc/sys/kernel/hostname. In a mount namespace of criu's own,
    // that bind is taken away (the proc mount below it is writable); where /proc/sys is no
    // separate mount, as on a plain host, umount fails and nothing changes.
    bool own_mount_ns = run.own_pid_ns;
    if (run.own_pid_ns) {
      // The /proc of the new namespace: criu reads /proc/<pid> of the children it forks by the
      // pids its fork returned.
      if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
          ::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0)
        os::child_fail(ep->write.get(), kStepMountProc, errno);
      if (run.run_tmpfs >= 0) mount_run_tmpfs(run.run_tmpfs);
    } else if ((run.writable_proc_sys || run.run_tmpfs >= 0 || tmp) && ::unshare(CLONE_NEWNS) == 0 &&
               ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0) {
      own_mount_ns = true;
      if (run.writable_proc_sys) (void)::umount2("/proc/sys", MNT_DETACH);
      if (run.run_tmpfs >= 0) mount_run_tmpfs(run.run_tmpfs);
    }
    // A live copy's /tmp needs criu's mount namespace: without one, no copy.
    if (tmp && (!own_mount_ns || !make_tmp(*tmp))) os::child_fail(ep->write.get(), kStepTmp, errno);
    int high[64];
    for (int i = 0; i < n && i < 64; ++i) high[i] = ::fcntl(src[static_cast<size_t>(i)], F_DUPFD_CLOEXEC, 200);
    int efd = ::fcntl(ep->write.get(), F_DUPFD_CLOEXEC, 200);
    int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    ::dup2(null, 0);
    ::dup2(out.get(), 1);
    ::dup2(out.get(), 2);
    for (int i = 0; i < n && i < 64; ++i) ::dup2(high[i], kCriuFirstFd + i);
    int keep_to = kCriuFirstFd + n;
    efd = ::dup3(efd, keep_to, O_CLOEXEC) >= 0 ? keep_to : efd;
    ::close_range(static_cast<unsigned>(keep_to + 1), ~0U, 0);
    for (int fd = 3; fd < kCriuFirstFd; ++fd) ::close(fd);
    ::execve(argv[0], argv.data(), envp);
    os::child_fail(efd, kStepExec, errno);
  }
  ep->write.reset();
  // The child failed before exec and exits at once; the reaper collects it like any child.
  if (auto e = os::read_child_error(ep->read.get())) {
    if (failed_step) *failed_step = step_name(e->step);
    return os::sys_error(e->err);
  }
  return pid;
}

std::string criu_error_from_log(const std::string& log_path) {
  auto text = os::read_file(log_path);
  if (!text) return "criu left no log at " + log_path;
  std::stringstream ss(*text);
  std::string line, last, last_error;
  while (std::getline(ss, line)) {
    if (line.empty()) continue;
    last = line;
    // RLIMIT_NOFILE: benign where CAP_SYS_RESOURCE is missing (docs/architecture.md, "Hosts").
    // The first error is the cause; the ones after it ("Dumping FAILED") are its echo.
    if (last_error.empty() && line.find("Error") != std::string::npos &&
        line.find("RLIMIT_NOFILE") == std::string::npos)
      last_error = line;
  }
  std::string what = last_error.empty() ? last : last_error;
  // "(00.012345) Error (criu/x.c:12): message" -> "message (criu/x.c:12)".
  auto e = what.find("Error (");
  auto close = e == std::string::npos ? std::string::npos : what.find("): ", e);
  if (close != std::string::npos) what = what.substr(close + 3) + " (" + what.substr(e + 7, close - e - 7) + ")";
  return what;
}

namespace {

// A protobuf varint at text[pos]; false at the end of the text or on a malformed one.
bool read_varint(std::string_view text, size_t& pos, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && pos < text.size(); shift += 7) {
    auto b = static_cast<unsigned char>(text[pos++]);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// The varint fields of one protobuf message (field number -> value); others are skipped.
std::map<uint32_t, uint64_t> varint_fields(std::string_view msg) {
  std::map<uint32_t, uint64_t> out;
  size_t pos = 0;
  uint64_t key = 0, v = 0;
  while (pos < msg.size() && read_varint(msg, pos, key)) {
    if ((key & 7) == 0) {
      if (!read_varint(msg, pos, v)) break;
      out[static_cast<uint32_t>(key >> 3)] = v;
    } else if ((key & 7) == 2) {
      if (!read_varint(msg, pos, v) || v > msg.size() - pos) break;
      pos += v;
    } else {
      break;  // StatsEntry holds varints and one embedded message only
    }
  }
  return out;
}

}  // namespace

boost::json::object criu_stats(const std::string& path) {
  auto text = os::read_file(path);
  // Two magic numbers, the message's size (little endian), then StatsEntry: field 1 is the
  // dump's DumpStatsEntry, field 2 the restore's RestoreStatsEntry (times in microseconds).
  if (!text || text->size() < 14) return {};
  std::string_view rest(*text);
  uint32_t size = 0;
  std::memcpy(&size, rest.data() + 8, 4);
  rest = rest.substr(12);
  if (size > rest.size()) return {};
  rest = rest.substr(0, size);
  size_t pos = 0;
  uint64_t key = 0, len = 0;
  if (!read_varint(rest, pos, key) || (key & 7) != 2 || !read_varint(rest, pos, len) || len > rest.size() - pos)
    return {};
  auto f = varint_fields(rest.substr(pos, len));
  auto ms = [&](uint32_t n) { return static_cast<double>(static_cast<int64_t>(f[n] / 100)) / 10; };
  boost::json::object o;
  if ((key >> 3) == 1) {
    o = {{"freezing", ms(1)}, {"frozen", ms(2)},       {"memdump", ms(3)},
         {"memwrite", ms(4)}, {"pages_scanned", f[5]}, {"pages_written", f[7]}};
  } else if ((key >> 3) == 2) {
    o = {{"forking", ms(3)}, {"restore", ms(4)}, {"pages_restored", f[5]}};
  }
  return o;
}

base::Result<void> lazy_pages_possible() {
  const char* env = std::getenv("SANDBOXER_LAZY_PAGES");
  if (env && std::string_view(env) == "0") return base::fail("lazy pages are turned off (SANDBOXER_LAZY_PAGES=0)");
  // criu's lazy restore hands the copy's userfaultfd to its lazy-pages daemon: where a host's
  // seccomp or an old kernel refuses the syscall, copies are restored with all their memory.
  long fd = ::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return base::fail(std::string("userfaultfd is unavailable: ") + std::strerror(errno));
  ::close(static_cast<int>(fd));
  return {};
}

namespace {

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// criu's image.h and mm.proto: a VMA's status bits, its mmap flags, its madv bit mask.
constexpr uint64_t kVmaRegular = 1 << 0, kVmaStack = 1 << 1, kVmaVsyscall = 1 << 2, kVmaVdso = 1 << 3,
                   kVmaAnonPrivate = 1 << 9, kVmaVvar = 1 << 12;
constexpr uint64_t kMapPrivate = 0x02, kMapAnonymous = 0x20, kMapGrowsdown = 0x100;
constexpr uint64_t kMadvMergeable = 1ULL << 12;  // MADV_MERGEABLE is 12
constexpr uint32_t kMmVmas = 14;                 // MmEntry.vmas
constexpr uint32_t kVmaFlags = 6, kVmaStatus = 7, kVmaMadv = 9;

// One VmaEntry, marked mergeable when it is an anonymous private mapping criu restores as such
// (not the stack, vdso, vvar or vsyscall); `marked` says whether it was.
std::string mark_vma(std::string_view vma, bool& marked) {
  auto f = varint_fields(vma);
  uint64_t st = f[kVmaStatus], fl = f[kVmaFlags];
  marked = (st & (kVmaRegular | kVmaAnonPrivate)) == (kVmaRegular | kVmaAnonPrivate) &&
           !(st & (kVmaStack | kVmaVsyscall | kVmaVdso | kVmaVvar)) &&
           (fl & (kMapPrivate | kMapAnonymous)) == (kMapPrivate | kMapAnonymous) && !(fl & kMapGrowsdown);
  if (!marked) return std::string(vma);
  uint64_t madv = f.count(kVmaMadv) ? f[kVmaMadv] : 0;
  // Every field but madv as it was, then madv with the mergeable bit.
  std::string out;
  size_t pos = 0;
  uint64_t key = 0, v = 0;
  while (pos < vma.size()) {
    size_t start = pos;
    if (!read_varint(vma, pos, key)) break;
    if ((key & 7) == 0) {
      if (!read_varint(vma, pos, v)) break;
    } else if ((key & 7) == 2) {
      if (!read_varint(vma, pos, v) || v > vma.size() - pos) break;
      pos += v;
    } else if ((key & 7) == 1) {
      pos += 8;
    } else if ((key & 7) == 5) {
      pos += 4;
    }
    if (pos > vma.size()) break;
    if ((key >> 3) != kVmaMadv) out.append(vma.substr(start, pos - start));
  }
  put_varint(out, static_cast<uint64_t>(kVmaMadv) << 3);
  put_varint(out, madv | kMadvMergeable);
  return out;
}

// A whole MmEntry with its VMAs marked; nullopt where it is not what criu writes.
std::optional<std::string> mark_mm(std::string_view mm, int64_t& marked) {
  std::string out;
  size_t pos = 0;
  uint64_t key = 0, v = 0;
  while (pos < mm.size()) {
    size_t start = pos;
    if (!read_varint(mm, pos, key)) return std::nullopt;
    uint32_t wire = key & 7;
    if (wire == 0) {
      if (!read_varint(mm, pos, v)) return std::nullopt;
      out.append(mm.substr(start, pos - start));
    } else if (wire == 2) {
      if (!read_varint(mm, pos, v) || v > mm.size() - pos) return std::nullopt;
      std::string_view body = mm.substr(pos, v);
      pos += v;
      if ((key >> 3) != kMmVmas) {
        out.append(mm.substr(start, pos - start));
        continue;
      }
      bool m = false;
      std::string vma = mark_vma(body, m);
      marked += m ? 1 : 0;
      put_varint(out, key);
      put_varint(out, vma.size());
      out.append(vma);
    } else if (wire == 1 || wire == 5) {
      pos += wire == 1 ? 8 : 4;
      if (pos > mm.size()) return std::nullopt;
      out.append(mm.substr(start, pos - start));
    } else {
      return std::nullopt;
    }
  }
  return out;
}

}  // namespace

base::Result<int64_t> mark_mergeable(const std::string& images_dir) {
  std::error_code ec;
  std::vector<std::string> names;
  for (auto& e : std::filesystem::directory_iterator(images_dir, ec)) names.push_back(e.path().filename().string());
  if (ec) return base::fail("list " + images_dir + ": " + ec.message());
  int64_t marked = 0;
  for (auto& name : names) {
    if (!name.starts_with("mm-") || !name.ends_with(".img")) continue;
    std::string path = images_dir + "/" + name;
    auto text = os::read_file(path);
    if (!text) return base::fail("read " + path + ": " + text.error().message());
    // Two magic numbers, then one entry: its size (little endian) and the MmEntry.
    uint32_t size = 0;
    if (text->size() >= 12) std::memcpy(&size, text->data() + 8, 4);
    if (text->size() < 12 || size != text->size() - 12) return base::fail(path + " is not one criu MmEntry");
    auto mm = mark_mm(std::string_view(*text).substr(12), marked);
    if (!mm) return base::fail(path + " is not one criu MmEntry");
    std::string out = text->substr(0, 8);
    auto n = static_cast<uint32_t>(mm->size());
    out.append(reinterpret_cast<const char*>(&n), 4);
    out.append(*mm);
    if (auto w = os::write_file_atomic(path, out, 0600); !w)
      return base::fail("write " + path + ": " + w.error().message());
  }
  return marked;
}

std::string ksm_state() {
  auto run = os::read_file("/sys/kernel/mm/ksm/run");
  if (!run) return "unavailable";
  return !run->empty() && (*run)[0] == '1' ? "running" : "stopped";
}

}  // namespace sbx::checkpoint
