// sandboxer log STATE_DIR|URL [--since N] [--json] [--follow]
// A box's journal from seq N: read from its state directory, or replayed over the API from a
// ws[s]:// URL (subscribe from N, up to the last seq the box had written when asked, or on
// with --follow), printed the same way, so a remote box reads like a local one.
#include <unistd.h>

#include <iostream>
#include <stdexcept>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"
#include "journal/journal.hpp"

namespace sbx::cli {

namespace {

constexpr const char* kUsage = "usage: sandboxer log STATE_DIR|URL [--since N] [--json] [--follow] [--token-file F]";

bool is_url(const std::string& s) { return s.rfind("ws://", 0) == 0 || s.rfind("wss://", 0) == 0; }

int log_remote(const Args& a, uint64_t since, bool json) {
  Session s("log", a.positionals()[0], a);
  bool follow = a.has("--follow");
  uint64_t until = 0;
  if (!follow) {
    // The end of the replay is the last seq the box had journaled when we asked; what comes
    // later belongs to --follow.
    auto st = s.call(boost::json::object{{"op", "stats"}});
    if (!st) return s.fail(st.error());
    const auto* last = st->if_contains("last_seq");
    if (!last || !last->is_int64()) return s.fail(base::Error("stats reply without last_seq", "bad_reply"));
    until = static_cast<uint64_t>(last->as_int64());
    if (since >= until) return kExitOk;
  }
  EventPrinter printer(json);
  int rc = kExitOk;
  sdk::Subscription sub(
      s.loop(), s.endpoint(), since, std::nullopt,
      [&](const boost::json::object& ev, std::string_view line) {
        printer.print(line, ev);
        const auto* seq = ev.if_contains("seq");
        if (!follow && seq && seq->is_int64() && static_cast<uint64_t>(seq->as_int64()) >= until) s.stop();
      },
      [&](int code, const std::string& reason) { rc = s.stream_closed(code, reason); });
  s.run();
  return rc;
}

}  // namespace

int cmd_log(const std::vector<std::string>& args) {
  auto a = parse_args(
      args,
      remote_spec({.usage = kUsage, .flags = {"--json", "--follow"}, .options = {"--since"}, .max_positionals = 1}));
  a.expect_positionals(1);
  const std::string& dir = a.positionals()[0];
  auto since = a.number<uint64_t>("--since", 0);
  bool json = a.has("--json");
  if (is_url(dir)) return log_remote(a, since, json);
  if (a.has("--follow")) a.fail("--follow needs a URL (a running box)");
  std::string jdir = dir + "/journal";
  if (::access(jdir.c_str(), F_OK) != 0) {
    if (::access(dir.c_str(), F_OK) != 0) throw std::runtime_error(dir + ": no such directory");
    jdir = dir;  // given the journal directory itself
    if (!journal::Journal::holds_journal(jdir))
      throw std::runtime_error(dir + ": not a box's state dir nor its journal (no journal/, no seq.hwm or segments)");
  }
  EventPrinter printer(json);
  auto r = journal::Journal::read(jdir, since, [&](uint64_t, std::string_view line) {
    boost::system::error_code ec;
    auto v = boost::json::parse(line, ec);
    if (!ec && v.is_object()) printer.print(line, v.as_object());
    return true;
  });
  if (!r) throw std::runtime_error("read journal " + jdir + ": " + r.error().message());
  return 0;
}

}  // namespace sbx::cli
