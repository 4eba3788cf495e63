#include "os/signal-mask.hpp"

#include <pthread.h>

#include <initializer_list>

namespace sbx::os {

const sigset_t& handled_signals() {
  static const sigset_t set = [] {
    sigset_t s;
    sigemptyset(&s);
    for (int sig : {SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH, SIGPIPE}) sigaddset(&s, sig);
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

}  // namespace sbx::os
