#pragma once
// The supervisor's ends of an exec'd process's stdio: a non-blocking writer for its stdin (or
// pty), the pty master for resizing, and a timer that stops waiting for output a straggler holds.
#include <uv.h>

#include <functional>
#include <memory>
#include <string>

#include "loop/uv-handle.hpp"
#include "os/unique-fd.hpp"

namespace sbx::supervisor {

/// Writes to a non-blocking fd on the loop, keeping what the fd cannot take yet (bounded): a
/// process's stdin, ns-init's requests, the agent channel's replies. A reader that does not read
/// never blocks the loop.
class InputWriter {
 public:
  static constexpr size_t kMaxPending = 16u << 20;
  InputWriter(uv_loop_t* loop, os::UniqueFd fd);
  InputWriter(const InputWriter&) = delete;
  InputWriter& operator=(const InputWriter&) = delete;
  /// False when the buffer would exceed kMaxPending or the input is closed.
  bool write(std::string_view data);
  /// Closes the fd once everything pending is written.
  void eof();
  bool closed() const noexcept { return !fd_ || eof_; }
  int fd() const noexcept { return fd_.get(); }
  /// Bytes written here that the fd has not taken yet.
  size_t pending() const noexcept { return pending_.size(); }
  /// Called on the loop once the fd has taken all that waited for it (not from write()).
  std::function<void()> on_drained;

 private:
  void flush();
  static void on_writable(uv_poll_t* p, int status, int events) noexcept;
  os::UniqueFd fd_;
  loop::UvHandle<uv_poll_t> poll_;  // empty when the fd cannot be polled: then nothing waits
  std::string pending_;
  bool eof_ = false;
  bool polling_ = false;
};

class ProcIo {
 public:
  explicit ProcIo(uv_loop_t* loop) : loop_(loop) {}
  ProcIo(const ProcIo&) = delete;
  ProcIo& operator=(const ProcIo&) = delete;

  std::unique_ptr<InputWriter> input;  // stdin pipe, or the pty master
  int pty = -1;                        // the pty master (owned by `input`), for resize
  // Input sent before the process started: written once `input` exists.
  std::string early_input;
  bool early_eof = false;
  /// Runs `fn` after `ms` once (replacing an earlier one).
  void after(uint64_t ms, std::function<void()> fn);

 private:
  uv_loop_t* loop_;
  loop::UvHandle<uv_timer_t> timer_;
  std::function<void()> fn_;
};

}  // namespace sbx::supervisor
