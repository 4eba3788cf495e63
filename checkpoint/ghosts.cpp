// Files a stopped tree holds whose last link is gone, on a mount it sees read-only: what criu
// would write back into that mount's directory at a restore (internal.hpp, host_ghost).
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <charconv>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/internal.hpp"
#include "os/files.hpp"
#include "os/pidfd.hpp"
#include "os/sys.hpp"
#include "os/unique-fd.hpp"

namespace sbx::checkpoint::detail {

namespace {

constexpr std::string_view kDeleted = " (deleted)";

std::optional<std::string> read_link(const std::string& path) {
  char buf[4096 + 16];
  ssize_t n = ::readlink(path.c_str(), buf, sizeof buf);
  if (n < 0 || static_cast<size_t>(n) >= sizeof buf) return std::nullopt;
  return std::string(buf, static_cast<size_t>(n));
}

// The mounts of a mount namespace, by mount id: where (as its processes see it) and whether read-only.
struct MountView {
  std::string point;
  bool read_only = false;
};
using Mounts = std::map<uint64_t, MountView>;

Mounts read_mounts(pid_t pid) {
  Mounts out;
  auto text = os::read_file("/proc/" + std::to_string(pid) + "/mountinfo");
  if (!text) return out;
  os::for_each_line(*text, [&](std::string_view line) {
    // ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS ...: the per-mount options start with rw or ro.
    auto f = os::fields_of(line, 6);
    uint64_t id = 0;
    if (f.size() < 6 || std::from_chars(f[0].data(), f[0].data() + f[0].size(), id).ec != std::errc()) return;
    out[id] = {std::string(f[4]), f[5] == "ro" || f[5].starts_with("ro,")};
  });
  return out;
}

// The mount id /proc/self/fdinfo gives our own fd `fd`, 0 where it names none.
uint64_t mount_id(int fd) {
  auto text = os::read_file("/proc/self/fdinfo/" + std::to_string(fd));
  if (!text) return 0;
  auto at = text->find("mnt_id:");
  if (at == std::string::npos) return 0;
  std::string_view v = std::string_view(*text).substr(at + 7);
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  uint64_t id = 0;
  std::from_chars(v.data(), v.data() + v.size(), id);
  return id;
}

// Whether `link` (a magic link of /proc/PID: fd/N, exe, cwd, map_files/RANGE) names a file or
// directory whose last link is gone, on a read-only mount of `mounts`: its path, as the process
// sees it, with that mount's point; else nullopt. Files on the kernel's internal mounts (memfd,
// shared anonymous memory, SysV segments) are in no mount table: criu dumps those apart.
std::optional<std::string> ghost_of(const std::string& link, const Mounts& mounts) {
  auto target = read_link(link);
  if (!target || !target->ends_with(kDeleted)) return std::nullopt;
  os::UniqueFd fd(::open(link.c_str(), O_PATH | O_CLOEXEC));
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0 || st.st_nlink != 0) return std::nullopt;
  if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) return std::nullopt;
  auto m = mounts.find(mount_id(fd.get()));
  if (m == mounts.end() || !m->second.read_only) return std::nullopt;
  return target->substr(0, target->size() - kDeleted.size()) + "\" (on the read-only mount " + m->second.point + ")";
}

// The first such file process `pid` holds open, maps, runs or has as its directory.
std::optional<std::string> ghost_of_process(pid_t pid, const Mounts& mounts) {
  std::string proc = "/proc/" + std::to_string(pid);
  for (const char* what : {"exe", "cwd", "root"})
    if (auto g = ghost_of(proc + "/" + what, mounts)) return g;
  std::optional<std::string> found;
  if (os::UniqueFd dir(::open((proc + "/fd").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)); dir)
    (void)os::for_each_name(dir.get(), [&](const char* name) {
      found = ghost_of(proc + "/fd/" + name, mounts);
      return !found;
    });
  if (found) return found;
  // Mappings: only those /proc/PID/maps says are of deleted files.
  auto maps = os::read_file(proc + "/maps");
  if (!maps) return std::nullopt;
  os::for_each_line(*maps, [&](std::string_view line) {
    if (!found && line.ends_with(kDeleted))
      found = ghost_of(proc + "/map_files/" + std::string(line.substr(0, line.find(' '))), mounts);
  });
  return found;
}

// The tree's processes: `root` and every process below it (os::tree_pidfds: no pid reused).
std::vector<pid_t> tree_pids(pid_t root, int root_fd) {
  std::vector<pid_t> pids{root};
  for (auto& m : os::tree_pidfds(root, root_fd)) pids.push_back(m.pid);
  return pids;
}

}  // namespace

std::optional<std::string> host_ghost(pid_t root, int root_fd) {
  auto pids = tree_pids(root, root_fd);
  std::map<std::string, Mounts> by_ns;  // the tree's mount namespaces, read once each
  for (pid_t pid : pids) {
    auto ns = read_link("/proc/" + std::to_string(pid) + "/ns/mnt");
    if (!ns) continue;
    auto it = by_ns.find(*ns);
    if (it == by_ns.end()) it = by_ns.emplace(*ns, read_mounts(pid)).first;
    if (auto g = ghost_of_process(pid, it->second)) {
      auto comm = os::read_file("/proc/" + std::to_string(pid) + "/comm");
      std::string name = comm ? comm->substr(0, comm->find('\n')) : "?";
      return "process " + std::to_string(pid) + " (" + name + ") holds \"" + *g;
    }
  }
  return std::nullopt;
}

std::set<std::pair<dev_t, ino_t>> mapped_writable(pid_t root, int root_fd) {
  std::set<std::pair<dev_t, ino_t>> out;
  auto pids = tree_pids(root, root_fd);
  for (pid_t pid : pids) {
    auto maps = os::read_file("/proc/" + std::to_string(pid) + "/maps");
    if (!maps) continue;
    os::for_each_line(*maps, [&](std::string_view line) {
      // ADDR PERMS OFFSET MAJ:MIN INODE [PATH]; PERMS "rw-s": writable and shared.
      auto f = os::fields_of(line, 5);
      if (f.size() < 5 || f[1].size() != 4 || f[1][1] != 'w' || f[1][3] != 's') return;
      unsigned major = 0, minor = 0;
      uint64_t ino = 0;
      auto colon = f[3].find(':');
      if (colon == std::string_view::npos ||
          std::from_chars(f[3].data(), f[3].data() + colon, major, 16).ec != std::errc() ||
          std::from_chars(f[3].data() + colon + 1, f[3].data() + f[3].size(), minor, 16).ec != std::errc() ||
          std::from_chars(f[4].data(), f[4].data() + f[4].size(), ino).ec != std::errc() || ino == 0)
        return;
      out.insert({makedev(major, minor), static_cast<ino_t>(ino)});
    });
  }
  return out;
}

}  // namespace sbx::checkpoint::detail
