#pragma once
// The command line of sandboxer-init.
#include <string>
#include <vector>

namespace sbx::supervisor {

struct InitOptions {
  enum Mode { Run, NsInit, Version, Help, Health } mode = Run;
  bool flat = false;  // ns-init without namespaces
  std::string profile = "default";
  std::vector<std::string> overrides;
  std::string state_dir;
  std::string events;
  std::string workdir = "/workspace";
  std::string log_level = "info";
  std::vector<std::string> argv;
  // --command-env NAME: argv came from the JSON array in the environment variable NAME (a host
  // whose sandboxes share one entrypoint and take variables of their own: Daytona's). main()
  // removes NAME from our environment before anything starts.
  std::string command_env;
  // The agent's environment (agent-env.hpp): --env K=V (or K, from ours), --env-inherit.
  std::vector<std::string> env;
  bool env_inherit = false;
  // The WebSocket server.
  std::string listen;
  std::string token_file;
  std::string tls_cert, tls_key;
  std::string metrics_interval;  // "": the profile's metrics.interval
  bool idle = false;             // start with no agent and wait
  std::string restore_file;      // start from a checkpoint archive
  int restore_index = 0;         // --restore-index: which copy of a fork onto other boxes this is
  // Signed archives: the key this box signs with ("": the user's own, made on first use), keys
  // it trusts besides its own, whether it accepts unsigned archives (cold restores only), and the
  // bound on what one archive may expand to ("": 64G).
  std::string signing_key;
  std::vector<std::string> trust_keys;
  bool allow_unsigned = false;
  std::string max_archive_bytes;
};

/// Parses argv; throws std::invalid_argument with a message naming the bad option.
InitOptions parse_init_options(int argc, char** argv);

extern const char* const kInitUsage;

}  // namespace sbx::supervisor
