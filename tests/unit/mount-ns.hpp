#pragma once
// A test's steps that mount (a tmpfs, a bind) run in a child of a mount namespace of its own, so
// that what they mount never reaches the host's, however the test ends.
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

namespace sbx::test {

/// Runs `body(step)` in a forked child, in a mount namespace of its own (the host's mounts private
/// there); `step(ok, code)` ends the child with `code` unless `ok`. Returns the child's exit code:
/// 0 when every step held, else the code of the first that did not (2: the namespace; -1: the
/// child did not exit).
template <class Body>
int in_own_mount_ns(Body body) {
  pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    auto step = [](bool ok, int code) {
      if (!ok) ::_exit(code);
    };
    step(::unshare(CLONE_NEWNS) == 0 && ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0, 2);
    body(step);
    ::_exit(0);
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

}  // namespace sbx::test
