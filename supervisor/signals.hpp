#pragma once
// Signals as loop events: the signals are blocked in every thread and read from a signalfd, so a
// PID 1 receives them (a blocked signal is queued even for a namespace's init) and nothing runs
// in signal-handler context.
#include <signal.h>
#include <sys/signalfd.h>
#include <uv.h>

#include <functional>

#include "loop/uv-handle.hpp"
#include "os/signal-mask.hpp"
#include "os/unique-fd.hpp"

namespace sbx::supervisor {

class SignalSource {
 public:
  using Handler = std::function<void(const struct signalfd_siginfo&)>;
  SignalSource(uv_loop_t* loop, Handler h);
  SignalSource(const SignalSource&) = delete;
  SignalSource& operator=(const SignalSource&) = delete;

 private:
  static void on_readable(uv_poll_t* p, int status, int events) noexcept;
  os::UniqueFd fd_;
  loop::UvHandle<uv_poll_t> poll_;
  Handler handler_;
};

}  // namespace sbx::supervisor
