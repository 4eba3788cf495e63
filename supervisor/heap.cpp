#include "supervisor/heap.hpp"

#include <malloc.h>

namespace sbx::supervisor {

namespace {
constexpr uint64_t kQuietMs = 1000;
}

void tune_heap() noexcept {
  // Setting either ends glibc's own adjustment of both (which follows the largest chunk freed).
  ::mallopt(M_MMAP_THRESHOLD, 4 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 32 << 20);
}

void HeapTrimmer::note() {
  if (!timer_) {
    timer_ = loop::make_timer(loop_);
    timer_->data = this;
  }
  if (uv_is_active(reinterpret_cast<uv_handle_t*>(timer_.get()))) {
    busy_ = true;
    return;
  }
  busy_ = false;
  uv_timer_start(timer_.get(), on_timer, kQuietMs, 0);
}

void HeapTrimmer::on_timer(uv_timer_t* t) noexcept {
  auto* self = static_cast<HeapTrimmer*>(t->data);
  if (self->busy_) {
    self->busy_ = false;
    uv_timer_start(t, on_timer, kQuietMs, 0);
    return;
  }
  ::malloc_trim(0);
}

}  // namespace sbx::supervisor
