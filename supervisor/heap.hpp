#pragma once
// The supervisor's heap on the event path. Each event is serialized into a buffer of its own (up
// to ~130 KiB for a read of agent output), shared by the journal and every client it is queued
// for. With glibc's default thresholds those buffers came from mmap, or from a heap top trimmed
// as soon as it was free: every event faulted its pages in again, zeroed (bench/ws, one client:
// ~510 MiB/s, a tenth of the supervisor's time in page faults and unmaps). Held in the heap, the
// freed buffers are reused (~640 MiB/s), and what a burst leaves free goes back to the kernel a
// second after the events stop.
#include <uv.h>

#include "loop/uv-handle.hpp"

namespace sbx::supervisor {

/// glibc malloc's thresholds for the event path: allocations under 4 MiB from the heap, and up to
/// 32 MiB free at its top kept. Called once, before any thread.
void tune_heap() noexcept;

/// Returns the heap's free memory to the kernel (malloc_trim) once no event has been emitted for
/// a second after some were: an idle box has no timer running, a busy one is not slowed.
class HeapTrimmer {
 public:
  explicit HeapTrimmer(uv_loop_t* loop) : loop_(loop) {}
  /// An event was emitted.
  void note();
  void reset() { timer_.reset(); }

 private:
  static void on_timer(uv_timer_t* t) noexcept;
  uv_loop_t* loop_;
  loop::UvHandle<uv_timer_t> timer_;
  bool busy_ = false;  // an event came since the timer was started
};

}  // namespace sbx::supervisor
