#include "supervisor/proc-io.hpp"

#include <unistd.h>

#include <cerrno>

#include "os/sys.hpp"

namespace sbx::supervisor {

InputWriter::InputWriter(uv_loop_t* loop, os::UniqueFd fd) : fd_(std::move(fd)) {
  (void)os::set_nonblocking(fd_.get());
  poll_ = new uv_poll_t;
  uv_poll_init(loop, poll_, fd_.get());
  poll_->data = this;
}

InputWriter::~InputWriter() {
  poll_->data = nullptr;
  uv_close(reinterpret_cast<uv_handle_t*>(poll_), [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
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
      if (!polling_) {
        polling_ = true;
        uv_poll_start(poll_, UV_WRITABLE, on_writable);
      }
      return;
    }
    // EPIPE and the like: the reader is gone; what is pending can never be delivered.
    pending_.clear();
    eof_ = true;
  }
  if (polling_) {
    polling_ = false;
    uv_poll_stop(poll_);
  }
  if (eof_ && fd_) {
    uv_poll_stop(poll_);
    fd_.reset();
  }
}

void InputWriter::on_writable(uv_poll_t* p, int, int) noexcept {
  auto* self = static_cast<InputWriter*>(p->data);
  if (self) self->flush();
}

ProcIo::~ProcIo() {
  if (timer_) {
    timer_->data = nullptr;
    uv_close(reinterpret_cast<uv_handle_t*>(timer_), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  }
}

void ProcIo::after(uint64_t ms, std::function<void()> fn) {
  fn_ = std::move(fn);
  if (!timer_) {
    timer_ = new uv_timer_t;
    uv_timer_init(loop_, timer_);
    timer_->data = this;
  }
  uv_timer_start(
      timer_,
      [](uv_timer_t* t) {
        auto* self = static_cast<ProcIo*>(t->data);
        if (self && self->fn_) self->fn_();
      },
      ms, 0);
}

}  // namespace sbx::supervisor
