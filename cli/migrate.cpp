// sandboxer migrate URL --to docker [--publish-address IP]: the box's agent moved, live, into a new
// box on the dockerd DOCKER_HOST names (this machine's or another's), over the box API;
// sandboxer migrate URL --to ws[s]://... [--to-token-file F]: into a box some host started idle
// (`sandboxer-init --idle`: the host shims' migrate). The URL it now answers at is the last line
// of stdout (fork-docker.cpp says how).
#include <iostream>

#include "cli/commands.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

int cmd_migrate(const std::vector<std::string>& args) {
  auto a = parse_args(
      args,
      remote_spec({.usage = "usage: sandboxer migrate URL --to docker [--publish-address IP] [--trust-key F]... | "
                            "--to URL [--to-token-file F]",
                   .options = {"--to", "--publish-address", "--to-token-file", "--trust-key"}}));
  a.expect_positionals(1);
  const auto& url = a.positionals()[0];
  auto to = a.values("--to");
  if (to.empty()) a.fail("--to is required (docker, or the URL of an idle box)");
  if (to.size() > 1) a.fail("--to: one target (a migrate moves the agent; fork makes copies)");
  auto token_file = a.value_or("--token-file", "");
  if (to[0] == "docker") {
    if (a.has("--to-token-file")) a.fail("--to-token-file: only with --to URL");
    return migrate_on_docker(url, token_file, {a.value_or("--publish-address", ""), readable_keys(a)});
  }
  if (!to[0].starts_with("ws://") && !to[0].starts_with("wss://"))
    a.fail("--to " + to[0] + ": not supported here (docker, or a ws:// or wss:// URL)");
  if (a.has("--publish-address") || a.has("--trust-key"))
    a.fail("--publish-address and --trust-key: only with --to docker (the box at the URL has its keys)");
  Session s("migrate", url, token_file);
  return migrate_into_box(url, token_file, target_endpoints(a, s.endpoint().insecure).front());
}

}  // namespace sbx::cli
