#include "os/socket-owner.hpp"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace sbx::os {

namespace {

// The socket inode from /proc/PID/net/{tcp,tcp6,udp,udp6}: "sl local rem st ... uid timeout inode".
std::optional<unsigned long> find_inode(pid_t ns_pid, bool tcp, uint16_t lport, uint16_t rport) {
  for (const char* v : {"", "6"}) {
    std::string path = "/proc/" + std::to_string(ns_pid) + "/net/" + (tcp ? "tcp" : "udp") + v;
    FILE* f = std::fopen(path.c_str(), "re");
    if (!f) continue;
    char line[512];
    std::optional<unsigned long> found;
    while (!found && std::fgets(line, sizeof line, f)) {
      char local[64], remote[64];
      unsigned long inode = 0;
      unsigned st = 0, uid = 0;
      if (std::sscanf(line, " %*d: %63s %63s %x %*s %*s %*s %u %*d %lu", local, remote, &st, &uid, &inode) != 5)
        continue;
      const char* lc = std::strrchr(local, ':');
      const char* rc = std::strrchr(remote, ':');
      if (!lc || !rc) continue;
      if (std::strtoul(lc + 1, nullptr, 16) != lport) continue;
      if (tcp && std::strtoul(rc + 1, nullptr, 16) != rport) continue;
      if (inode != 0) found = inode;
    }
    std::fclose(f);
    if (found) return found;
  }
  return std::nullopt;
}

}  // namespace

std::optional<pid_t> socket_owner(pid_t ns_pid, NsId netns, bool tcp, uint16_t local_port, uint16_t remote_port) {
  auto inode = find_inode(ns_pid, tcp, local_port, remote_port);
  if (!inode) return std::nullopt;
  std::string want = "socket:[" + std::to_string(*inode) + "]";
  DIR* proc = ::opendir("/proc");
  if (!proc) return std::nullopt;
  std::optional<pid_t> owner;
  while (!owner) {
    auto* e = ::readdir(proc);
    if (!e) break;
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end || pid <= 0) continue;
    std::string base = std::string("/proc/") + e->d_name;
    struct stat theirs {};
    if (::stat((base + "/ns/net").c_str(), &theirs) != 0 || theirs.st_ino != netns.ino || theirs.st_dev != netns.dev)
      continue;
    DIR* fds = ::opendir((base + "/fd").c_str());
    if (!fds) continue;
    while (auto* fe = ::readdir(fds)) {
      char target[64];
      ssize_t n = ::readlinkat(::dirfd(fds), fe->d_name, target, sizeof target - 1);
      if (n <= 0) continue;
      if (std::string_view(target, static_cast<size_t>(n)) == want) {
        owner = static_cast<pid_t>(pid);
        break;
      }
    }
    ::closedir(fds);
  }
  ::closedir(proc);
  return owner;
}

}  // namespace sbx::os
