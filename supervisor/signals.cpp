#include "signals.hpp"

#include <spdlog/spdlog.h>
#include <sys/signalfd.h>

#include <cerrno>
#include <cstring>

namespace sbx::supervisor {

const sigset_t& handled_signals() {
  static const sigset_t set = [] {
    sigset_t s;
    sigemptyset(&s);
    for (int sig : {SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH, SIGPIPE})
      sigaddset(&s, sig);
    return s;
  }();
  return set;
}

void block_handled_signals() { pthread_sigmask(SIG_BLOCK, &handled_signals(), nullptr); }

void reset_signals_for_child() noexcept {
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig)
    if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &sa, nullptr);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
}

SignalSource::SignalSource(uv_loop_t* loop, Handler h)
    : fd_(::signalfd(-1, &handled_signals(), SFD_NONBLOCK | SFD_CLOEXEC)), poll_(new uv_poll_t), handler_(std::move(h)) {
  // SIGPIPE is in the set only so that a write to a closed pipe returns EPIPE instead of
  // killing the supervisor; it is read and dropped.
  if (!fd_) {
    spdlog::critical("signalfd: {}", std::strerror(errno));
    std::abort();
  }
  uv_poll_init(loop, poll_, fd_.get());
  poll_->data = this;
  uv_poll_start(poll_, UV_READABLE, on_readable);
}

SignalSource::~SignalSource() {
  uv_poll_stop(poll_);
  uv_close(reinterpret_cast<uv_handle_t*>(poll_), [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
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
