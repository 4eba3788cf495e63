#include <doctest/doctest.h>
#include <unistd.h>

#include "loop/finish.hpp"
#include "loop/uv-handle.hpp"
#include "os/unique-fd.hpp"

using sbx::loop::UvHandle;

namespace {
// A loop that, once the owners are gone, lets the close callbacks run and checks that nothing
// is left open (uv_loop_close refuses a loop that still has handles).
struct LoopFixture {
  uv_loop_t loop;
  LoopFixture() { uv_loop_init(&loop); }
  ~LoopFixture() {
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK(uv_loop_close(&loop) == 0);
  }
  // Handles on the loop that are not closing.
  int open_handles() {
    int n = 0;
    uv_walk(
        &loop, [](uv_handle_t* h, void* arg) { *static_cast<int*>(arg) += !uv_is_closing(h); }, &n);
    return n;
  }
};
}  // namespace

TEST_CASE_FIXTURE(LoopFixture, "uv handle: the owner closes and frees its handle") {
  SUBCASE("an active timer") {
    auto t = sbx::loop::make_timer(&loop);
    uv_timer_start(
        t.get(), [](uv_timer_t*) { FAIL("a closed timer fired"); }, 10, 10);
    CHECK(open_handles() == 1);
  }
  SUBCASE("a poll on a pipe") {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    sbx::os::UniqueFd r(fds[0]), w(fds[1]);
    auto p = UvHandle<uv_poll_t>::make(&loop, uv_poll_init, r.get());
    REQUIRE(p.has_value());
    uv_poll_start(p->get(), UV_READABLE, [](uv_poll_t*, int, int) {});
    CHECK(open_handles() == 1);
  }
  SUBCASE("an async") {
    auto a = UvHandle<uv_async_t>::make(&loop, uv_async_init, [](uv_async_t*) {});
    REQUIRE(a.has_value());
    CHECK(open_handles() == 1);
  }
  CHECK(open_handles() == 0);
}

TEST_CASE_FIXTURE(LoopFixture, "uv handle: a moved-from owner closes nothing") {
  auto a = sbx::loop::make_timer(&loop);
  uv_timer_t* raw = a.get();
  UvHandle<uv_timer_t> b;
  {
    UvHandle<uv_timer_t> moved(std::move(a));
    CHECK_FALSE(a);
    a.reset();  // empty: nothing to close
    CHECK(open_handles() == 1);
    b = std::move(moved);
  }
  // `moved` is gone and the handle is still open, now in `b`.
  CHECK(b.get() == raw);
  CHECK(open_handles() == 1);
  b = sbx::loop::make_timer(&loop);  // assigning closes the handle it held
  CHECK(open_handles() == 1);
  b.reset();
  CHECK(open_handles() == 0);
}

TEST_CASE_FIXTURE(LoopFixture, "uv handle: an init that fails leaves nothing open") {
  auto p = UvHandle<uv_poll_t>::make(&loop, uv_poll_init, -1);
  CHECK_FALSE(p.has_value());
  CHECK(p.error().message.starts_with("set up a libuv handle: "));
  CHECK(open_handles() == 0);
}

TEST_CASE("uv loop: finish frees what the owners closed, and closes and names what they did not") {
  uv_loop_t loop;
  uv_loop_init(&loop);
  SUBCASE("closed by its owner: the loop closes") {
    { auto t = sbx::loop::make_timer(&loop); }
    CHECK(sbx::loop::finish(&loop).has_value());
  }
  SUBCASE("work on the thread pool comes back first") {
    static bool after_ran;
    after_ran = false;
    uv_work_t req;
    uv_queue_work(
        &loop, &req, [](uv_work_t*) { ::usleep(50000); }, [](uv_work_t*, int) { after_ran = true; });
    CHECK(sbx::loop::finish(&loop).has_value());
    CHECK(after_ran);
  }
  SUBCASE("an active timer left open by its owner: closed without firing, named") {
    static uv_timer_t raw;  // what a forgotten owner leaves behind
    uv_timer_init(&loop, &raw);
    uv_timer_start(
        &raw, [](uv_timer_t*) { FAIL("a timer left open fired after the end"); }, 0, 0);
    auto r = sbx::loop::finish(&loop);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().message == "libuv handles left open at the end, closed now: timer");
  }
}
