#pragma once
// The end of an event loop, for whoever ran it last once every owner of a handle is gone (the
// supervisor's main): what the owners closed is freed, and the thread pool's work comes back,
// in the loop's last turns (uv-handle.hpp).
#include <unistd.h>
#include <uv.h>

#include <string>

#include "base/result.hpp"

namespace sbx::loop {

/// Turns `loop` until nothing in it is alive, for at most `wait_ms` (work running on the thread
/// pool cannot be stopped), then closes it. A handle still open at the start (an owner that never
/// closed it) is closed first, so that no callback of it runs, and named in the error.
inline base::Result<void> finish(uv_loop_t* loop, int wait_ms = 2000) {
  std::string left_open;
  uv_walk(
      loop,
      [](uv_handle_t* h, void* arg) {
        if (uv_is_closing(h)) return;
        auto& names = *static_cast<std::string*>(arg);
        names += (names.empty() ? "" : ", ") + std::string(uv_handle_type_name(h->type));
        uv_close(h, nullptr);
      },
      &left_open);
  for (int waited = 0; waited < wait_ms; ++waited) {
    uv_run(loop, UV_RUN_NOWAIT);
    if (!uv_loop_alive(loop)) break;
    ::usleep(1000);
  }
  int rc = uv_loop_close(loop);
  if (!left_open.empty()) return base::fail("libuv handles left open at the end, closed now: " + left_open);
  if (rc != 0)
    return base::fail(std::string("close the event loop: ") + uv_strerror(rc) +
                      " (work on the thread pool still running after " + std::to_string(wait_ms) + " ms)");
  return {};
}

}  // namespace sbx::loop
