// sandboxer fork URL --snapshot S -n N [--host docker] [--json]
// sandboxer fork URL --branch B -n N [--name NAME] [--json]
// sandboxer fork URL --snapshot S --to URL... [--to-token-file F]...
// N live copies of snapshot S: in the box (op fork, each a branch; one line each: <branch>
// <proc>); with --host docker in N new containers; with --to in boxes any host started idle
// (`sandboxer-init --idle`: the host shims' fork), one copy each, in the order given
// (fork-docker.cpp; one line each: main <URL>). With --branch, a live checkpoint of branch B and
// N copies of it in the box, the copies started from the dump's images before its archive is
// sealed (op fork with `branch`).
#include "archive/archive.hpp"
#include "cli/commands.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

int cmd_fork(const std::vector<std::string>& args) {
  auto a = parse_args(
      args, remote_spec({.usage = "usage: sandboxer fork URL (--snapshot S (-n N [--host docker] "
                                  "[--publish-address IP] [--trust-key F]... | --to URL... [--to-token-file F]...) | "
                                  "--branch B [-n N] [--name NAME])",
                         .flags = {"--json"},
                         .options = {"--snapshot", "-n", "--host", "--publish-address", "--to", "--to-token-file",
                                     "--trust-key", "--branch", "--name"}}));
  a.expect_positionals(1);
  const auto& url = a.positionals()[0];
  auto token_file = a.value_or("--token-file", "");
  if (auto branch = a.value("--branch")) {
    for (const char* o : {"--snapshot", "--host", "--to", "--to-token-file", "--trust-key", "--publish-address"})
      if (a.has(o)) a.fail(std::string("--branch forks in the box itself: no ") + o + " with it");
    boost::json::object req{{"op", "fork"}, {"branch", *branch}, {"n", a.number<int>("-n", 1)}};
    if (auto name = a.value("--name")) req["name"] = *name;
    return restore_in_box("fork", url, token_file, std::move(req), a.has("--json"));
  }
  if (a.has("--name")) a.fail("--name names the checkpoint of --branch: only with it");
  auto snap = a.value_or("--snapshot", "");
  if (snap.empty()) throw UsageError(a.usage());
  if (!archive::valid_snapshot_id(snap)) {  // a name: its id, asked of the box
    Session s("fork", url, token_file);
    auto id = snapshot_id(s, snap);
    if (!id) return s.fail(id.error());
    snap = *id;
  }
  if (a.has("--to")) {
    if (a.has("--host") || a.has("-n") || a.has("--json"))
      a.fail("--to names the boxes to fork into: no --host, -n or --json with it");
    Session s("fork", url, token_file);
    return fork_into_boxes(url, token_file, snap, target_endpoints(a, s.endpoint().insecure));
  }
  if (a.has("--to-token-file")) a.fail("--to-token-file: only with --to");
  if (auto host = a.value("--host")) {
    if (*host != "docker") throw UsageError("--host " + *host + ": not supported here (docker)");
    return fork_on_docker(url, token_file, snap, a.number<int>("-n", 1),
                          {a.value_or("--publish-address", ""), readable_keys(a)});
  }
  if (a.has("--trust-key")) a.fail("--trust-key: only with --host docker (new boxes' keys)");
  return restore_in_box("fork", url, token_file, {{"op", "fork"}, {"snapshot", snap}, {"n", a.number<int>("-n", 1)}},
                        a.has("--json"));
}

}  // namespace sbx::cli
