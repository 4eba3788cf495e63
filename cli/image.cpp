// sandboxer image build: the runtime image with the sandboxer-init beside this CLI in it, imported
// into Docker (images/docker-image does the work: scripts/bundle, images/build, docker import).
#include <unistd.h>

#include <boost/process.hpp>
#include <iostream>
#include <stdexcept>

#include "cli/commands.hpp"
#include "os/sys.hpp"

namespace bp = boost::process;

namespace sbx::cli {

int cmd_image(const std::vector<std::string>& args) {
  const char* usage = "usage: sandboxer image build [--variant base|python] [--tag NAME:VERSION] [--cache DIR]";
  if (args.empty() || args[0] != "build") throw std::invalid_argument(usage);
  std::vector<std::string> pass;
  for (size_t i = 1; i < args.size(); ++i) {
    const auto& a = args[i];
    if ((a == "--variant" || a == "--tag" || a == "--cache") && i + 1 < args.size()) {
      pass.push_back(a);
      pass.push_back(args[++i]);
    } else if (a == "-h" || a == "--help") {
      std::cout << usage << "\n";
      return 0;
    } else {
      throw std::invalid_argument("unknown or incomplete option " + a + "\n" + usage);
    }
  }
  // The recipe is shipped beside the binary (an install prefix or a build tree stages it in
  // share/sandboxer/images), or lives in the source tree SANDBOXER_SOURCE names.
  std::string dir = os::exe_dir();
  std::vector<std::string> candidates;
  if (auto* s = std::getenv("SANDBOXER_SOURCE"); s && *s) candidates.push_back(std::string(s) + "/images/docker-image");
  for (auto& d : os::shipped_dirs("images")) candidates.push_back(d + "/docker-image");
  std::string script;
  for (auto& c : candidates)
    if (::access(c.c_str(), X_OK) == 0) {
      script = c;
      break;
    }
  if (script.empty())
    throw std::runtime_error("images/docker-image not found (looked in " + candidates.front() + " and " +
                             std::to_string(candidates.size() - 1) + " more places; set SANDBOXER_SOURCE to the source tree)");
  pass.insert(pass.begin(), {"--build", dir + "/.."});
  return bp::system(script, bp::args(pass), bp::std_in < bp::null);
}

}  // namespace sbx::cli
