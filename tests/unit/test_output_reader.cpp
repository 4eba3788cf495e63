// OutputReader on a pty's master: everything the terminal's side wrote before it closed is read,
// however little one read() returns. A master read gives at most the line discipline's buffer
// (4 KiB) while the rest waits in the tty's flip buffers; libuv ends a stream at POLLHUP after a
// read shorter than its buffer without reading again, which for a pty dropped the rest (an
// exec's last lines, when the process wrote them and exited between two reads).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <stdlib.h>
#include <termios.h>
#include <unistd.h>
#include <uv.h>

#include <string>

#include "supervisor/output.hpp"

using namespace sbx;

namespace {

struct Pty {
  int master = -1, slave = -1;
  Pty() {
    master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    REQUIRE(master >= 0);
    REQUIRE(::grantpt(master) == 0);
    REQUIRE(::unlockpt(master) == 0);
    slave = ::open(::ptsname(master), O_RDWR | O_NOCTTY | O_CLOEXEC);
    REQUIRE(slave >= 0);
    struct termios t {};
    REQUIRE(::tcgetattr(slave, &t) == 0);
    ::cfmakeraw(&t);  // bytes as written: no \n -> \r\n
    REQUIRE(::tcsetattr(slave, TCSANOW, &t) == 0);
  }
};

// What the reader emits for `written` bytes the terminal's side wrote, then closed, before the
// loop first ran.
std::string read_all_of(size_t written) {
  Pty pty;
  std::string pattern;
  for (size_t i = 0; pattern.size() < written; ++i) pattern += "line " + std::to_string(i) + "\n";
  pattern.resize(written);
  // As much as the pty takes before someone reads (its buffers hold a few KiB): not blocking.
  REQUIRE(::fcntl(pty.slave, F_SETFL, O_NONBLOCK) == 0);
  size_t put = 0;
  while (put < pattern.size()) {
    ssize_t n = ::write(pty.slave, pattern.data() + put, pattern.size() - put);
    if (n <= 0) break;
    put += static_cast<size_t>(n);
  }
  pattern.resize(put);
  ::close(pty.slave);

  uv_loop_t loop;
  REQUIRE(uv_loop_init(&loop) == 0);
  std::string got;
  bool eof = false;
  {
    supervisor::OutputReader r(&loop, os::UniqueFd(pty.master),
                               supervisor::OutputDecoder("pty", false,
                                                         [&](boost::json::object e) {
                                                           if (auto* d = e.if_contains("data"))
                                                             got += std::string(d->as_string());
                                                         }),
                               [&] { eof = true; });
    while (!eof && uv_run(&loop, UV_RUN_ONCE) != 0) {
    }
  }
  uv_run(&loop, UV_RUN_DEFAULT);  // the reader's handle closes
  CHECK(uv_loop_close(&loop) == 0);
  CHECK(eof);
  CHECK(got == pattern);
  return got;
}

}  // namespace

TEST_CASE("OutputReader: a pty's output written before its terminal closed is read whole") {
  SUBCASE("less than one read") { CHECK(read_all_of(100).size() == 100); }
  // More than one read of a master returns (the line discipline's 4 KiB).
  SUBCASE("several reads' worth") { CHECK(read_all_of(64 * 1024).size() > 8192); }
}
