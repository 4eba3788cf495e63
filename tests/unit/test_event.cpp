#include <doctest/doctest.h>

#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "base/encoding.hpp"
#include "os/sys.hpp"
#include "supervisor/output.hpp"

namespace base = sbx::base;
namespace supervisor = sbx::supervisor;

using namespace sbx::base;

TEST_CASE("utf8: valid prefix stops at the first bad byte") {
  CHECK(base::utf8_valid_prefix("hello") == 5);
  CHECK(base::utf8_valid_prefix("h\xc3\xa9llo") == 6);
  CHECK(base::utf8_valid_prefix("ab\xff") == 2);
  CHECK(base::utf8_valid_prefix("\xc0\xaf") == 0);          // overlong
  CHECK(base::utf8_valid_prefix("\xed\xa0\x80") == 0);      // surrogate
  CHECK(base::utf8_valid_prefix("\xf4\x90\x80\x80") == 0);  // above U+10FFFF
  CHECK(base::utf8_valid_prefix("\xf0\x9f\x98\x80") == 4);
  // ASCII runs are taken 64 and 8 bytes at once: a bad byte at every place of, and after, such
  // runs, and a truncated sequence at the end.
  std::string run(200, 'a');
  for (size_t at = 0; at < run.size(); ++at) {
    std::string s = run;
    s[at] = '\xff';
    CHECK(base::utf8_valid_prefix(s) == at);
    s[at] = '\xc3';
    s.insert(at + 1, "\xa9");
    CHECK(base::utf8_valid_prefix(s) == s.size());
    CHECK(base::utf8_valid_prefix(run.substr(0, at) + "\xe2\x82") == at);
  }
}

TEST_CASE("utf8: an incomplete tail is recognised, an invalid one is not") {
  CHECK(base::utf8_incomplete_tail("ab\xf0\x9f") == 2);
  CHECK(base::utf8_incomplete_tail("ab\xe2") == 1);
  CHECK(base::utf8_incomplete_tail("ab") == 0);
  CHECK(base::utf8_incomplete_tail("ab\xf0\x28") == 0);
}

TEST_CASE("utf8: lossy text replaces each bad byte with U+FFFD and keeps the rest") {
  CHECK(base::utf8_lossy("plain") == "plain");
  CHECK(base::utf8_lossy("h\xc3\xa9") == "h\xc3\xa9");
  CHECK(base::utf8_lossy("bad\xffname") == "bad\xef\xbf\xbdname");
  CHECK(base::utf8_lossy("\xff\xfe") == "\xef\xbf\xbd\xef\xbf\xbd");
  CHECK(base::utf8_lossy("ab\xe2\x82") == "ab\xef\xbf\xbd\xef\xbf\xbd");  // a sequence cut short
  CHECK(base::utf8_lossy("") == "");
  // Whatever the bytes, the result is UTF-8.
  std::string all;
  for (int c = 1; c < 256; ++c) all += static_cast<char>(c);
  auto text = base::utf8_lossy(all);
  CHECK(base::utf8_valid_prefix(text) == text.size());
}

TEST_CASE("json_append writes what boost::json::serialize writes, escapes anywhere in a string") {
  // Of a string that is UTF-8, what boost writes; of one that is not, what boost writes of its
  // utf8_lossy text (U+FFFD for each byte that stops it); C1 controls as \u escapes.
  auto same = [](const boost::json::value& v) {
    std::string out = "prefix";
    base::json_append(out, v);
    CHECK(out == "prefix" + base::json_escape_c1(boost::json::serialize(
                                v.is_string() ? boost::json::value(base::utf8_lossy(v.get_string())) : v)));
  };
  // Every C1 control, and the two-byte characters beside them, at every offset of a long run.
  for (int cp = 0x80; cp < 0x100; ++cp)
    for (size_t at : {0, 1, 15, 16, 17, 39}) {
      std::string s(41, 'x');
      s.replace(at, 2, {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))});
      same(boost::json::value(s));
    }
  // Every byte value, alone and at every offset of a run longer than a vector block: the byte
  // after an escape is where boost's serializer and a block scan could disagree.
  for (int b = 0; b < 256; ++b) {
    same(boost::json::value(std::string(1, static_cast<char>(b))));
    for (size_t at : {0, 1, 15, 16, 17, 31, 40}) {
      std::string s(41, 'x');
      s[at] = static_cast<char>(b);
      same(boost::json::value(s));
    }
  }
  std::string lines;
  for (int i = 0; i < 100; ++i) lines += std::string(static_cast<size_t>(i), 'y') + "\n\t\"\\\x01\x7f\xc3\xa9";
  same(boost::json::value(lines));
  same(boost::json::value(""));
  same(boost::json::parse(R"({"seq":18446744073709551615,"n":-9223372036854775807,"d":0.1,"e":1E300,"z":-0.0,)"
                          R"("t":true,"f":false,"x":null,"a":[1,[2,{"k\n":"v\u0000"}],[],{}],"o":{}})"));
  boost::json::object ev{{"type", "proc.output"}, {"data", lines}, {"ts", "2026-11-26T06:00:00.000001Z"}};
  std::string out;
  base::json_append(out, ev);
  CHECK(out == boost::json::serialize(ev));
}

TEST_CASE("json_append writes C1 controls as escapes; boost writes them raw (the control)") {
  // U+009B is ESC [ to a terminal that takes C1 controls: an agent's output line with it, shown
  // by `cat` of the journal or by `--events -`, could move the cursor or retitle the window.
  boost::json::object ev{{"data",
                          "caf\xc3\xa9 \xc2\x9b"
                          "31m red \xc2\x85\xc2\xa0\n"}};
  std::string ours = base::json_text(ev);
  CHECK(ours == "{\"data\":\"caf\xc3\xa9 \\u009b31m red \\u0085\xc2\xa0\\n\"}");
  CHECK(ours.find('\xC2') == ours.find("\xc2\xa0"));  // U+00A0 (no control) stays as it is
  CHECK(boost::json::parse(ours) == boost::json::value(ev));
  CHECK(boost::json::serialize(ev).find("\xc2\x9b") != std::string::npos);
  CHECK(base::json_escape_c1(boost::json::serialize(ev)) == ours);
  CHECK(base::json_escape_c1("\xc2") == "\xc2");  // cut short: as it is
}

TEST_CASE("json_append's text is UTF-8 whatever bytes its strings hold; boost's is not (the control)") {
  std::string name = "fs/tmp/caf\xe9/\xff\xfe\n\xe2\x82";  // Latin-1, stray bytes, a cut-short sequence
  boost::json::object reply{{"ok", false}, {"error", {{"message", "write " + name + ": no"}}}, {"k", "\xc3\xa9"}};
  std::string ours = base::json_text(reply);
  CHECK(base::utf8_valid_prefix(ours) == ours.size());
  boost::system::error_code ec;
  auto back = boost::json::parse(ours, ec);
  REQUIRE(!ec);
  CHECK(back.at("error").at("message").as_string() ==
        "write fs/tmp/caf\xEF\xBF\xBD/\xEF\xBF\xBD\xEF\xBF\xBD\n"
        "\xEF\xBF\xBD\xEF\xBF\xBD: no");
  CHECK(back.at("k").as_string() == "\xc3\xa9");  // valid text kept as it is
  std::string theirs = boost::json::serialize(reply);
  CHECK(base::utf8_valid_prefix(theirs) < theirs.size());
  boost::json::parse(theirs, ec);
  CHECK(ec);  // a strict parser, as every client's, refuses it
}

TEST_CASE("base64: round trip of every byte value") {
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  for (size_t n = 0; n < 6; ++n) {
    std::string in = all.substr(0, 250 + n), out;
    REQUIRE(base::base64_decode(base::base64_encode(in), out));
    CHECK(out == in);
  }
  std::string out;
  CHECK_FALSE(base::base64_decode("ab$d", out));
}

TEST_CASE("output: a character split across reads is joined, bad bytes go as base64") {
  std::vector<boost::json::object> evs;
  supervisor::OutputDecoder d("stdout", true, [&](boost::json::object e) { evs.push_back(std::move(e)); });
  d.feed("smile \xf0\x9f");
  d.feed("\x98\x80!\n");
  d.feed("\xff\n");
  d.finish();
  REQUIRE(evs.size() == 3);
  CHECK(evs[0].at("data") == "smile ");
  CHECK(evs[1].at("data") == "\xf0\x9f\x98\x80!\n");
  CHECK(evs[2].at("data_b64") == "/wo=");
}

TEST_CASE("output: JSON-object lines become messages, other lines do not") {
  std::vector<boost::json::object> msgs;
  supervisor::OutputDecoder d("stdout", true, [&](boost::json::object e) {
    if (e.at("type") == "proc.message") msgs.push_back(std::move(e));
  });
  SUBCASE("split across reads") {
    d.feed("{\"a\":");
    d.feed("1}\r\nplain\n[1]\n{bad\n");
    d.feed("{\"b\":2}");
    d.finish();
    REQUIRE(msgs.size() == 2);
    CHECK(msgs[0].at("message").at("a") == 1);
    CHECK(msgs[1].at("message").at("b") == 2);
  }
  SUBCASE("a line over 64 KiB is not a message") {
    std::string big = "{\"x\":\"" + std::string(sbx::supervisor::kMaxMessageLine, 'y') + "\"}\n";
    d.feed(big);
    d.feed("{\"ok\":true}\n");
    REQUIRE(msgs.size() == 1);
    CHECK(msgs[0].at("message").at("ok") == true);
  }
}

TEST_CASE("events: timestamps are RFC 3339 with microseconds") {
  auto ts = base::rfc3339_now();
  CHECK(ts.size() == 27);
  CHECK(ts[10] == 'T');
  CHECK(ts.back() == 'Z');
}

TEST_CASE("rfc3339: the civil date by arithmetic is gmtime_r's, every day from 1970 to 2200") {
  auto by_gmtime = [](int64_t sec, long nsec) {
    time_t t = static_cast<time_t>(sec);
    struct tm tm {};
    ::gmtime_r(&t, &tm);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                  tm.tm_hour, tm.tm_min, tm.tm_sec, nsec / 1000);
    return std::string(buf);
  };
  int wrong = 0;
  // Each day at a time of day that moves through the hours, minutes and seconds; leap days and
  // century years (2100: not a leap year) among them.
  for (int64_t day = 0; day < 84000; ++day) {
    int64_t sec = day * 86400 + (day * 7919) % 86400;
    long nsec = static_cast<long>((day * 104729) % 1000000000);
    if (base::rfc3339(sec, nsec) != by_gmtime(sec, nsec)) ++wrong;
  }
  CHECK(wrong == 0);
  CHECK(base::rfc3339(0, 0) == "1970-01-01T00:00:00.000000Z");
  CHECK(base::rfc3339(951782400 + 86399, 999999999) == "2000-02-29T23:59:59.999999Z");
  CHECK(base::rfc3339(4107542400, 1000) == "2100-03-01T00:00:00.000001Z");
}

TEST_CASE("write_line: the line and its newline, whole, into a pipe smaller than the line (--events -)") {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  std::string got;
  std::thread reader([&] {
    char buf[4096];  // a line larger than the pipe: the writer waits for these reads
    for (ssize_t n; (n = ::read(p[0], buf, sizeof buf)) > 0;) got.append(buf, static_cast<size_t>(n));
  });
  std::string big(3 << 20, 'e');
  CHECK(sbx::os::write_line(p[1], big));
  CHECK(sbx::os::write_line(p[1], ""));
  CHECK(sbx::os::write_line(p[1], "{\"seq\":2}"));
  ::close(p[1]);
  reader.join();
  ::close(p[0]);
  CHECK(got == big + "\n\n{\"seq\":2}\n");
}
