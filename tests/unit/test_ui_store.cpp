// ui::Store: the page server's events, their lines spooled to an unnamed file and an index of 32
// bytes an event in memory; a spool that cannot be made or written keeps the lines in memory.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/resource.h>

#include <string>
#include <vector>

#include "temp-dir.hpp"
#include "ui/store.hpp"

using sbx::ui::Filter;
using sbx::ui::Store;

namespace {

// An event of about `pad` bytes.
std::string event(uint64_t seq, const std::string& type, const std::string& branch, const std::string& proc,
                  size_t pad = 0) {
  std::string line = "{\"seq\":" + std::to_string(seq) + ",\"type\":\"" + type + "\",\"branch\":\"" + branch + "\"";
  if (!proc.empty()) line += ",\"proc\":\"" + proc + "\"";
  return line + ",\"data\":\"" + std::string(pad, 'a' + static_cast<char>(seq % 26)) + "\"}";
}

std::vector<std::string> fill(Store& s, uint64_t n, size_t pad) {
  std::vector<std::string> lines;
  for (uint64_t seq = 1; seq <= n; ++seq) {
    lines.push_back(event(seq, seq % 10 == 0 ? "metrics" : "proc.output", seq % 2 ? "main" : "f1",
                          seq % 10 == 0 ? "" : "p" + std::to_string(seq % 3), pad));
    REQUIRE(s.append(lines.back()));
  }
  return lines;
}

}  // namespace

TEST_CASE("ui store: the lines go to the spool and come back; memory holds the index and the last ones") {
  sbx::test::TempDir dir("ui-store");
  std::vector<std::string> warned;
  Store s(dir.path.string(), [&](const std::string& m) { warned.push_back(m); });
  auto lines = fill(s, 20000, 1000);  // ~20 MB
  CHECK(warned.empty());
  CHECK(s.size() == 20000);
  CHECK(s.spooled_bytes() > 19'000'000);
  CHECK(s.memory_bytes() < 300'000);
  // Unnamed: nothing in the directory.
  CHECK(std::filesystem::is_empty(dir.path));
  for (size_t i : {size_t(0), size_t(1), size_t(7777), size_t(19998), size_t(19999)}) {
    CHECK(s.line(i) == lines[i]);
    CHECK(s.seq(i) == i + 1);
  }
  CHECK(s.type(9) == "metrics");
  CHECK(s.branch(9) == "f1");
  CHECK(s.proc(9).empty());
  CHECK(s.proc(0) == "p1");
  CHECK(s.first_after(0) == 0);
  CHECK(s.first_after(19999) == 19999);
  CHECK(s.first_after(20000) == 20000);
  // A line seen again after a resume, and what is not an event, are not kept.
  CHECK_FALSE(s.append(event(20000, "proc.output", "main", "p1")));
  CHECK_FALSE(s.append("[1,2]"));
  CHECK_FALSE(s.append("{\"seq\":0}"));
  CHECK_FALSE(s.append("not json"));
  CHECK(s.size() == 20000);
  auto m = s.matching(Filter{.branch = "f1", .types = {"metrics"}});
  CHECK(m.size() == 2000);
  CHECK(s.line(m.front()) == lines[9]);
  CHECK(s.matching(Filter{.proc = "p2"}).size() == 6000);
  CHECK_FALSE(s.ended());
  CHECK(s.append(event(20001, "box.exited", "main", "")));
  CHECK(s.ended());
}

TEST_CASE("ui store: without a spool dir, or one that cannot be made, the lines stay in memory and say why") {
  Store mem;
  auto lines = fill(mem, 500, 1000);
  CHECK(mem.spooled_bytes() == 0);
  CHECK(mem.memory_bytes() > 500'000);
  CHECK(mem.line(123) == lines[123]);

  std::vector<std::string> warned;
  Store gone("/nonexistent/sbx-spool", [&](const std::string& m) { warned.push_back(m); });
  lines = fill(gone, 500, 1000);
  REQUIRE(warned.size() == 1);
  CHECK(warned[0] ==
        "the events' spool in /nonexistent/sbx-spool: No such file or directory; the events are kept in memory");
  CHECK(gone.line(499) == lines[499]);
  CHECK(gone.spooled_bytes() == 0);
}

TEST_CASE("ui store: a spool that cannot be written (a full disk) keeps the lines in memory until it can") {
  // RLIMIT_FSIZE stands in for a full disk: a write past it fails (EFBIG, SIGXFSZ ignored).
  sbx::test::TempDir dir("ui-store-full");
  std::vector<std::string> warned;
  Store s(dir.path.string(), [&](const std::string& m) { warned.push_back(m); });
  struct rlimit old {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  auto* was = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 1 << 20;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  auto lines = fill(s, 3000, 1000);  // ~3 MB: past the limit
  ::setrlimit(RLIMIT_FSIZE, &old);
  REQUIRE(warned.size() == 1);
  CHECK(warned[0].starts_with("write the events' spool in " + dir.path.string() + ": File too large"));
  CHECK(s.spooled_bytes() <= (1u << 20));
  CHECK(s.memory_bytes() > 1'900'000);
  // Every line is there, whether in the file, in memory, or one that straddles the two.
  for (size_t i = 0; i < lines.size(); ++i) REQUIRE(s.line(i) == lines[i]);
  // Once the spool can be written again, it is, at the next retry (every 4 MiB).
  for (uint64_t seq = 3001; seq <= 8000; ++seq) REQUIRE(s.append(event(seq, "proc.output", "main", "p", 1000)));
  ::signal(SIGXFSZ, was);
  REQUIRE(warned.size() == 2);
  CHECK(warned[1] == "the events' spool in " + dir.path.string() + " is written again");
  CHECK(s.memory_bytes() < 300'000);
  CHECK(s.line(2999) == lines[2999]);
}
