#include "supervisor/proc-io.hpp"

#include <unistd.h>

#include <cerrno>

#include <spdlog/spdlog.h>

#include "os/sys.hpp"

namespace sbx::supervisor {

InputWriter::InputWriter(uv_loop_t* loop, os::UniqueFd fd) : fd_(std::move(fd)) {
  (void)os::set_nonblocking(fd_.get());
  if (auto poll = loop::UvHandle<uv_poll_t>::make(loop, uv_poll_init, fd_.get())) {
    poll_ = std::move(*poll);
    poll_->data = this;
  } else {
    spdlog::warn("watch the input of a process: {}", poll.error().message);
  }
}

bool InputWriter::write(std::string_view data) {
  if (closed() || pending_.size() + data.size() > kMaxPending) return false;
  pending_.append(data);
  flush();
  return true;
}

void InputWriter::eof() {
  if (!fd_) return;
  eof_ = true;
  flush();
}

void InputWriter::flush() {
  while (!pending_.empty() && fd_) {
    ssize_t n = ::write(fd_.get(), pending_.data(), pending_.size());
    if (n > 0) {
      pending_.erase(0, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      if (!polling_ && poll_) {
        polling_ = true;
        uv_poll_start(poll_.get(), UV_WRITABLE, on_writable);
      }
      return;
    }
    // EPIPE and the like: the reader is gone; what is pending can never be delivered.
    pending_.clear();
    eof_ = true;
  }
  if (polling_) {
    polling_ = false;
    uv_poll_stop(poll_.get());
  }
  if (eof_ && fd_) {
    if (poll_) uv_poll_stop(poll_.get());
    fd_.reset();
  }
}

void InputWriter::on_writable(uv_poll_t* p, int, int) noexcept {
  auto* self = static_cast<InputWriter*>(p->data);
  if (!self) return;
  self->flush();
  if (!self->pending_.empty() || !self->on_drained) return;
  try {
    self->on_drained();
  } catch (const std::exception& e) {
    spdlog::error("after a reader took what waited for it: {}", e.what());
  }
}

void ProcIo::after(uint64_t ms, std::function<void()> fn) {
  fn_ = std::move(fn);
  if (!timer_) {
    timer_ = loop::make_timer(loop_);
    timer_->data = this;
  }
  uv_timer_start(
      timer_.get(),
      [](uv_timer_t* t) noexcept {
        auto* self = static_cast<ProcIo*>(t->data);
        if (!self || !self->fn_) return;
        try {
          self->fn_();
        } catch (const std::exception& e) {
          spdlog::error("wait for the output of a process: {}", e.what());
        }
      },
      ms, 0);
}

}  // namespace sbx::supervisor
