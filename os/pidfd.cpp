#include "os/pidfd.hpp"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace sbx::os {

Result<UniqueFd> pidfd_open(pid_t pid) noexcept {
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return last_error();
  return UniqueFd(fd);
}

Result<void> pidfd_signal(int pidfd, int sig) noexcept {
  if (::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0) == 0 || errno == ESRCH) return {};
  return last_error();
}

bool pidfd_alive(int pidfd) noexcept {
  return pidfd >= 0 && ::syscall(SYS_pidfd_send_signal, pidfd, 0, nullptr, 0) == 0;
}

pid_t parent_of(pid_t pid) {
  auto text = read_file("/proc/" + std::to_string(pid) + "/stat");
  if (!text) return -1;
  // "PID (comm) S PPID ...": comm may hold spaces and parentheses; the last ')' ends it.
  auto close = text->rfind(')');
  if (close == std::string::npos || close + 4 >= text->size()) return -1;
  return static_cast<pid_t>(std::atoi(text->c_str() + close + 4));
}

std::vector<TreeMember> tree_pidfds(pid_t root, int root_fd, size_t limit) {
  std::vector<TreeMember> out;
  if (!pidfd_alive(root_fd)) return out;
  struct Parent {
    pid_t pid;
    int fd;
  };
  std::vector<Parent> stack = {{root, root_fd}};
  while (!stack.empty() && out.size() < limit) {
    Parent par = stack.back();
    stack.pop_back();
    for (pid_t c : children_of(par.pid)) {
      auto fd = pidfd_open(c);
      if (!fd) continue;  // gone already
      // The pid names the listed child only if its parent is still `par` and `par` is still
      // alive now (so par's pid number was not reused either).
      if (parent_of(c) != par.pid || !pidfd_alive(par.fd)) continue;
      out.push_back({c, std::move(*fd)});
      stack.push_back({c, out.back().fd.get()});
    }
  }
  return out;
}

}  // namespace sbx::os
