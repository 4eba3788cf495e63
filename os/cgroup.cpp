#include "os/cgroup.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "os/sys.hpp"

namespace sbx::os {

namespace {

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t p = s.find(sep, start);
    if (p == std::string_view::npos) p = s.size();
    out.emplace_back(s.substr(start, p - start));
    start = p + 1;
  }
  return out;
}

Result<void> write_str(const std::string& path, std::string_view v) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return last_error();
  ssize_t n = ::write(fd, v.data(), v.size());
  int e = errno;
  ::close(fd);
  if (n < 0) return sys_error(e);
  return {};
}

std::optional<int64_t> read_int(const std::string& path) {
  auto t = read_file(path);
  if (!t) return std::nullopt;
  if (t->starts_with("max")) return INT64_MAX;
  try {
    return std::stoll(*t);
  } catch (...) {
    return std::nullopt;
  }
}

int64_t now_ms() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// A mount of a cgroup filesystem: its root inside the hierarchy and where it is mounted.
struct CgMount {
  std::string root, point;
  std::set<std::string> controllers;  // v1 only
};

std::string join_path(const CgMount& m, const std::string& cg_path) {
  // The process's path is relative to the hierarchy's root; the mount shows `m.root` there.
  std::string rel = cg_path;
  if (m.root != "/" && rel.starts_with(m.root)) rel = rel.substr(m.root.size());
  if (rel == "/") rel.clear();
  return m.point + rel;
}

}  // namespace

std::optional<int64_t> keyed_value(std::string_view text, std::string_view key) {
  for (auto& line : split(text, '\n')) {
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0 && line[key.size()] == ' ') {
      try {
        return std::stoll(line.substr(key.size() + 1));
      } catch (...) {
        return std::nullopt;
      }
    }
  }
  return std::nullopt;
}

namespace {

// The cgroup mounts /proc/self/mountinfo shows: every v1 hierarchy's, the first cgroup2.
void read_cgroup_mounts(std::vector<CgMount>& v1, std::optional<CgMount>& v2) {
  std::ifstream f("/proc/self/mountinfo");
  std::string line;
  while (std::getline(f, line)) {
    auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    auto pre = split(line.substr(0, dash), ' ');
    auto post = split(line.substr(dash + 3), ' ');
    if (pre.size() < 5 || post.size() < 3) continue;
    CgMount m{pre[3], pre[4], {}};
    if (post[0] == "cgroup2") {
      if (!v2) v2 = m;
    } else if (post[0] == "cgroup") {
      for (auto& o : split(post[2], ','))
        if (o != "rw" && o != "ro" && !o.starts_with("name=") && o.find('=') == std::string::npos)
          m.controllers.insert(o);
      v1.push_back(std::move(m));
    }
  }
}

// The directories below `dir` (to `depth` more levels) that hold a directory whose name starts
// with `prefix`; such a directory is not looked into.
void find_parents(const std::string& dir, std::string_view prefix, int depth, std::vector<std::string>& out) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> below;
  bool holds = false;
  while (auto* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    if (e->d_type != DT_DIR || name == "." || name == "..") continue;
    if (name.starts_with(prefix))
      holds = true;
    else if (depth > 0)
      below.emplace_back(dir + "/" + std::string(name));
  }
  ::closedir(d);
  if (holds) out.push_back(dir);
  for (auto& b : below) find_parents(b, prefix, depth - 1, out);
}

}  // namespace

std::vector<CgroupHost> hosts_holding(std::string_view prefix, int max_depth) {
  std::vector<CgMount> v1;
  std::optional<CgMount> v2;
  read_cgroup_mounts(v1, v2);
  // v1: the k-th directory found in each hierarchy that carries a controller a branch's group
  // uses (the devices one too) goes to the k-th host: one supervisor's groups sit in one
  // directory per hierarchy, so there is one host unless groups of the prefix are in two places.
  std::vector<CgroupHost> out;
  auto wanted = CgroupDir::v1_controllers();
  wanted.push_back("devices");
  for (auto& m : v1) {
    std::vector<std::string> mine;
    for (auto& c : wanted)
      if (m.controllers.contains(c)) mine.push_back(c);
    if (mine.empty()) continue;
    std::vector<std::string> parents;
    find_parents(m.point, prefix, max_depth, parents);
    for (size_t k = 0; k < parents.size(); ++k) {
      if (out.size() <= k) out.push_back(CgroupHost{.version = "v1"});
      for (auto& c : mine) {
        out[k].v1_dirs[c] = parents[k];
        out[k].controllers.push_back(c);
      }
    }
  }
  bool v1_used = std::any_of(v1.begin(), v1.end(), [&](const CgMount& m) {
    return std::any_of(wanted.begin(), wanted.end(), [&](const std::string& c) { return m.controllers.contains(c); });
  });
  if (v2 && !v1_used) {
    std::vector<std::string> parents;
    find_parents(v2->point, prefix, max_depth, parents);
    for (auto& p : parents) out.push_back(CgroupHost{.version = "v2", .v2_dir = p});
  }
  return out;
}

CgroupHost detect_cgroups() {
  CgroupHost h;
  std::vector<CgMount> v1;
  std::optional<CgMount> v2;
  read_cgroup_mounts(v1, v2);
  std::ifstream f("/proc/self/cgroup");
  std::string line;
  while (std::getline(f, line)) {
    auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    std::string ctl = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    if (ctl.empty()) {
      if (v2) h.v2_dir = join_path(*v2, path);
      continue;
    }
    for (auto& c : split(ctl, ',')) {
      if (c.starts_with("name=")) continue;
      for (auto& m : v1)
        if (m.controllers.contains(c)) {
          h.v1_dirs[c] = join_path(m, path);
          h.controllers.push_back(c);
          break;
        }
    }
  }
  if (!h.v1_dirs.empty()) {
    h.version = "v1";
  } else if (!h.v2_dir.empty()) {
    h.version = "v2";
    if (auto s = read_file(h.v2_dir + "/cgroup.controllers")) {
      std::stringstream ss(*s);
      std::string one;
      while (ss >> one) h.controllers.push_back(one);
    }
  }
  return h;
}

std::optional<int64_t> host_limit(const CgroupHost& host, const std::string& controller) {
  std::string file;
  if (host.version == "v1") {
    auto it = host.v1_dirs.find(controller);
    if (it == host.v1_dirs.end()) return std::nullopt;
    file = it->second + (controller == "memory" ? "/memory.limit_in_bytes" : "/pids.max");
  } else if (host.version == "v2") {
    file = host.v2_dir + (controller == "memory" ? "/memory.max" : "/pids.max");
  } else {
    return std::nullopt;
  }
  auto v = read_int(file);
  // v1 says "no limit" with a huge page-rounded number, v2 and pids.max with "max".
  if (!v || *v >= (INT64_C(1) << 62)) return std::nullopt;
  return v;
}

const std::vector<std::string>& CgroupDir::v1_controllers() {
  static const std::vector<std::string> c = {"memory", "cpu", "cpuacct", "pids", "freezer"};
  return c;
}

namespace {

// mkdir `d`, or find it there already (then `fresh` goes false); false with errno otherwise.
bool make_or_find(const std::string& d, bool& fresh) {
  if (::mkdir(d.c_str(), 0755) == 0) return true;
  if (errno != EEXIST) return false;
  fresh = false;
  return true;
}

}  // namespace

Result<CgroupDir> CgroupDir::create_v1(const CgroupHost& host, const std::string& name) {
  CgroupDir g;
  std::map<std::string, std::string> made;  // parent dir -> new dir (co-mounted hierarchies)
  for (auto& c : v1_controllers()) {
    auto it = host.v1_dirs.find(c);
    if (it == host.v1_dirs.end()) continue;
    auto& parent = it->second;
    if (!made.contains(parent)) {
      std::string d = parent + "/" + name;
      if (!make_or_find(d, g.fresh_)) return last_error();
      made[parent] = d;
      g.dirs_.push_back(d);
    }
    g.by_controller_[c] = made[parent];
  }
  if (g.dirs_.empty()) return sys_error(ENOENT);
  // The devices hierarchy is a hardening, not a ceiling: where a group cannot be made there (a
  // read-only mount), the group goes on without it and set_devices says ENOTSUP.
  if (auto it = host.v1_dirs.find("devices"); it != host.v1_dirs.end()) {
    std::string d = made.contains(it->second) ? made[it->second] : it->second + "/" + name;
    bool have = made.contains(it->second);
    if (!have && make_or_find(d, g.fresh_)) {
      have = true;
      g.dirs_.push_back(d);
    }
    if (have) g.by_controller_["devices"] = d;
  }
  // No swap for the group: the memory ceiling is the ceiling.
  if (g.has("memory")) (void)write_str(g.dir_of("memory") + "/memory.swappiness", "0");
  return g;
}

Result<CgroupDir> CgroupDir::create_v2(const std::string& parent, const std::string& name) {
  CgroupDir g;
  g.v2_ = true;
  // Delegate what the parent offers (memory, cpu, pids); where the parent has processes of its
  // own, v2 refuses ("no internal processes") and the group works with the core files only.
  if (auto offered = read_file(parent + "/cgroup.controllers")) {
    std::stringstream ss(*offered);
    std::string c;
    while (ss >> c)
      if (c == "memory" || c == "cpu" || c == "pids") (void)write_str(parent + "/cgroup.subtree_control", "+" + c);
  }
  std::string d = parent + "/" + name;
  if (!make_or_find(d, g.fresh_)) return last_error();
  g.dirs_.push_back(d);
  g.by_controller_[""] = d;
  if (auto have = read_file(d + "/cgroup.controllers")) {
    std::stringstream ss(*have);
    std::string c;
    while (ss >> c) g.by_controller_[c] = d;
  }
  return g;
}

Result<CgroupDir> CgroupDir::create(const CgroupHost& host, const std::string& name) {
  if (host.version == "v1") return create_v1(host, name);
  if (host.version == "v2") return create_v2(host.v2_dir, name);
  return sys_error(ENOTSUP);
}

std::vector<std::string> CgroupDir::names_below(const CgroupHost& host, std::string_view prefix) {
  std::set<std::string> parents, names;
  for (auto& [controller, dir] : host.v1_dirs) parents.insert(dir);
  if (host.version == "v2") parents.insert(host.v2_dir);
  for (auto& parent : parents) {
    DIR* d = ::opendir(parent.c_str());
    if (!d) continue;
    while (auto* e = ::readdir(d))
      if (e->d_type == DT_DIR && std::string_view(e->d_name).starts_with(prefix)) names.insert(e->d_name);
    ::closedir(d);
  }
  return {names.begin(), names.end()};
}

CgroupDir CgroupDir::find(const CgroupHost& host, const std::string& name) {
  CgroupDir g;
  g.fresh_ = false;
  auto there = [&](const std::string& parent) {
    std::string d = parent + "/" + name;
    return ::access(d.c_str(), F_OK) == 0 ? d : std::string();
  };
  if (host.version == "v2") {
    g.v2_ = true;
    if (std::string d = there(host.v2_dir); !d.empty()) {
      g.dirs_.push_back(d);
      g.by_controller_[""] = d;
    }
    return g;
  }
  for (auto& [controller, parent] : host.v1_dirs)
    if (std::string d = there(parent); !d.empty()) {
      g.by_controller_[controller] = d;
      if (std::ranges::find(g.dirs_, d) == g.dirs_.end()) g.dirs_.push_back(d);  // co-mounted: one dir
    }
  return g;
}

namespace {
// The processes in any of `dirs` (each once: on v1 one is in a group of every hierarchy).
size_t processes_in(const std::vector<std::string>& dirs) {
  std::set<pid_t> all;
  for (auto& d : dirs)
    if (auto t = read_file(d + "/cgroup.procs")) {
      std::stringstream ss(*t);
      for (pid_t p; ss >> p;) all.insert(p);
    }
  return all.size();
}
}  // namespace

size_t CgroupDir::release_below(const CgroupHost& host, std::string_view prefix, bool kill_held,
                                const std::function<void(const std::string& name, bool held)>& on_each,
                                const std::function<void(const std::string& name, const std::string& why)>& on_error) {
  size_t held_left = 0;
  for (auto& name : names_below(host, prefix)) {
    CgroupDir g = find(host, name);  // the directories there now: none is made, nothing written
    auto dirs = g.dirs();
    // Asked before the thaw (a thawed tree whose ns-init has lost its parent ends by itself), of
    // every directory: on v1 a process may be in the group of one hierarchy only.
    size_t n = processes_in(dirs);
    bool held = n > 0;
    if (held && !kill_held) {
      on_error(name, "it holds " + std::to_string(n) + " process" + (n == 1 ? "" : "es") + "; left as it is");
      g.dirs_.clear();  // not removed: its destructor would kill what is in it
      ++held_left;
      continue;
    }
    bool joined = false;
    if (kill_held) {
      (void)g.freeze(false);
      if (held) (void)g.kill_all(2000);
      g.remove();
    } else {
      // Nothing is killed: a group a process joined since it was found empty stays (EBUSY).
      for (auto& d : dirs)
        if (::rmdir(d.c_str()) != 0 && errno == EBUSY) {
          joined = processes_in(dirs) > 0;
          held_left += joined ? 1 : 0;
          break;
        }
      g.dirs_.clear();
    }
    auto left =
        std::find_if(dirs.begin(), dirs.end(), [](const std::string& d) { return ::access(d.c_str(), F_OK) == 0; });
    if (left != dirs.end())
      on_error(name, "could not remove " + *left +
                         (held     ? " (what it held was killed)"
                          : joined ? " (a process joined it meanwhile)"
                                   : ""));
    else
      on_each(name, held);
  }
  return held_left;
}

CgroupDir::CgroupDir(CgroupDir&& o) noexcept
    : v2_(o.v2_), fresh_(o.fresh_), by_controller_(std::move(o.by_controller_)), dirs_(std::move(o.dirs_)) {
  o.dirs_.clear();
  o.by_controller_.clear();
}

CgroupDir& CgroupDir::operator=(CgroupDir&& o) noexcept {
  if (this != &o) {
    // A directory both name (the same group made again, found there) passes to `o`'s owner: it
    // is not removed under it.
    std::erase_if(dirs_, [&](const std::string& d) { return std::ranges::find(o.dirs_, d) != o.dirs_.end(); });
    remove();
    v2_ = o.v2_;
    fresh_ = o.fresh_;
    by_controller_ = std::move(o.by_controller_);
    dirs_ = std::move(o.dirs_);
    o.dirs_.clear();
    o.by_controller_.clear();
  }
  return *this;
}

CgroupDir::~CgroupDir() { remove(); }

void CgroupDir::remove() {
  if (dirs_.empty()) return;
  // As a rule the group's tree has ended: each rmdir succeeds at once, with nothing read or
  // written first. EBUSY names a process still in the group (on v1 in every hierarchy alike):
  // then the KILLs, and a process just killed leaves the group a moment later.
  bool killed = false;
  for (auto& d : dirs_) {
    int64_t until = now_ms() + 1000;
    while (::rmdir(d.c_str()) != 0 && errno == EBUSY && now_ms() < until) {
      if (!std::exchange(killed, true)) {
        (void)kill_all();
        continue;
      }
      ::usleep(5000);
    }
  }
  dirs_.clear();
  by_controller_.clear();
}

std::string CgroupDir::dir_of(const std::string& c) const {
  auto it = by_controller_.find(c);
  return it == by_controller_.end() ? std::string() : it->second;
}

bool CgroupDir::has(const std::string& c) const { return by_controller_.contains(c); }

std::vector<std::string> CgroupDir::dirs() const { return dirs_; }

Result<void> CgroupDir::set_memory(int64_t bytes) {
  if (!has("memory")) return sys_error(ENOTSUP);
  std::string d = dir_of("memory"), v = std::to_string(bytes);
  if (v2_) {
    if (auto r = write_str(d + "/memory.max", v); !r) return r;
    (void)write_str(d + "/memory.swap.max", "0");
    return {};
  }
  // memsw must stay >= the limit: raise it first when growing, lower it after when shrinking.
  auto r = write_str(d + "/memory.limit_in_bytes", v);
  if (!r) {
    if (auto r2 = write_str(d + "/memory.memsw.limit_in_bytes", v); !r2) return r;
    return write_str(d + "/memory.limit_in_bytes", v);
  }
  (void)write_str(d + "/memory.memsw.limit_in_bytes", v);
  return {};
}

Result<void> CgroupDir::set_cpus(double cpus) {
  if (!has("cpu")) return sys_error(ENOTSUP);
  const int64_t period = 100000;
  // Rounded to the nearest microsecond (cpus is never negative: the profile checks it) without libm's
  // llround: its one use would make the loader map libm at every start.
  auto quota = static_cast<int64_t>(cpus * period + 0.5);
  if (v2_) return write_str(dir_of("cpu") + "/cpu.max", std::to_string(quota) + " " + std::to_string(period));
  if (auto r = write_str(dir_of("cpu") + "/cpu.cfs_period_us", std::to_string(period)); !r) return r;
  return write_str(dir_of("cpu") + "/cpu.cfs_quota_us", std::to_string(quota));
}

Result<void> CgroupDir::set_pids(int64_t max) {
  if (!has("pids")) return sys_error(ENOTSUP);
  return write_str(dir_of("pids") + "/pids.max", std::to_string(max));
}

Result<std::vector<UniqueFd>> CgroupDir::open_join_fds() const {
  std::vector<UniqueFd> out;
  for (auto& d : dirs_) {
    int fd = ::open((d + (v2_ ? "/cgroup.procs" : "/tasks")).c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return last_error();
    out.emplace_back(fd);
  }
  return out;
}

Result<UniqueFd> CgroupDir::open_v2_dir() const {
  if (!v2_ || dirs_.empty()) return sys_error(ENOTSUP);
  int fd = ::open(dirs_.front().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return last_error();
  return UniqueFd(fd);
}

Result<void> CgroupDir::add(pid_t pid) {
  for (auto& d : dirs_)
    if (auto r = write_str(d + "/cgroup.procs", std::to_string(pid)); !r) return r;
  return {};
}

std::vector<pid_t> CgroupDir::pids() const {
  std::vector<pid_t> out;
  if (dirs_.empty()) return out;
  auto t = read_file(dirs_.front() + "/cgroup.procs");
  if (!t) return out;
  std::stringstream ss(*t);
  pid_t p;
  while (ss >> p) out.push_back(p);
  return out;
}

bool CgroupDir::populated() const {
  if (dirs_.empty()) return false;
  if (v2_) {
    if (auto t = read_file(dirs_.front() + "/cgroup.events")) return keyed_value(*t, "populated").value_or(0) != 0;
  }
  return !pids().empty();
}

bool CgroupDir::kill_all(int timeout_ms) {
  if (dirs_.empty()) return true;
  int64_t until = now_ms() + timeout_ms;
  bool have_kill = v2_ && ::access((dirs_.front() + "/cgroup.kill").c_str(), W_OK) == 0;
  for (;;) {
    bool any = false;
    if (have_kill) {
      any = populated();
      if (any) (void)write_str(dirs_.front() + "/cgroup.kill", "1");
    } else {
      // v1: a process may fork between our read and our kill; repeat until nothing is left. A
      // frozen group would keep its KILLs pending, so thaw it first.
      if (has("freezer")) (void)write_str(dir_of("freezer") + "/freezer.state", "THAWED");
      for (auto& d : dirs_) {
        auto t = read_file(d + "/cgroup.procs");
        if (!t) continue;
        std::stringstream ss(*t);
        pid_t p;
        while (ss >> p) {
          any = true;
          ::kill(p, SIGKILL);
        }
      }
    }
    if (!any) return true;
    if (now_ms() >= until) return false;
    ::usleep(5000);
  }
}

Result<void> CgroupDir::freeze(bool on) {
  if (v2_) return write_str(dirs_.front() + "/cgroup.freeze", on ? "1" : "0");
  if (!has("freezer")) return sys_error(ENOTSUP);
  return write_str(dir_of("freezer") + "/freezer.state", on ? "FROZEN" : "THAWED");
}

bool CgroupDir::frozen() const {
  if (dirs_.empty()) return false;
  if (v2_) {
    auto t = read_file(dirs_.front() + "/cgroup.events");
    return t && keyed_value(*t, "frozen").value_or(0) == 1;
  }
  auto t = read_file(dir_of("freezer") + "/freezer.state");
  return t && t->starts_with("FROZEN");
}

std::optional<int64_t> CgroupDir::memory_current() const {
  if (!has("memory")) return std::nullopt;
  return read_int(dir_of("memory") + (v2_ ? "/memory.current" : "/memory.usage_in_bytes"));
}

std::optional<int64_t> CgroupDir::memory_max() const {
  if (!has("memory")) return std::nullopt;
  return read_int(dir_of("memory") + (v2_ ? "/memory.max" : "/memory.limit_in_bytes"));
}

std::optional<int64_t> CgroupDir::oom_kills() const {
  if (!has("memory")) return std::nullopt;
  auto t = read_file(dir_of("memory") + (v2_ ? "/memory.events" : "/memory.oom_control"));
  if (!t) return std::nullopt;
  return keyed_value(*t, "oom_kill");
}

std::optional<int64_t> CgroupDir::pids_current() const {
  if (!has("pids")) return std::nullopt;
  return read_int(dir_of("pids") + "/pids.current");
}

std::optional<int64_t> CgroupDir::pids_max() const {
  if (!has("pids")) return std::nullopt;
  return read_int(dir_of("pids") + "/pids.max");
}

std::optional<int64_t> CgroupDir::pids_max_events() const {
  if (!has("pids")) return std::nullopt;
  auto t = read_file(dir_of("pids") + "/pids.events");
  if (!t) return std::nullopt;
  return keyed_value(*t, "max");
}

std::optional<int64_t> CgroupDir::cpu_usage_us() const {
  if (v2_) {
    auto t = read_file(dirs_.front() + "/cpu.stat");
    if (!t) return std::nullopt;
    return keyed_value(*t, "usage_usec");
  }
  if (!has("cpuacct")) return std::nullopt;
  auto ns = read_int(dir_of("cpuacct") + "/cpuacct.usage");
  if (!ns) return std::nullopt;
  return *ns / 1000;
}

namespace {
// cgroup v1 notifications: "<eventfd> <fd of the watched file> [args]" into cgroup.event_control.
// The registration lives as long as the eventfd; the watched file's fd may be closed after it.
Result<UniqueFd> v1_event(const std::string& dir, const char* file, const std::string& args) {
  UniqueFd efd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!efd) return last_error();
  UniqueFd watched(::open((dir + "/" + file).c_str(), O_RDONLY | O_CLOEXEC));
  if (!watched) return last_error();
  std::string line = std::to_string(efd.get()) + " " + std::to_string(watched.get()) + (args.empty() ? "" : " " + args);
  if (auto r = write_str(dir + "/cgroup.event_control", line); !r) return r.error();
  return efd;
}
}  // namespace

Result<UniqueFd> CgroupDir::oom_eventfd() const {
  if (v2_ || !has("memory")) return sys_error(ENOTSUP);
  return v1_event(dir_of("memory"), "memory.oom_control", "");
}

Result<UniqueFd> CgroupDir::memory_threshold_eventfd(const std::string& memory_dir, int64_t bytes) {
  return v1_event(memory_dir, "memory.usage_in_bytes", std::to_string(bytes));
}

}  // namespace sbx::os
