#include "supervisor/signals.hpp"
#include "os/signal-mask.hpp"

#include <spdlog/spdlog.h>
#include <sys/signalfd.h>

#include <cerrno>
#include <cstring>

namespace sbx::supervisor {

SignalSource::SignalSource(uv_loop_t* loop, Handler h)
    : fd_(::signalfd(-1, &os::handled_signals(), SFD_NONBLOCK | SFD_CLOEXEC)), handler_(std::move(h)) {
  // SIGPIPE is in the set only so that a write to a closed pipe returns EPIPE instead of
  // killing the supervisor; it is read and dropped.
  if (!fd_) {
    spdlog::critical("signalfd: {}", std::strerror(errno));
    std::abort();
  }
  auto poll = loop::UvHandle<uv_poll_t>::make(loop, uv_poll_init, fd_.get());
  if (!poll) {
    spdlog::critical("watch the signalfd: {}", poll.error().message);
    std::abort();
  }
  poll_ = std::move(*poll);
  poll_->data = this;
  uv_poll_start(poll_.get(), UV_READABLE, on_readable);
}

void SignalSource::on_readable(uv_poll_t* p, int, int) noexcept {
  auto* self = static_cast<SignalSource*>(p->data);
  struct signalfd_siginfo si[16];
  for (;;) {
    ssize_t n = ::read(self->fd_.get(), si, sizeof si);
    if (n <= 0) return;
    for (size_t i = 0; i < static_cast<size_t>(n) / sizeof si[0]; ++i) {
      if (si[i].ssi_signo == SIGPIPE) continue;
      try {
        self->handler_(si[i]);
      } catch (const std::exception& e) {
        spdlog::error("handle signal {}: {}", si[i].ssi_signo, e.what());
      }
    }
  }
}

}  // namespace sbx::supervisor
