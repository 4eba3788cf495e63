// sandboxer import URL FILE [--json]: an archive into the box (snapshot.import); the box checks
// its signature and makes it one of its snapshots. The snapshot id is the last line of stdout.
#include <iostream>

#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

int cmd_import(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer import URL FILE [--json]", .flags = {"--json"}}));
  a.expect_positionals(2);
  const auto& file = a.positionals()[1];
  Session s("import", a.positionals()[0], a);
  auto r = s.upload({{"op", "snapshot.import"}, {"size", 0}}, file);
  if (!r) return s.fail(r.error(), file);
  if (a.has("--json"))
    std::cout << json_line(*r) << "\n";
  else if (r->at("existing").as_bool())
    std::cerr << "import: the box already had this snapshot\n";
  // For scripts: the snapshot id is the last line of stdout.
  std::cout << json::value_to<std::string>(r->at("snapshot")) << "\n";
  return kExitOk;
}

}  // namespace sbx::cli
