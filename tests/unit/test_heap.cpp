// supervisor/heap.hpp: with the event path's thresholds, freed buffers stay in the heap (glibc does
// not give them back by itself below 32 MiB); HeapTrimmer gives them back a second after the last
// event. Not under AddressSanitizer, whose allocator ignores mallopt and malloc_trim.
#include <doctest/doctest.h>
#include <malloc.h>
#include <uv.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "supervisor/heap.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SBX_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SBX_TEST_ASAN 1
#endif

#ifndef SBX_TEST_ASAN
namespace {

long rss_anon_kib() {
  std::ifstream f("/proc/self/status");
  for (std::string l; std::getline(f, l);)
    if (l.starts_with("RssAnon:")) return std::stol(l.substr(8));
  return -1;
}

// A burst's buffers: 160 of 128 KiB (20 MiB), written, then freed.
void burst() {
  std::vector<char*> bufs;
  for (int i = 0; i < 160; ++i) {
    bufs.push_back(static_cast<char*>(::malloc(128 << 10)));
    std::memset(bufs.back(), 'x', 128 << 10);
  }
  for (auto* b : bufs) ::free(b);
}

// Runs `loop` for `ms`.
void run_for(uv_loop_t* loop, uint64_t ms) {
  uv_timer_t stop;
  uv_timer_init(loop, &stop);
  uv_timer_start(
      &stop, [](uv_timer_t* t) { uv_stop(t->loop); }, ms, 0);
  uv_run(loop, UV_RUN_DEFAULT);
  uv_close(reinterpret_cast<uv_handle_t*>(&stop), nullptr);
  uv_run(loop, UV_RUN_NOWAIT);
}

}  // namespace
#endif

TEST_CASE("heap: a burst's freed buffers stay in the heap, and the trimmer gives them back once events stop") {
#ifdef SBX_TEST_ASAN
  MESSAGE("skipped: AddressSanitizer's allocator ignores mallopt and malloc_trim");
#else
  sbx::supervisor::tune_heap();
  uv_loop_t loop;
  uv_loop_init(&loop);
  {
    // The control: no event noted, nothing given back. (What the tests before this one left free
    // is given back first.)
    ::malloc_trim(0);
    long before = rss_anon_kib();
    burst();
    run_for(&loop, 1300);
    long kept = rss_anon_kib();
    CHECK(kept - before > 16 << 10);

    sbx::supervisor::HeapTrimmer trimmer(&loop);
    burst();
    uv_update_time(&loop);
    trimmer.note();
    run_for(&loop, 500);  // events still coming: nothing yet
    trimmer.note();
    CHECK(rss_anon_kib() - before > 16 << 10);
    run_for(&loop, 1700);  // a second and more after the last one
    CHECK(rss_anon_kib() - before < 4 << 10);
    trimmer.reset();
  }
  uv_run(&loop, UV_RUN_NOWAIT);
  CHECK(uv_loop_close(&loop) == 0);
#endif
}
