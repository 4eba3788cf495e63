#pragma once
// The one owner of waitpid in the supervisor. Whoever starts a child registers its pid; every
// exit the kernel reports (registered or an orphan that reparented to us) is collected here and
// dispatched. libuv's process handles are never used for this reason: they wait by pid and lose
// exits that a waitpid(-1) already collected.
#include <sys/types.h>

#include <functional>
#include <unordered_map>

namespace sbx::supervisor {

class Reaper {
 public:
  using OnExit = std::function<void(pid_t, int status)>;
  /// Registers `pid`; `fn` runs once, when its exit is collected.
  void watch(pid_t pid, OnExit fn);
  /// Collects every exited child (WNOHANG loop); call on SIGCHLD.
  void reap();
  size_t orphans_reaped() const noexcept { return orphans_; }

 private:
  std::unordered_map<pid_t, OnExit> watched_;
  size_t orphans_ = 0;
};

}  // namespace sbx::supervisor
