// sandboxer checkpoint URL [--name N] [--branch B] [--leave-running | --stop] [--json]
// Checkpoints a live agent (the main branch, or B); the snapshot id is the last line of stdout.
#include <iostream>

#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

int cmd_checkpoint(const std::vector<std::string>& args) {
  auto a = parse_args(
      args, remote_spec({.usage = "usage: sandboxer checkpoint URL [--name N] [--branch B] [--leave-running | --stop] "
                                  "[--json]",
                         .flags = {"--leave-running", "--stop", "--json"},
                         .options = {"--name", "--branch"}}));
  a.expect_positionals(1);
  json::object req{{"op", "checkpoint"}, {"leave_running", !a.has("--stop")}};
  if (auto name = a.value("--name")) req["name"] = *name;
  if (auto branch = a.value("--branch")) req["branch"] = *branch;
  Session s("checkpoint", a.positionals()[0], a);
  auto r = s.call(std::move(req));
  if (!r) return s.fail(r.error());
  if (a.has("--json"))
    std::cout << json_line(*r) << "\n";
  else if (auto* m = r->if_contains("mode"))
    std::cerr << "checkpoint: mode " << json::serialize(*m) << "\n";
  // For scripts: the snapshot id is the last line of stdout.
  std::cout << json::value_to<std::string>(r->at("snapshot")) << "\n";
  return kExitOk;
}

}  // namespace sbx::cli
