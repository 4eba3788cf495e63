// sandboxer: the host CLI. One file per subcommand (commands.hpp), each parsing its arguments
// with args.hpp and, if it talks to a box, connecting through session.hpp; this one dispatches.
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/args.hpp"
#include "cli/commands.hpp"

namespace {
const char* kUsage =
    "usage: sandboxer COMMAND [ARGS...]\n"
    "\n"
    "  run [--profile P] [--set F=V] [--env K=V] [--env-inherit] [--state-dir DIR] [--listen ADDR:PORT] [--json]\n"
    "      [--signing-key F] [--trust-key F]... [--allow-unsigned] [--max-archive-bytes N] -- CMD...\n"
    "                                                                        run an agent here, show its events; its\n"
    "                                                                        environment is clean but for --env\n"
    "      (--idle --listen ADDR:PORT in place of -- CMD...: a box that waits for a snapshot, for fork --to,\n"
    "      migrate --to or restore --index)\n"
    "  log STATE_DIR|URL [--since N] [--json] [--follow]                     print a box's journal\n"
    "  attach URL [--since N] [--branch B] [--json]                          follow a box's events (resumes by "
    "itself)\n"
    "  exec URL [-i] [-t] [--proc ID] [--env K=V] [--cwd D] -- CMD...        run CMD in the box; exits with its "
    "status\n"
    "  cp [-r] SRC DST                                                       copy a file (-r: a tree); one side is "
    "URL:PATH\n"
    "  ls URL[:PATH] [--json]                                                a directory of the box (/workspace, "
    "/tmp)\n"
    "  rm URL:PATH [-r]                                                      remove a file, or a directory (-r: with "
    "what it holds)\n"
    "  mkdir URL:PATH [-p]                                                   make a directory (-p: and those on the "
    "way)\n"
    "  mv URL:FROM TO [--replace]                                            rename within the box (TO: a path, or "
    "URL:TO)\n"
    "  stats URL [--json]                                                    cpu, memory, pids, disk of the box\n"
    "  (remote commands take --token-file F, else SANDBOXER_TOKEN, else the token `run --listen` or `up` stored)\n"
    "  checkpoint URL [--name N] [--branch B] [--stop]                      checkpoint a live agent; prints the "
    "snapshot id last\n"
    "  restore URL SNAPSHOT [--index N]                                      restore a snapshot in the box "
    "(--index: an idle box becomes copy N)\n"
    "  fork URL --snapshot S -n N [--host docker]                            N live copies; one line each: <branch> "
    "<proc|URL>\n"
    "  snapshots URL [--json]                                                the box's snapshots\n"
    "  (SNAPSHOT, S: a snapshot's id, or the name of exactly one of the box's snapshots)\n"
    "  export URL SNAPSHOT FILE [--base S]                                   copy a snapshot's archive out of the box "
    "(--base: only what S lacks)\n"
    "  import URL FILE [--json]                                              copy an archive into the box; prints its "
    "id last\n"
    "  migrate URL --to docker [--publish-address IP]                        move a live agent into a new box; prints "
    "its URL last\n"
    "  send URL SNAPSHOT --to URL... [--to-token-file F] [--whole]           copy a snapshot from one box into others "
    "(a delta when they share one)\n"
    "  ui URL|STATE_DIR [--port P] [--open]                                  a live view of the box in the browser\n"
    "  doctor [--json]                                                       what this host enforces, and what is "
    "missing\n"
    "  up --host docker [--profile P] [--env K=V] [--image I] [-v SRC:DST] [--publish-address IP] -- CMD...\n"
    "                                                                        start a box; prints its URL last\n"
    "  down [--rm] URL|NAME|STATE_DIR                                        stop a box: a local one (TERM, its grace\n"
    "                                                                        period), a docker one stopped and "
    "removed\n"
    "                                                                        (a stopped local one: what its killed\n"
    "                                                                        supervisor left mounted is released;\n"
    "                                                                        --rm: then what a local box made in its\n"
    "                                                                        state dir is removed, journal too)\n"
    "  ps [--all] [--json]                                                   the boxes this host runs: local (any "
    "state\n"
    "                                                                        dir), then docker's (--all: the stopped\n"
    "                                                                        local ones too, and how each ended)\n"
    "  image build [--variant base|python] [--tag NAME:VERSION]              the runtime image, into Docker\n"
    "  version                                                               print the version\n";

int unreadable_reply(const std::string& cmd, const std::exception& e) {
  std::cerr << "sandboxer " << cmd << ": the box sent a reply this CLI cannot read (" << e.what() << ")\n";
  return sbx::cli::kExitFailed;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    std::cout << kUsage;
    return argc < 2 ? sbx::cli::kExitUsage : sbx::cli::kExitOk;
  }
  std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (cmd == "run") return sbx::cli::cmd_run(args);
    if (cmd == "log") return sbx::cli::cmd_log(args);
    if (cmd == "checkpoint") return sbx::cli::cmd_checkpoint(args);
    if (cmd == "restore") return sbx::cli::cmd_restore(args);
    if (cmd == "fork") return sbx::cli::cmd_fork(args);
    if (cmd == "snapshots") return sbx::cli::cmd_snapshots(args);
    if (cmd == "export") return sbx::cli::cmd_export(args);
    if (cmd == "import") return sbx::cli::cmd_import(args);
    if (cmd == "send") return sbx::cli::cmd_send(args);
    if (cmd == "migrate") return sbx::cli::cmd_migrate(args);
    if (cmd == "attach") return sbx::cli::cmd_attach(args);
    if (cmd == "exec") return sbx::cli::cmd_exec(args);
    if (cmd == "cp") return sbx::cli::cmd_cp(args);
    if (cmd == "ls") return sbx::cli::cmd_ls(args);
    if (cmd == "rm") return sbx::cli::cmd_rm(args);
    if (cmd == "mkdir") return sbx::cli::cmd_mkdir(args);
    if (cmd == "mv") return sbx::cli::cmd_mv(args);
    if (cmd == "stats") return sbx::cli::cmd_stats(args);
    if (cmd == "doctor") return sbx::cli::cmd_doctor(args);
    if (cmd == "up") return sbx::cli::cmd_up(args);
    if (cmd == "down") return sbx::cli::cmd_down(args);
    if (cmd == "ps") return sbx::cli::cmd_ps(args);
    if (cmd == "image") return sbx::cli::cmd_image(args);
    if (cmd == "ui") return sbx::cli::cmd_ui(args);
    if (cmd == "version" || cmd == "--version") {
      std::cout << "sandboxer " << SBX_VERSION << "\n";
      return 0;
    }
  } catch (const sbx::cli::UsageError& e) {
    std::cerr << "sandboxer " << cmd << ": " << e.what() << "\n";
    return sbx::cli::kExitUsage;
  } catch (const std::invalid_argument& e) {
    // boost::json's accessors (1.81: std::invalid_argument "not an object", std::out_of_range for
    // a missing key) on a reply of a shape this CLI does not expect: the box's doing (a box of
    // another version, or a hostile one), not a usage error. Once printed as boost's bare words,
    // with exit 2.
    return unreadable_reply(cmd, e);
  } catch (const std::out_of_range& e) {
    return unreadable_reply(cmd, e);
  } catch (const std::exception& e) {
    // A usage error (args.hpp), or nothing to start with: no token, no sandboxer-init, no Docker.
    std::cerr << "sandboxer " << cmd << ": " << e.what() << "\n";
    return sbx::cli::kExitUsage;
  }
  std::cerr << "sandboxer: unknown command \"" << cmd << "\"\n" << kUsage;
  return sbx::cli::kExitUsage;
}
