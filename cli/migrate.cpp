// sandboxer migrate URL --to docker [--publish-address IP]: the box's agent moved, live, into a new
// box on the dockerd DOCKER_HOST names (this machine's or another's), over the box API; the URL
// it now answers at is the last line of stdout (fork-docker.cpp says how).
#include <iostream>

#include "cli/commands.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

int cmd_migrate(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer migrate URL --to docker [--publish-address IP]",
                                         .options = {"--to", "--publish-address"}}));
  a.expect_positionals(1);
  auto to = a.value_or("--to", "");
  if (to.empty()) a.fail("--to is required (docker)");
  if (to != "docker") a.fail("--to " + to + ": not supported here (docker)");
  return migrate_on_docker(a.positionals()[0], a.value_or("--token-file", ""), a.value_or("--publish-address", ""));
}

}  // namespace sbx::cli
