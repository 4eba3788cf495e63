// sandboxer image build: the runtime image with the sandboxer-init beside this CLI in it, imported
// into Docker (images/docker-image does the work: scripts/bundle, images/build, docker import).
#include <unistd.h>

#include <boost/process.hpp>
#include <iostream>
#include <stdexcept>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "os/sys.hpp"

namespace bp = boost::process;

namespace sbx::cli {

int cmd_image(const std::vector<std::string>& args) {
  auto a = parse_args(args, {.usage = "usage: sandboxer image build [--variant base|python] [--tag NAME:VERSION] "
                                      "[--cache DIR]",
                             .flags = {"--help"},
                             .options = {"--variant", "--tag", "--cache"},
                             .aliases = {{"-h", "--help"}},
                             .max_positionals = 1});
  if (a.positionals().empty() || a.positionals()[0] != "build") throw UsageError(a.usage());
  if (a.has("--help")) {
    std::cout << a.usage() << "\n";
    return kExitOk;
  }
  // images/docker-image's own options, in the order given.
  std::vector<std::string> pass;
  for (auto& o : a.given())
    if (o.value) pass.insert(pass.end(), {o.name, *o.value});
  // The tag `up` starts by default: this CLI's version (the recipe, run from an install or a build
  // tree, has no CMakeLists.txt beside it to read the version from).
  if (!a.has("--tag")) pass.insert(pass.end(), {"--tag", std::string("sandboxer/agent:") + SBX_VERSION});
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
                             std::to_string(candidates.size() - 1) +
                             " more places; set SANDBOXER_SOURCE to the source tree)");
  pass.insert(pass.begin(), {"--build", dir + "/.."});
  return bp::system(script, bp::args(pass), bp::std_in < bp::null);
}

}  // namespace sbx::cli
