// sandboxer attach URL [--since N] [--branch B] [--json]
// Follows a box's events from seq N; sdk::Subscription subscribes again by itself after a
// dropped connection or a 4008 (too slow), so each event shows once, in order.
#include <iostream>
#include <optional>

#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

int cmd_attach(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer attach URL [--since N] [--branch B] [--json]",
                                         .flags = {"--json"},
                                         .options = {"--since", "--branch"},
                                         .max_positionals = 1}));
  a.expect_positionals(1);
  auto since = a.number<uint64_t>("--since", 0);
  Session s("attach", a.positionals()[0], a);
  EventPrinter printer(a.has("--json"));
  int rc = kExitOk;
  sdk::Subscription sub(
      s.loop(), s.endpoint(), since, a.value("--branch"),
      [&](const json::object& ev, std::string_view line) { printer.print(line, ev); },
      [&](int code, const std::string& reason) { rc = s.stream_closed(code, reason); });
  s.run();
  return rc;
}

}  // namespace sbx::cli
