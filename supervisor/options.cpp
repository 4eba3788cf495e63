#include "supervisor/options.hpp"

#include <boost/json.hpp>
#include <cstdlib>
#include <stdexcept>

#include "profile/agent-env.hpp"

namespace sbx::supervisor {

const char* const kInitUsage =
    "usage: sandboxer-init [OPTIONS] -- COMMAND [ARGS...]\n"
    "\n"
    "Runs COMMAND as the agent of a sandbox box: PID 1 duties, resource ceilings and policy,\n"
    "and a journal of every event.\n"
    "\n"
    "  --profile NAME|FILE   sandbox profile (default: default)\n"
    "  --set FIELD=VALUE     override one profile field, e.g. resources.grace=3s\n"
    "  --state-dir DIR       journal and branch state (default: $XDG_STATE_HOME/sandboxer/boxes/ID)\n"
    "  --events PATH|-       also write every event as a JSON line to PATH (- for stdout)\n"
    "  --workdir DIR         the agent's working directory (default: /workspace)\n"
    "  --log-level LEVEL     trace, debug, info, warn, error (default: info)\n"
    "  --env K=V             set K in the agent's environment (repeatable; K alone: our value of K)\n"
    "  --env-inherit         the agent starts from this process's whole environment, not a clean one\n"
    "  --listen ADDR:PORT    serve the WebSocket API (port 0: any free port, see server.listening)\n"
    "  --token-file FILE     the API token (else $SANDBOXER_TOKEN); required with --listen\n"
    "  --tls-cert FILE, --tls-key FILE   serve wss:// (for listeners beyond loopback)\n"
    "  --metrics-interval D  cadence of metrics events (default: the profile's metrics.interval, 5s; 0 for none)\n"
    "  --idle                start with no command and wait (for exec, restore, fork)\n"
    "  --command-env NAME    the command is the JSON array of strings in $NAME (for hosts whose\n"
    "                        sandboxes share one entrypoint); NAME is removed from the environment\n"
    "  --restore FILE        start from a checkpoint archive instead of a command\n"
    "  --restore-index N     with --restore: which copy this box is (its identity's index; default 0)\n"
    "  --signing-key FILE    the Ed25519 private key (PEM) this box signs its archives with; masked\n"
    "                        from the agent (default: the user's key pair in\n"
    "                        $XDG_STATE_HOME/sandboxer/keys/, made on first use)\n"
    "  --trust-key FILE      a public (or private) key whose signed archives this box imports and\n"
    "                        restores (repeatable; the box always trusts its own signing key)\n"
    "  --allow-unsigned      accept unsigned or untrusted archives too: restored cold (files only,\n"
    "                        the agent's command again), never given to criu\n"
    "  --max-archive-bytes N the most one archive may expand to (default 64G)\n"
    "  --version             print the version\n"
    "  --health              exit 0 when this container's supervisor runs and its WebSocket API\n"
    "                        answers, else 1 (the image's HEALTHCHECK); PID 1 writes, and this\n"
    "                        reads, /run/sandboxer/init.json or $SANDBOXER_HEALTH_FILE\n";

namespace {

// The command in the environment variable `name` (--command-env): a JSON array of strings, the
// program first. Errors name the variable and what is wrong with it.
std::vector<std::string> command_from_env(const std::string& name) {
  std::string what = "--command-env " + name + ": ";
  const char* v = std::getenv(name.c_str());
  if (!v) throw std::invalid_argument(what + name + " is not set");
  boost::system::error_code ec;
  auto j = boost::json::parse(v, ec);
  if (ec) throw std::invalid_argument(what + name + " is not JSON (" + ec.message() + ")");
  if (!j.is_array() || j.as_array().empty())
    throw std::invalid_argument(what + "expected a JSON array of strings (the program and its arguments)");
  std::vector<std::string> argv;
  for (auto& w : j.as_array()) {
    if (!w.is_string()) throw std::invalid_argument(what + "word " + std::to_string(argv.size()) + " is not a string");
    std::string s(w.as_string());
    if (s.find('\0') != std::string::npos)
      throw std::invalid_argument(what + "word " + std::to_string(argv.size()) + " holds a NUL");
    argv.push_back(std::move(s));
  }
  if (argv[0].empty()) throw std::invalid_argument(what + "the program's name is empty");
  return argv;
}

}  // namespace

InitOptions parse_init_options(int argc, char** argv) {
  InitOptions o;
  int i = 1;
  auto value = [&](const std::string& opt) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(opt + " needs a value");
    return argv[++i];
  };
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "--ns-init")
      o.mode = InitOptions::NsInit;
    else if (a == "--flat")
      o.flat = true;
    else if (a == "--version")
      o.mode = InitOptions::Version;
    else if (a == "--health")
      o.mode = InitOptions::Health;
    else if (a == "-h" || a == "--help")
      o.mode = InitOptions::Help;
    else if (a == "--profile")
      o.profile = value(a);
    else if (a == "--set")
      o.overrides.push_back(value(a));
    else if (a == "--state-dir")
      o.state_dir = value(a);
    else if (a == "--events")
      o.events = value(a);
    else if (a == "--workdir")
      o.workdir = value(a);
    else if (a == "--log-level")
      o.log_level = value(a);
    else if (a == "--env") {
      if (auto kv = profile::parse_env_assignment(value(a)); !kv.empty()) o.env.push_back(std::move(kv));
    } else if (a == "--env-inherit")
      o.env_inherit = true;
    else if (a == "--listen")
      o.listen = value(a);
    else if (a == "--token-file")
      o.token_file = value(a);
    else if (a == "--tls-cert")
      o.tls_cert = value(a);
    else if (a == "--tls-key")
      o.tls_key = value(a);
    else if (a == "--metrics-interval")
      o.metrics_interval = value(a);
    else if (a == "--idle")
      o.idle = true;
    else if (a == "--command-env")
      o.command_env = value(a);
    else if (a == "--restore")
      o.restore_file = value(a);
    else if (a == "--signing-key")
      o.signing_key = value(a);
    else if (a == "--trust-key")
      o.trust_keys.push_back(value(a));
    else if (a == "--allow-unsigned")
      o.allow_unsigned = true;
    else if (a == "--max-archive-bytes")
      o.max_archive_bytes = value(a);
    else if (a == "--restore-index") {
      std::string v = value(a);
      char* end = nullptr;
      long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 0 || n > 1023)
        throw std::invalid_argument("--restore-index " + v + ": expected a number 0..1023");
      o.restore_index = static_cast<int>(n);
    } else if (a.starts_with("-"))
      throw std::invalid_argument("unknown option " + a);
    else
      break;  // the command starts here
  }
  for (; i < argc; ++i) o.argv.emplace_back(argv[i]);
  if (!o.command_env.empty() && o.mode == InitOptions::Run) {
    if (!o.argv.empty()) throw std::invalid_argument("--command-env and a command after -- exclude each other");
    if (o.idle || !o.restore_file.empty())
      throw std::invalid_argument(std::string("--command-env and ") + (o.idle ? "--idle" : "--restore") +
                                  " exclude each other");
    o.argv = command_from_env(o.command_env);
  }
  if (o.restore_index != 0 && o.restore_file.empty()) throw std::invalid_argument("--restore-index needs --restore");
  // Relative to what? ns-init's working directory is the branch's root, not the caller's.
  if (!o.workdir.starts_with('/'))
    throw std::invalid_argument("--workdir " + o.workdir + ": an absolute path (the agent's, e.g. /workspace/src)");
  if (o.mode == InitOptions::Run && (o.idle || !o.restore_file.empty())) {
    if (!o.argv.empty())
      throw std::invalid_argument(std::string(o.idle ? "--idle" : "--restore") + " takes no command");
    if (o.idle && !o.restore_file.empty()) throw std::invalid_argument("--idle and --restore exclude each other");
    return o;
  }
  if (o.mode == InitOptions::Run && o.argv.empty())
    throw std::invalid_argument("no command given (expected -- COMMAND ...)");
  return o;
}

}  // namespace sbx::supervisor
