#include "sandbox/capabilities.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <linux/landlock.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <regex>
#include <sstream>

#include "os/proc-view.hpp"
#include "os/sys.hpp"
#include "sandbox/launcher.hpp"
#include "sandbox/policy.hpp"

extern char** environ;

namespace sbx::sandbox {

boost::json::object HostCapabilities::to_json() const {
  boost::json::object o;
  o["cgroup"] = cgroup;
  o["controllers"] = controllers;
  o["namespaces"] = namespaces;
  if (!namespaces) o["namespaces_why_not"] = namespaces_why_not;
  o["seccomp"] = seccomp;
  o["landlock"] = landlock_abi;
  o["overlay"] = overlay;
  o["criu"] = criu ? boost::json::value(*criu) : boost::json::value(nullptr);
  o["isolation"] = isolation;
  return o;
}

CommandProbe::CommandProbe(const std::vector<std::string>& argv) {
  auto p = os::make_pipe();
  if (!p) return;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p->write.get(), 1);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  std::vector<char*> av;
  for (auto& s : argv) av.push_back(const_cast<char*>(s.c_str()));
  av.push_back(nullptr);
  pid_t pid;
  int rc = posix_spawnp(&pid, av[0], &fa, &attr, av.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return;
  pid_ = pid;
  fd_ = p->read.release();
}

CommandProbe::~CommandProbe() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  }
  if (fd_ >= 0) ::close(fd_);
}

std::optional<std::string> CommandProbe::output(int timeout_ms) {
  if (pid_ <= 0) return std::nullopt;
  std::string out;
  struct pollfd pfd {
    fd_, POLLIN, 0
  };
  for (;;) {
    if (::poll(&pfd, 1, timeout_ms) <= 0) {
      ::kill(pid_, SIGKILL);
      break;
    }
    char buf[4096];
    ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  int st;
  ::waitpid(pid_, &st, 0);
  pid_ = -1;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return std::nullopt;
  return out;
}

std::optional<std::string> run_and_capture(const std::vector<std::string>& argv, int timeout_ms) {
  return CommandProbe(argv).output(timeout_ms);
}

std::optional<std::string> criu_version_of(const std::optional<std::string>& out) {
  if (!out) return std::nullopt;
  std::smatch m;
  static const std::regex re(R"(Version:\s*([0-9.]+))");
  if (std::regex_search(*out, m, re)) return m[1].str();
  return std::nullopt;
}

namespace {

// What names the criu binary for the cache: a reinstall changes its inode, size or times.
std::string criu_identity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  boost::json::object o{{"path", path},
                        {"dev", static_cast<uint64_t>(st.st_dev)},
                        {"ino", static_cast<uint64_t>(st.st_ino)},
                        {"size", static_cast<int64_t>(st.st_size)},
                        {"mtime_ns", static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec},
                        {"ctime_ns", static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec}};
  return boost::json::serialize(o);
}

bool is_version(std::string_view v) {
  if (v.empty() || v.size() > 32 || !std::isdigit(static_cast<unsigned char>(v.front()))) return false;
  return std::all_of(v.begin(), v.end(),
                     [](char c) { return std::isdigit(static_cast<unsigned char>(c)) || c == '.'; });
}

// The cached version for `key`, read below `dir` (os::read_own_file_at: ours, no one else may
// write it, no symlink followed); nullopt otherwise.
std::optional<std::string> read_criu_cache(int dir, const std::string& key) {
  auto text = os::read_own_file_at(dir, kCriuVersionCache, 4096);
  if (!text) return std::nullopt;
  boost::system::error_code ec;
  auto v = boost::json::parse(*text, ec);
  if (ec || !v.is_object()) return std::nullopt;
  auto* k = v.as_object().if_contains("criu");
  auto* ver = v.as_object().if_contains("version");
  if (!k || !ver || !k->is_string() || !ver->is_string() || k->as_string() != key) return std::nullopt;
  if (!is_version(ver->as_string())) return std::nullopt;
  return std::string(ver->as_string());
}

}  // namespace

CriuVersionProbe::CriuVersionProbe(const std::optional<std::string>& criu, const std::string& cache_dir)
    : cache_dir_(cache_dir) {
  if (!criu) return;
  if (!cache_dir_.empty()) key_ = criu_identity(*criu);
  if (!key_.empty())
    if (auto dir = os::open_dir(cache_dir_))
      if ((version_ = read_criu_cache(dir->get(), key_))) {
        from_cache_ = true;
        return;
      }
  probe_.emplace(std::vector<std::string>{*criu, "--version"});
}

std::optional<std::string> CriuVersionProbe::version(int timeout_ms) {
  if (!probe_) return version_;
  version_ = criu_version_of(probe_->output(timeout_ms));
  probe_.reset();
  if (version_ && !key_.empty()) {
    std::string text = boost::json::serialize(boost::json::object{{"criu", key_}, {"version", *version_}}) + "\n";
    // A cache that cannot be written (a read-only home, a full disk) costs the next start a probe.
    if (auto dir = os::open_dir(cache_dir_)) (void)os::write_file_atomic_at(dir->get(), kCriuVersionCache, text, 0600);
  }
  return version_;
}

HostCapabilities detect_capabilities(CommandProbe* criu, bool probe_namespaces) {
  HostCapabilities c;
  // cgroups: v1 lines name their controllers; a lone "0::" line is the v2 unified hierarchy.
  {
    std::ifstream f("/proc/self/cgroup");
    std::string line;
    bool v1 = false;
    while (std::getline(f, line)) {
      auto a = line.find(':'), b = line.find(':', a + 1);
      if (a == std::string::npos || b == std::string::npos) continue;
      std::string ctl = line.substr(a + 1, b - a - 1);
      if (ctl.empty()) continue;
      std::stringstream ss(ctl);
      std::string one;
      while (std::getline(ss, one, ','))
        if (!one.starts_with("name=")) {
          c.controllers.push_back(boost::json::value(one));
          v1 = true;
        }
    }
    if (v1) {
      c.cgroup = "v1";
    } else if (auto s = os::read_file("/sys/fs/cgroup/cgroup.controllers")) {
      c.cgroup = "v2";
      std::stringstream ss(*s);
      std::string one;
      while (ss >> one) c.controllers.push_back(boost::json::value(one));
    }
  }
  if (!probe_namespaces) {
    c.namespaces = true;
  } else if (auto r = can_make_namespaces(); r) {
    c.namespaces = true;
  } else {
    c.namespaces = false;
    c.namespaces_why_not = r.error().message;
  }
  c.seccomp = ::prctl(PR_GET_SECCOMP) >= 0;
  {
    long abi = ::syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION);
    c.landlock_abi = abi > 0 ? static_cast<int>(abi) : 0;
  }
  if (auto fs = os::read_file("/proc/filesystems")) c.overlay = fs->find("\toverlay\n") != std::string::npos;
  if (criu) c.criu = criu_version_of(criu->output(3000));
  if (auto v = os::read_file("/proc/version"); v && v->find("gVisor") != std::string::npos)
    c.isolation = "gvisor";
  else if (::access("/.dockerenv", F_OK) == 0 || ::access("/run/.containerenv", F_OK) == 0 ||
           std::getenv("KUBERNETES_SERVICE_HOST"))
    c.isolation = "container";
  return c;
}

std::string flat_fallback_refusal(const std::string& mode, const HostCapabilities& caps) {
  if (mode == "run") return "";
  if (mode == "refuse") return "the profile's isolation.without_namespaces is \"refuse\"";
  // Root of the host's user namespace: nothing holds an agent without namespaces in, unless a
  // container is around it that took CAP_SYS_ADMIN away (Docker's default); one that left it (a
  // privileged container) holds in nothing either. A gVisor sandbox or a microVM is a kernel of
  // its own around the box whatever the capabilities inside (Modal's sandboxes are gVisor's,
  // which has no new mount API for the plan).
  if (caps.isolation == "gvisor" || caps.isolation == "microvm") return "";
  if (::geteuid() != 0 || !os::in_initial_user_namespace()) return "";
  auto own = own_capabilities();
  bool sys_admin = !own || (own->effective & (1ULL << CAP_SYS_ADMIN)) != 0;
  const char* run = " (isolation.without_namespaces \"run\" runs it anyway)";
  if (caps.isolation == "process")
    return std::string("the supervisor is root on this host, with no container around it: its agent would be") + run;
  if (sys_admin)
    return std::string(
               "the supervisor is root holding CAP_SYS_ADMIN (a host, or a privileged container): its agent "
               "would be root with nothing around it") +
           run;
  return "";
}

}  // namespace sbx::sandbox
