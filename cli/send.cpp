// sandboxer send URL SNAPSHOT --to URL2 [--to URL3]...: a snapshot out of one box and into
// others over the box API, read from the source once and fed to every target side by side
// (relay.hpp), with nothing left on this machine. The boxes may be on any host this machine
// reaches; no file is shared with them. A target imports the archive only if it arrived whole
// and hashed to its id. One line per target that has it, on stdout: <URL> <SNAPSHOT>.
// Tokens: --token-file for the source; --to-token-file once for every target, or once per --to in
// the same order; without it each target's is SANDBOXER_TOKEN or the one stored for its URL.
// The targets are asked which of the snapshot's chunks they lack first (plan_delta): only those
// go (a delta; stderr says how many), unless --whole.
#include <iostream>

#include "archive/archive.hpp"
#include "cli/commands.hpp"
#include "cli/relay.hpp"
#include "cli/session.hpp"
#include "cli/tokens.hpp"

namespace sbx::cli {

namespace json = boost::json;

namespace {
const char* kSendUsage =
    "usage: sandboxer send URL SNAPSHOT --to URL... [--token-file F] [--to-token-file F]... [--whole]";
}  // namespace

int cmd_send(const std::vector<std::string>& args) {
  auto a = parse_args(args,
                      remote_spec({.usage = kSendUsage, .flags = {"--whole"}, .options = {"--to", "--to-token-file"}}));
  a.expect_positionals(2);
  auto to = a.values("--to");
  if (to.empty()) a.fail("no target (--to URL)");
  Session s("send", a.positionals()[0], a);
  auto got = snapshot_id(s, a.positionals()[1]);
  if (!got) return s.fail(got.error());
  const std::string snap = *got;
  std::vector<sdk::Endpoint> targets = target_endpoints(a, s.endpoint().insecure);
  DeltaPlan plan = a.has("--whole") ? DeltaPlan{} : plan_delta(s, targets, snap);
  Relay relay(s.loop(), s.endpoint(), snap, plan);
  if (auto r = relay.start(); !r) return s.fail(r.error());
  for (auto& t : targets) relay.add_target(t);
  relay.seal();
  relay.on_done([&] { s.stop(); });
  s.on_interrupt([&] { relay.abort("interrupted"); });
  if (!relay.done()) s.run();
  int status = kExitOk;
  if (!relay.source()) {
    // Where every target failed first, each says why below.
    if (relay.source().error().code != kNoTarget) s.fail(relay.source().error(), "export " + snap + " from " + s.url());
    status = kExitFailed;
  }
  auto results = relay.targets();
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i]) {
      // Told once: a target that failed only because the source did is covered above.
      if (results[i].error().code != kSourceFailed) s.fail(results[i].error(), "import into " + to[i]);
      status = kExitFailed;
      continue;
    }
    auto* got = results[i]->if_contains("snapshot");
    if (!got || *got != json::value(snap)) {
      s.fail(base::fail("its import names " + (got ? json::serialize(*got) : "no snapshot"), "bad_reply"),
             "import into " + to[i]);
      status = kExitFailed;
      continue;
    }
    std::cout << to[i] << " " << snap << "\n";
  }
  if (status == kExitOk)
    std::cerr << "sent " << snap << " (" << relay.size() << " bytes" << plan.describe() << ") to " << to.size()
              << " box(es)\n";
  return status;
}

}  // namespace sbx::cli
