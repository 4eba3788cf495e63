// sandboxer: the host CLI. One file per subcommand; this one dispatches.
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "commands.hpp"

namespace {
const char* kUsage =
    "usage: sandboxer COMMAND [ARGS...]\n"
    "\n"
    "  run [--profile P] [--set F=V] [--state-dir DIR] [--json] -- CMD...   run an agent here, show its events\n"
    "  log STATE_DIR [--since N] [--json]                                    print a box's journal\n"
    "  up --host docker [--profile P] [--image I] [-v SRC:DST] -- CMD...     start a box; prints its URL last\n"
    "  down URL|NAME                                                         stop and remove a box\n"
    "  ps [--json]                                                           the boxes this host runs\n"
    "  image build [--variant base|python] [--tag NAME:VERSION]              the runtime image, into Docker\n"
    "  version                                                               print the version\n";
}

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (cmd == "run") return sbx::cli::cmd_run(args);
    if (cmd == "log") return sbx::cli::cmd_log(args);
    if (cmd == "up") return sbx::cli::cmd_up(args);
    if (cmd == "down") return sbx::cli::cmd_down(args);
    if (cmd == "ps") return sbx::cli::cmd_ps(args);
    if (cmd == "image") return sbx::cli::cmd_image(args);
    if (cmd == "version" || cmd == "--version") {
      std::cout << "sandboxer " << SBX_VERSION << "\n";
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "sandboxer " << cmd << ": " << e.what() << "\n";
    return 2;
  }
  std::cerr << "sandboxer: unknown command \"" << cmd << "\"\n" << kUsage;
  return 2;
}
