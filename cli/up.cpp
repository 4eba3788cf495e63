// sandboxer up --host H, down URL, ps: boxes on a host, through its shim (shims/).
#include <boost/json.hpp>
#include <iostream>
#include <stdexcept>

#include "profile/agent-env.hpp"
#include "cli/commands.hpp"
#include "shims/docker/docker.hpp"
#include "cli/tokens.hpp"

namespace sbx::cli {

namespace dk = sbx::shims::docker;

namespace {
const char* kUpUsage =
    "usage: sandboxer up --host docker [--profile P] [--set F=V] [--env K=V] [--image I] [--name N] [-v SRC:DST[:ro]] "
    "-- CMD...";

void check_host(const std::string& host) {
  if (host.empty()) throw std::invalid_argument("--host is required (docker)");
  if (host != "docker") throw std::invalid_argument("--host " + host + ": not supported here (docker)");
}
}  // namespace

int cmd_up(const std::vector<std::string>& args) {
  dk::UpOptions o;
  std::string host;
  size_t i = 0;
  auto value = [&](const std::string& opt) -> std::string {
    if (i + 1 >= args.size()) throw std::invalid_argument(opt + " needs a value");
    return args[++i];
  };
  for (; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "--host") host = value(a);
    else if (a == "--profile") o.profile = value(a);
    else if (a == "--set") o.overrides.push_back(value(a));
    else if (a == "--env") {
      // K alone takes our value of K, as docker does: the container has none of our environment.
      if (auto kv = profile::parse_env_assignment(value(a)); !kv.empty()) o.env.push_back(std::move(kv));
    }
    else if (a == "--image") o.image = value(a);
    else if (a == "--name") o.name = value(a);
    else if (a == "-v" || a == "--volume") o.volumes.push_back(value(a));
    else if (a == "-h" || a == "--help") {
      std::cout << kUpUsage << "\n";
      return 0;
    } else throw std::invalid_argument("unknown option " + a + "\n" + kUpUsage);
  }
  o.argv.assign(args.begin() + static_cast<long>(std::min(i, args.size())), args.end());
  check_host(host);
  if (o.argv.empty()) throw std::invalid_argument(std::string("no command given (expected -- CMD...)\n") + kUpUsage);
  o.box_root = state_home() + "/docker";
  auto box = dk::up(o, std::cerr);
  save_token(box.url, box.token);
  std::cerr << "box " << box.name << ": journal in " << box.state_dir << " (sandboxer log DIR), token in "
            << token_path(box.url) << "\n";
  std::cout << box.url << std::endl;  // the last line of stdout: what scripts read
  return 0;
}

int cmd_down(const std::vector<std::string>& args) {
  if (args.size() != 1) throw std::invalid_argument("usage: sandboxer down URL|NAME");
  auto box = dk::down(args[0]);
  if (!box.url.empty()) forget_token(box.url);
  std::cout << "box " << box.name << " stopped and removed; journal in " << box.state_dir << "\n";
  return 0;
}

int cmd_ps(const std::vector<std::string>& args) {
  bool as_json = false;
  for (auto& a : args) {
    if (a == "--json") as_json = true;
    else throw std::invalid_argument("unknown option " + a + " (usage: sandboxer ps [--json])");
  }
  auto boxes = dk::ps();
  if (as_json) {
    for (auto& b : boxes)
      std::cout << boost::json::serialize(boost::json::object{{"name", b.name}, {"url", b.url}, {"host", "docker"},
                                                              {"state_dir", b.state_dir}, {"image", b.image},
                                                              {"status", b.status}})
                << "\n";
    return 0;
  }
  std::cout << "URL\tNAME\tHOST\tSTATUS\tIMAGE\n";
  for (auto& b : boxes) std::cout << b.url << "\t" << b.name << "\tdocker\t" << b.status << "\t" << b.image << "\n";
  return 0;
}

}  // namespace sbx::cli
