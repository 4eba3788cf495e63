// sandboxer snapshots URL [--json]: the box's snapshots, one JSON object a line.
#include <iostream>

#include "cli/commands.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

int cmd_snapshots(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer snapshots URL [--json]", .flags = {"--json"}}));
  a.expect_positionals(1);
  Session s("snapshots", a.positionals()[0], a);
  auto r = s.call({{"op", "snapshot.list"}});
  if (!r) return s.fail(r.error());
  for (auto& snap : r->at("snapshots").as_array()) std::cout << json::serialize(snap) << "\n";
  return kExitOk;
}

}  // namespace sbx::cli
