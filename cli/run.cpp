// sandboxer run [--profile P] [--set F=V]... [--env K=V]... [--env-inherit] [--state-dir DIR] [--json]
//               [--signing-key F] [--trust-key F]... [--allow-unsigned] [--max-archive-bytes N]
//               (-- CMD... | --idle --listen ADDR:PORT)
// Runs sandboxer-init here as a child (Boost.Process: nothing else reaps in the CLI), shows
// its events as they happen and exits with the agent's status.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <boost/process.hpp>
#include <boost/process/extend.hpp>
#include <csignal>
#include <iostream>
#include <stdexcept>

#include "archive/archive.hpp"
#include "archive/signing.hpp"
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/tokens.hpp"
#include "os/sys.hpp"

namespace bp = boost::process;

namespace sbx::cli {

namespace {

volatile pid_t g_child = -1;

void forward(int sig) {
  if (g_child > 0) ::kill(g_child, sig);
}

// In the child before exec: its own process group (so a terminal's Ctrl-C reaches it once,
// through us), and TERM when the CLI dies, so a box never outlives the command that ran it.
struct ChildSetup : bp::extend::handler {
  template <class Executor>
  void on_exec_setup(Executor&) const {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  }
};

}  // namespace

std::string find_init_binary() {
  if (std::string cand = os::exe_dir() + "/sandboxer-init"; ::access(cand.c_str(), X_OK) == 0) return cand;
  auto p = bp::search_path("sandboxer-init");
  if (p.empty()) throw std::runtime_error("sandboxer-init not found beside sandboxer or on PATH");
  return p.string();
}

int cmd_run(const std::vector<std::string>& args) {
  // Ours: --json and --listen; the rest is sandboxer-init's, handed on in the order given.
  auto a = parse_args(args, {.usage = "usage: sandboxer run [OPTIONS] (-- CMD... | --idle --listen ADDR:PORT)",
                             .flags = {"--json", "--allow-unsigned", "--env-inherit", "--idle"},
                             .options = {"--listen", "--profile", "--set", "--state-dir", "--workdir", "--log-level",
                                         "--signing-key", "--trust-key", "--max-archive-bytes", "--env"},
                             .max_positionals = 0,
                             .command = CommandStart::after_positionals});
  // --idle: no agent until one is restored into the box over its API (fork --to, migrate --to,
  // restore --index), which it needs a --listen for.
  bool idle = a.has("--idle");
  if (idle && !a.command().empty()) throw UsageError("--idle starts no command: no -- CMD... with it");
  if (idle && !a.has("--listen"))
    throw UsageError("--idle waits for a snapshot over the API: give it --listen ADDR:PORT");
  if (!idle && a.command().empty())
    throw UsageError("no command given: sandboxer run [OPTIONS] -- CMD... (or --idle --listen ADDR:PORT)");
  std::vector<std::string> init_args;
  for (auto& o : a.given()) {
    if (o.name == "--json" || o.name == "--listen") continue;
    init_args.push_back(o.name);
    if (o.value) init_args.push_back(*o.value);
  }
  bool json = a.has("--json");
  std::string listen = a.value_or("--listen", ""), signing_key = a.value_or("--signing-key", ""), pending_token;
  if (signing_key.empty()) {
    // The user's archive key pair (made on first use, 0600, beside the tokens): every box this
    // user starts signs with it and trusts it, so export, import and --restore between them work.
    auto key = archive::ensure_user_key(archive::user_key_dir());
    if (!key) throw std::runtime_error("the archive signing key: " + key.error().message);
    init_args.insert(init_args.end(), {"--signing-key", *key});
  }
  if (!listen.empty()) {
    // A fresh token for this box, handed over in a file (never on a command line) and kept
    // under the box's URL once the server says its port, so `attach URL` needs no flag.
    pending_token = token_dir() + "/pending-" + os::random_hex(8);
    create_token_file(pending_token);
    init_args.insert(init_args.end(), {"--listen", listen, "--token-file", pending_token});
  }
  init_args.push_back("--events");
  init_args.push_back("-");
  if (!idle) {  // --idle went with the options above
    init_args.push_back("--");
    init_args.insert(init_args.end(), a.command().begin(), a.command().end());
  }

  bp::ipstream events;
  bp::child child(find_init_binary(), bp::args(init_args), bp::std_out > events, ChildSetup{});
  g_child = child.id();
  struct sigaction sa {};
  sa.sa_handler = forward;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH}) ::sigaction(sig, &sa, nullptr);

  EventPrinter printer(json);
  std::string line, token_file = pending_token;
  bool listening = false;
  while (std::getline(events, line)) {
    boost::system::error_code ec;
    auto v = boost::json::parse(line, ec);
    if (ec || !v.is_object()) continue;
    auto& ev = v.as_object();
    if (!pending_token.empty() && !listening && ev.contains("type") && ev.at("type") == "server.listening") {
      std::string addr(ev.at("addr").as_string());
      if (addr == "0.0.0.0") addr = "127.0.0.1";
      if (addr.find(':') != std::string::npos) addr = "[" + addr + "]";
      std::string url = std::string(ev.at("tls").as_bool() ? "wss" : "ws") + "://" + addr + ":" +
                        std::to_string(ev.at("port").to_number<int64_t>());
      // A second name for the same file, the pending one kept until the box ends: the box masks
      // the file by the name it was given, and a branch's /tmp overlay keeps that name for the
      // mount (a rename under it is not seen there), which a restore of its checkpoints needs.
      std::string stored = token_path(url), linked = stored + ".tmp-" + os::random_hex(4);
      if (::link(pending_token.c_str(), linked.c_str()) == 0 && ::rename(linked.c_str(), stored.c_str()) == 0)
        token_file = stored;
      else
        ::unlink(linked.c_str());
      std::fprintf(stderr, "sandboxer: serving %s (token in %s)\n", url.c_str(), token_file.c_str());
      listening = true;
    }
    printer.print(line, ev);
  }
  child.wait();
  // The box is gone: its token opens nothing any more.
  for (auto& f : {token_file, pending_token})
    if (!f.empty()) ::unlink(f.c_str());
  g_child = -1;
  return child.exit_code();
}

}  // namespace sbx::cli
