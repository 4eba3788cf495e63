#include "supervisor/stats.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "os/sys.hpp"
#include "supervisor/box.hpp"

namespace sbx::supervisor {

namespace {

// utime + stime (clock ticks) and rss (pages) of one process, from /proc/PID/stat.
bool proc_stat(pid_t pid, uint64_t& ticks, uint64_t& rss_pages) {
  auto text = os::read_file("/proc/" + std::to_string(pid) + "/stat");
  if (!text) return false;
  auto rp = text->rfind(')');
  if (rp == std::string::npos) return false;
  // Fields after the command: state(3) ... utime(14) stime(15) ... rss(24).
  std::vector<std::string_view> f;
  std::string_view rest = std::string_view(*text).substr(rp + 2);
  size_t pos = 0;
  while (pos < rest.size() && f.size() < 30) {
    size_t sp = rest.find(' ', pos);
    if (sp == std::string_view::npos) sp = rest.size();
    f.push_back(rest.substr(pos, sp - pos));
    pos = sp + 1;
  }
  if (f.size() < 22) return false;
  auto num = [](std::string_view s) { return std::strtoull(std::string(s).c_str(), nullptr, 10); };
  ticks = num(f[11]) + num(f[12]);
  rss_pages = num(f[21]);
  return true;
}

// Private (clean + dirty), Pss and KSM bytes of one process, from /proc/PID/smaps_rollup (kB).
void add_rollup(pid_t pid, TreeStats& t) {
  auto text = os::read_file("/proc/" + std::to_string(pid) + "/smaps_rollup");
  if (!text) return;  // gone, or a kernel without it: the other figures stand
  std::string_view rest = *text;
  while (!rest.empty()) {
    size_t nl = rest.find('\n');
    std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    std::string_view key = line.substr(0, colon);
    uint64_t kb = std::strtoull(std::string(line.substr(colon + 1)).c_str(), nullptr, 10);
    if (key == "Private_Clean" || key == "Private_Dirty")
      t.memory_private += kb << 10;
    else if (key == "Pss")
      t.memory_pss += kb << 10;
    else if (key == "KSM")
      t.memory_ksm += kb << 10;
  }
}

}  // namespace

TreeStats tree_stats(pid_t root) {
  TreeStats t;
  if (root <= 0) return t;
  static const double hz = static_cast<double>(::sysconf(_SC_CLK_TCK));
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<pid_t> tree = os::descendants_of(root);
  tree.push_back(root);
  for (pid_t p : tree) {
    uint64_t ticks = 0, rss = 0;
    if (!proc_stat(p, ticks, rss)) continue;  // gone since it was listed
    t.cpu_s += static_cast<double>(ticks) / hz;
    t.memory += rss * page;
    ++t.pids;
    add_rollup(p, t);
  }
  return t;
}

namespace {

constexpr int kMaxDiskDepth = 128;  // directories open at once, at most

// The tree below `dir` (owned; closed here), each directory opened from its parent's fd without
// following a symlink: walked by path, an agent that kept swapping a directory of its workspace
// for a symlink to the host's /usr (renameat2 RENAME_EXCHANGE) had 250 MB of the host counted as
// its disk, and the supervisor listing host directories as root.
void add_tree(int dir, int depth, uint64_t& total, size_t& seen, size_t max_entries) {
  DIR* dp = ::fdopendir(dir);
  if (!dp) {
    ::close(dir);
    return;
  }
  int fd = ::dirfd(dp);
  while (auto* e = ::readdir(dp)) {
    if (!std::strcmp(e->d_name, ".") || !std::strcmp(e->d_name, "..")) continue;
    if (++seen >= max_entries) break;
    struct stat st {};
    if (::fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    total += static_cast<uint64_t>(st.st_blocks) * 512;
    if (!S_ISDIR(st.st_mode) || depth >= kMaxDiskDepth) continue;
    int sub = ::openat(fd, e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (sub >= 0) add_tree(sub, depth + 1, total, seen, max_entries);
  }
  ::closedir(dp);
}

}  // namespace

uint64_t disk_used(const std::string& dir, size_t max_entries) {
  uint64_t total = 0;
  size_t seen = 0;
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd >= 0) add_tree(fd, 0, total, seen, max_entries);
  return total;
}

boost::json::object collect_stats(const Box& box, uint64_t* memory_peak) {
  auto to_json = [](const TreeStats& t) {
    return boost::json::object{
        {"cpu_s", t.cpu_s},           {"memory", t.memory},         {"memory_private", t.memory_private},
        {"memory_pss", t.memory_pss}, {"memory_ksm", t.memory_ksm}, {"pids", t.pids}};
  };
  // The box: everything below the supervisor (the supervisor itself is not the agent's).
  TreeStats all;
  for (pid_t c : os::children_of(::getpid())) all += tree_stats(c);
  boost::json::object boxo = to_json(all);
  if (memory_peak) {
    if (all.memory > *memory_peak) *memory_peak = all.memory;
    boxo["memory_peak"] = *memory_peak;
  }
  boost::json::object branches;
  uint64_t disk_total = 0;
  for (const auto& name : box.branch_names()) {
    auto dir = box.branch_dir(name);
    // The agent's /tmp is the overlay's upper dir (tmp/ is used where the overlay cannot be had).
    uint64_t disk = disk_used(dir + "/workspace") + disk_used(dir + "/tmp-upper") + disk_used(dir + "/tmp");
    disk_total += disk;
    auto b = to_json(tree_stats(box.ns_init_pid(name)));
    b["disk"] = disk;
    branches[name] = std::move(b);
  }
  boxo["disk"] = disk_total;
  boost::json::object procs;
  for (auto& [key, p] : box.procs()) {
    if (p->status_known || p->pid <= 0) continue;
    // Ids are per branch: a copy's processes are "id@branch" here (its agent is "main@f1" already).
    std::string id = p->branch == "main" || p->id.ends_with("@" + p->branch) ? p->id : p->id + "@" + p->branch;
    procs[id] = to_json(tree_stats(p->pid));
  }
  return {{"box", boxo}, {"branches", branches}, {"procs", procs}};
}

MetricsTimer::MetricsTimer(Box& box, uv_loop_t* loop, uint64_t every_ms) : box_(box), timer_(loop::make_timer(loop)) {
  timer_->data = this;
  uv_timer_start(
      timer_.get(),
      [](uv_timer_t* t) noexcept {
        auto* self = static_cast<MetricsTimer*>(t->data);
        if (!self) return;
        try {
          auto body = collect_stats(self->box_, &self->peak_);
          body["type"] = "metrics";
          self->box_.emit("main", std::move(body));
        } catch (const std::exception&) {
          // A process that vanished mid-read changes nothing: the next tick reads again.
        }
      },
      every_ms, every_ms);
}

}  // namespace sbx::supervisor
