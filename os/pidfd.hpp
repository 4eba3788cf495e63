#pragma once
// Processes by pidfd: a signal sent through a pidfd reaches the process it was opened for or
// nobody, never another process that got the same pid number after it died.
#include <sys/types.h>

#include <vector>

#include "os/sys.hpp"
#include "os/unique-fd.hpp"

namespace sbx::os {

/// pidfd_open(pid). Only sound for a pid that cannot have been reused: our own unreaped child, or
/// a pid checked after the open (tree_pidfds does).
Result<UniqueFd> pidfd_open(pid_t pid) noexcept;

/// pidfd_send_signal; a process already gone (ESRCH) is not an error.
Result<void> pidfd_signal(int pidfd, int sig) noexcept;

/// Whether the process of `pidfd` still runs (or is a zombie not yet reaped).
bool pidfd_alive(int pidfd) noexcept;

/// The parent pid from /proc/PID/stat, or -1.
pid_t parent_of(pid_t pid);

struct TreeMember {
  pid_t pid = -1;
  UniqueFd fd;
};

/// A pidfd for every process below `root` (`root_fd` is root's own pidfd), parents before
/// children. Each child is opened by pid and kept only if, after the open, its parent is still
/// the member it was listed under and that member is still alive: a pid reused meanwhile is never
/// included. Empty when root is gone. At most `limit` members.
std::vector<TreeMember> tree_pidfds(pid_t root, int root_fd, size_t limit = 100000);

}  // namespace sbx::os
