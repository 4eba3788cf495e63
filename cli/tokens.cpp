#include "tokens.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>

#include "os/sys.hpp"

namespace sbx::cli {

std::string token_dir() {
  std::string base;
  if (auto* x = std::getenv("XDG_STATE_HOME"); x && *x) base = x;
  else if (auto* h = std::getenv("HOME"); h && *h) base = std::string(h) + "/.local/state";
  else base = "/tmp";
  std::string dir = base + "/sandboxer/tokens";
  (void)os::make_dirs(dir, 0700);
  ::chmod(dir.c_str(), 0700);
  return dir;
}

std::string token_path(const std::string& url) {
  std::string key;
  for (char c : url) key.push_back(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ? c : '_');
  while (!key.empty() && key.back() == '_') key.pop_back();
  return token_dir() + "/" + key;
}

std::string create_token_file(const std::string& path) {
  std::string token = os::random_hex(32);
  os::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!fd) throw std::runtime_error("create token file " + path + ": " + os::last_error().message());
  ::fchmod(fd.get(), 0600);
  if (auto r = os::write_all(fd.get(), token + "\n"); !r) throw std::runtime_error("write " + path + ": " + r.error().message());
  return token;
}

std::string find_token(const std::string& url, const std::string& token_file) {
  auto trim = [](std::string t) {
    while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
    return t;
  };
  if (!token_file.empty()) {
    auto t = os::read_file(token_file);
    if (!t) throw std::runtime_error("read --token-file " + token_file + ": " + t.error().message());
    return trim(*t);
  }
  if (auto* e = std::getenv("SANDBOXER_TOKEN"); e && *e) return e;
  std::string p = token_path(url);
  if (auto t = os::read_file(p)) return trim(*t);
  throw std::runtime_error("no token for " + url + ": give --token-file FILE or SANDBOXER_TOKEN (none stored at " + p + ")");
}

std::string take_token_file(std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--") break;
    if (args[i] == "--token-file") {
      if (i + 1 >= args.size()) throw std::invalid_argument("--token-file needs a value");
      std::string f = args[i + 1];
      args.erase(args.begin() + static_cast<long>(i), args.begin() + static_cast<long>(i) + 2);
      return f;
    }
  }
  return {};
}

}  // namespace sbx::cli
