// sandboxer log STATE_DIR [--since N] [--json]
#include <unistd.h>

#include <iostream>
#include <stdexcept>

#include "cli/commands.hpp"
#include "journal/journal.hpp"
#include "cli/printer.hpp"

namespace sbx::cli {

int cmd_log(const std::vector<std::string>& args) {
  std::string dir;
  uint64_t since = 0;
  bool json = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--json") json = true;
    else if (args[i] == "--since" && i + 1 < args.size()) since = std::stoull(args[++i]);
    else if (args[i].starts_with("-")) throw std::invalid_argument("unknown option " + args[i]);
    else if (dir.empty()) dir = args[i];
    else throw std::invalid_argument("unexpected argument " + args[i]);
  }
  if (dir.empty()) throw std::invalid_argument("usage: sandboxer log STATE_DIR [--since N] [--json]");
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
