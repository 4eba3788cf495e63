// sandboxer ui in a build without the page server (SBX_UI=OFF, CMakeLists.txt): the command is
// known, and says why it cannot serve the page.
#include <iostream>

#include "cli/commands.hpp"

namespace sbx::cli {

int cmd_ui(const std::vector<std::string>&) {
  std::cerr << "sandboxer ui: this sandboxer was built without the page server (SBX_UI=OFF); "
               "build it with -DSBX_UI=ON\n";
  return kExitFailed;
}

}  // namespace sbx::cli
