#pragma once
// A move-only owner for one libuv handle, as os::UniqueFd owns an fd: the handle lives on the
// heap because libuv may still touch it after its owner is gone. The owner's destructor stops the
// handle and calls uv_close; the close callback, run by the loop on its next turn, frees it. So
// whoever runs the loop last (the supervisor's main, a test's fixture) must let it turn once
// more after the owners go, or uv_loop_close reports the handles still open (finish.hpp).
#include <uv.h>

#include <string>
#include <type_traits>
#include <utility>

#include "base/result.hpp"

namespace sbx::loop {

template <class T>
class UvHandle {
 public:
  UvHandle() noexcept = default;
  ~UvHandle() { reset(); }
  UvHandle(UvHandle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  UvHandle& operator=(UvHandle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  UvHandle(const UvHandle&) = delete;
  UvHandle& operator=(const UvHandle&) = delete;

  /// A new handle on `loop`, set up by `init` (uv_timer_init, uv_poll_init, uv_pipe_init,
  /// uv_async_init, ...) with `args` after the loop and the handle. An init that fails leaves
  /// nothing to close: the memory is freed at once and the error names libuv's reason.
  template <class... P, class... A>
  static base::Result<UvHandle> make(uv_loop_t* loop, int (*init)(uv_loop_t*, T*, P...), A&&... args) {
    T* h = new T{};
    if (int rc = init(loop, h, std::forward<A>(args)...); rc != 0) {
      delete h;
      return base::fail(std::string("set up a libuv handle: ") + uv_strerror(rc));
    }
    UvHandle out;
    out.h_ = h;
    return out;
  }

  T* get() const noexcept { return h_; }
  T* operator->() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }
  uv_handle_t* handle() const noexcept { return reinterpret_cast<uv_handle_t*>(h_); }
  /// For the uv_read_start and uv_write family.
  uv_stream_t* stream() const noexcept { return reinterpret_cast<uv_stream_t*>(h_); }

  /// Stops the handle and closes it; no callback of it runs after this, and the loop frees it.
  /// The owner alone closes its handle: a uv_close by hand would close it twice.
  void reset() noexcept {
    T* h = std::exchange(h_, nullptr);
    if (!h) return;
    h->data = nullptr;
    if constexpr (std::is_same_v<T, uv_timer_t>) {
      uv_timer_stop(h);
    } else if constexpr (std::is_same_v<T, uv_poll_t>) {
      uv_poll_stop(h);
    } else if constexpr (std::is_same_v<T, uv_pipe_t> || std::is_same_v<T, uv_tcp_t> || std::is_same_v<T, uv_tty_t>) {
      uv_read_stop(reinterpret_cast<uv_stream_t*>(h));
    }
    uv_close(reinterpret_cast<uv_handle_t*>(h), [](uv_handle_t* x) { delete reinterpret_cast<T*>(x); });
  }

 private:
  T* h_ = nullptr;
};

/// A timer on `loop` (uv_timer_init cannot fail).
inline UvHandle<uv_timer_t> make_timer(uv_loop_t* loop) {
  auto t = UvHandle<uv_timer_t>::make(loop, uv_timer_init);
  return std::move(t.value());
}

}  // namespace sbx::loop
