// sandboxer log STATE_DIR|URL [--since N] [--json] [--follow]
// A box's journal from seq N: read from its state directory, or replayed over the API from a
// ws[s]:// URL (subscribe from N, up to the last seq the box had written when asked, or on
// with --follow; a state dir is followed while a box runs on it), printed the same way, so a
// remote box reads like a local one.
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <set>
#include <stdexcept>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"
#include "journal/journal.hpp"
#include "os/sys.hpp"

namespace sbx::cli {

namespace {

constexpr const char* kUsage = "usage: sandboxer log STATE_DIR|URL [--since N] [--json] [--follow] [--token-file F]";

bool is_url(const std::string& s) { return s.rfind("ws://", 0) == 0 || s.rfind("wss://", 0) == 0; }

// A segment of the journal that could not be read: said on stderr, where the events after it
// are printed on; the exit status says so at the end.
void report_unreadable(const std::string& where, const std::string& what) {
  std::cout.flush();
  std::cerr << "sandboxer log: " << printable(where + ": " + what, false) << "\n";
}

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
  bool unreadable = false;
  sdk::Subscription sub(
      s.loop(), s.endpoint(), since, std::nullopt,
      [&](const boost::json::object& ev, std::string_view line) {
        // The box's reader could not read a segment of its journal (Journal::unreadable_event):
        // said as a local journal's is, and the replay goes on after it.
        if (auto* t = ev.if_contains("type"); t && *t == "journal.unreadable") {
          unreadable = true;
          auto text = [&](const char* k) -> std::string {
            const auto* v = ev.if_contains(k);
            return v && v->is_string() ? std::string(v->as_string()) : "?";
          };
          auto seq = [&](const char* k) -> uint64_t {
            const auto* v = ev.if_contains(k);
            return v && v->is_int64() && v->as_int64() > 0 ? static_cast<uint64_t>(v->as_int64()) : 0;
          };
          report_unreadable(a.positionals()[0], journal::Journal::describe(text("segment"), text("error"),
                                                                           seq("first_seq"), seq("last_seq")));
        } else {
          printer.print(line, ev);
        }
        const auto* seq = ev.if_contains("seq");
        if (!follow && seq && seq->is_int64() && static_cast<uint64_t>(seq->as_int64()) >= until) s.stop();
      },
      [&](int code, const std::string& reason) { rc = s.stream_closed(code, reason); });
  s.run();
  return rc == kExitOk && unreadable ? kExitFailed : rc;
}

// --follow of a state dir: what the journal holds, then what is added while a supervisor runs on
// it (its lock is held), read again every 50 ms to 1 s; after the box's end (the lock free)
// a last read, and the end.
int log_local(const std::string& state_dir, const std::string& jdir, uint64_t since, bool json, bool follow) {
  EventPrinter printer(json);
  journal::Journal::ReadPos pos;     // each read goes on where the one before stopped
  std::set<std::string> unreadable;  // segments said to be unreadable (a --follow reads again)
  int wait_ms = 50;
  for (;;) {
    // Asked before the read: what the box wrote up to its end is in the read after it.
    bool running = follow && os::dir_lock_held(state_dir);
    uint64_t before = since;
    auto r = journal::Journal::read(
        jdir, since,
        [&](uint64_t seq, std::string_view line) {
          boost::system::error_code ec;
          auto v = boost::json::parse(line, ec);
          if (!ec && v.is_object()) printer.print(line, v.as_object());
          since = seq;
          return true;
        },
        &pos,
        [&](const journal::Journal::Gap& g) {
          if (unreadable.insert(g.segment).second) report_unreadable(jdir, journal::Journal::describe(g));
          since = std::max(since, g.last);  // the next read goes on after it
          return true;
        });
    if (!r) throw std::runtime_error("read journal " + jdir + ": " + r.error().message());
    std::cout.flush();
    if (!running) return unreadable.empty() ? kExitOk : kExitFailed;
    wait_ms = since != before ? 50 : std::min(wait_ms * 2, 1000);
    ::usleep(static_cast<useconds_t>(wait_ms) * 1000);
  }
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
  std::string jdir = dir + "/journal";
  std::string state_dir = dir;
  if (::access(jdir.c_str(), F_OK) != 0) {
    if (::access(dir.c_str(), F_OK) != 0) throw std::runtime_error(dir + ": no such directory");
    jdir = dir;  // given the journal directory itself
    state_dir = dir + "/..";
    if (!journal::Journal::holds_journal(jdir))
      throw std::runtime_error(dir + ": not a box's state dir nor its journal (no journal/, no seq.hwm or segments)");
  }
  return log_local(state_dir, jdir, since, json, a.has("--follow"));
}

}  // namespace sbx::cli
