#include "supervisor/reaper.hpp"

#include <spdlog/spdlog.h>
#include <sys/wait.h>

#include <cerrno>

namespace sbx::supervisor {

void Reaper::watch(pid_t pid, OnExit fn) { watched_[pid] = std::move(fn); }

void Reaper::reap() {
  for (;;) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG | __WALL);
    if (pid == 0) return;
    if (pid < 0) {
      if (errno == EINTR) continue;
      return;  // ECHILD: nothing left
    }
    auto it = watched_.find(pid);
    if (it == watched_.end()) {
      ++orphans_;
      spdlog::debug("reap orphan {}: status {:#x}", pid, status);
      continue;
    }
    auto fn = std::move(it->second);
    watched_.erase(it);
    try {
      fn(pid, status);
    } catch (const std::exception& e) {
      spdlog::error("exit handler for {}: {}", pid, e.what());
    }
  }
}

}  // namespace sbx::supervisor
