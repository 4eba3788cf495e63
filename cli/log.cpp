// sandboxer log STATE_DIR [--since N] [--json]
#include <unistd.h>

#include <iostream>
#include <stdexcept>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "journal/journal.hpp"

namespace sbx::cli {

int cmd_log(const std::vector<std::string>& args) {
  auto a = parse_args(args, {.usage = "usage: sandboxer log STATE_DIR [--since N] [--json]",
                             .flags = {"--json"},
                             .options = {"--since"},
                             .max_positionals = 1});
  a.expect_positionals(1);
  const std::string& dir = a.positionals()[0];
  auto since = a.number<uint64_t>("--since", 0);
  bool json = a.has("--json");
  std::string jdir = dir + "/journal";
  if (::access(jdir.c_str(), F_OK) != 0) {
    if (::access(dir.c_str(), F_OK) != 0) throw std::runtime_error(dir + ": no such directory");
    jdir = dir;  // given the journal directory itself
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
