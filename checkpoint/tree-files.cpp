// What a checkpoint's tree holds, read from /proc (internal.hpp, tree_files): the files it maps
// shared and writable, and the files whose last link is gone (which criu carries in the dump;
// on a mount the process sees read-only, criu would write one back into that mount's directory
// at a restore).
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

// A file or directory whose last link is gone, held through a magic link of /proc/PID (fd/N, exe,
// cwd, root, map_files/RANGE): its path as the process sees it, its mount and its stat.
struct Held {
  std::string path;
  const MountView* mount = nullptr;
  struct stat st {};
};

// What `link` holds if it is a file or directory whose last link is gone on a mount of `mounts`;
// else nullopt. Files on the kernel's internal mounts (memfd, shared anonymous memory, SysV
// segments) are in no mount table: criu dumps those apart, not as ghost files.
std::optional<Held> deleted_at(const std::string& link, const Mounts& mounts) {
  auto target = read_link(link);
  if (!target || !target->ends_with(kDeleted)) return std::nullopt;
  os::UniqueFd fd(::open(link.c_str(), O_PATH | O_CLOEXEC));
  Held h;
  if (!fd || ::fstat(fd.get(), &h.st) != 0 || h.st.st_nlink != 0) return std::nullopt;
  if (!S_ISREG(h.st.st_mode) && !S_ISDIR(h.st.st_mode)) return std::nullopt;
  auto m = mounts.find(mount_id(fd.get()));
  if (m == mounts.end()) return std::nullopt;
  h.path = target->substr(0, target->size() - kDeleted.size());
  h.mount = &m->second;
  return h;
}

// The file (device, inode) a line of /proc/PID/maps maps, and whether shared and writable.
struct MapLine {
  std::pair<dev_t, ino_t> file;
  bool shared_writable = false;
};
std::optional<MapLine> map_line(std::string_view line) {
  // ADDR PERMS OFFSET MAJ:MIN INODE [PATH]; PERMS "rw-s": writable and shared.
  auto f = os::fields_of(line, 5);
  if (f.size() < 5 || f[1].size() != 4) return std::nullopt;
  unsigned major = 0, minor = 0;
  uint64_t ino = 0;
  auto colon = f[3].find(':');
  if (colon == std::string_view::npos ||
      std::from_chars(f[3].data(), f[3].data() + colon, major, 16).ec != std::errc() ||
      std::from_chars(f[3].data() + colon + 1, f[3].data() + f[3].size(), minor, 16).ec != std::errc() ||
      std::from_chars(f[4].data(), f[4].data() + f[4].size(), ino).ec != std::errc() || ino == 0)
    return std::nullopt;
  return MapLine{{makedev(major, minor), static_cast<ino_t>(ino)}, f[1][1] == 'w' && f[1][3] == 's'};
}

// "process PID (COMM) holds \"PATH\"" of process `pid` (its /proc dir `proc`) and `path` and what
// follows it.
std::string holds(pid_t pid, const std::string& proc, const std::string& path) {
  auto comm = os::read_file(proc + "/comm");
  return "process " + std::to_string(pid) + " (" + (comm ? comm->substr(0, comm->find('\n')) : "?") + ") holds \"" +
         path;
}

// What process `pid` holds, into `out`: the files it maps shared and writable, and (with `mounts`,
// its namespace's mount table) the files it holds open, maps, runs or has as its directory whose
// last link is gone. Its maps are read once for both.
void scan_process(pid_t pid, const Mounts* mounts, TreeFiles& out) {
  std::string proc = "/proc/" + std::to_string(pid);
  std::optional<std::string> found;  // its first such file on a read-only mount
  auto note = [&](const std::string& link) {
    auto h = deleted_at(link, *mounts);
    if (!h) return;
    if (!found && h->mount->read_only) found = h->path + "\" (on the read-only mount " + h->mount->point + ")";
    if (!S_ISREG(h->st.st_mode) || !out.deleted.files.insert({h->st.st_dev, h->st.st_ino}).second) return;
    auto size = static_cast<uint64_t>(h->st.st_size);
    out.deleted.bytes += size;
    if (size >= out.deleted.largest_bytes) {
      out.deleted.largest_bytes = size;
      out.deleted.largest = holds(pid, proc, h->path + "\"");
    }
  };
  if (mounts) {
    for (const char* what : {"exe", "cwd", "root"}) note(proc + "/" + what);
    if (os::UniqueFd dir(::open((proc + "/fd").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)); dir)
      (void)os::for_each_name(dir.get(), [&](const char* name) {
        note(proc + "/fd/" + name);
        return true;
      });
  }
  std::set<std::pair<dev_t, ino_t>> deleted_maps;  // a file mapped in several ranges is looked at once
  if (auto maps = os::read_file(proc + "/maps"))
    os::for_each_line(*maps, [&](std::string_view line) {
      auto m = map_line(line);
      if (!m) return;
      if (m->shared_writable) out.mapped.insert(m->file);
      // Mappings of deleted files: only those maps says are.
      if (mounts && line.ends_with(kDeleted) && deleted_maps.insert(m->file).second)
        note(proc + "/map_files/" + std::string(line.substr(0, line.find(' '))));
    });
  if (found && !out.host_ghost) out.host_ghost = holds(pid, proc, *found);
}

}  // namespace

TreeFiles tree_files(pid_t root, int root_fd, bool ghosts) {
  TreeFiles out;
  std::vector<pid_t> pids{root};
  for (auto& m : os::tree_pidfds(root, root_fd)) pids.push_back(m.pid);
  std::map<std::string, Mounts> by_ns;  // the tree's mount namespaces, read once each
  for (pid_t pid : pids) {
    const Mounts* mounts = nullptr;
    if (ghosts)
      if (auto ns = read_link("/proc/" + std::to_string(pid) + "/ns/mnt")) {
        auto it = by_ns.find(*ns);
        if (it == by_ns.end()) it = by_ns.emplace(*ns, read_mounts(pid)).first;
        mounts = &it->second;
      }
    scan_process(pid, mounts, out);
  }
  return out;
}

}  // namespace sbx::checkpoint::detail
