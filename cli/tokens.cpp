#include "tokens.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>

#include "os/sys.hpp"

namespace sbx::cli {

namespace {
// "ws://127.0.0.1:7300/" and "ws://127.0.0.1:7300" are one box.
std::string normalized(std::string url) {
  while (url.size() > 1 && url.back() == '/') url.pop_back();
  return url;
}
}  // namespace

std::string state_home() {
  if (auto* x = std::getenv("XDG_STATE_HOME"); x && *x) return std::string(x) + "/sandboxer";
  if (auto* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.local/state/sandboxer";
  return "/var/lib/sandboxer";
}

std::string token_dir() { return state_home() + "/tokens"; }

std::string token_path(const std::string& url) {
  static const char* kHex = "0123456789ABCDEF";
  std::string name;
  for (unsigned char c : normalized(url)) {
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-') {
      name += static_cast<char>(c);
    } else {
      name += '%';
      name += kHex[c >> 4];
      name += kHex[c & 15];
    }
  }
  return token_dir() + "/" + name;
}

void save_token(const std::string& url, const std::string& token) {
  if (auto r = os::make_dirs(token_dir(), 0700); !r)
    throw std::runtime_error("create " + token_dir() + ": " + r.error().message());
  ::chmod(token_dir().c_str(), 0700);
  auto path = token_path(url);
  if (auto r = os::write_file_atomic(path, token + "\n", 0600); !r)
    throw std::runtime_error("write " + path + ": " + r.error().message());
}

std::optional<std::string> load_token(const std::string& url) {
  auto t = os::read_file(token_path(url));
  if (!t) return std::nullopt;
  std::string s = *t;
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  if (s.empty()) return std::nullopt;
  return s;
}

void forget_token(const std::string& url) { ::unlink(token_path(url).c_str()); }

}  // namespace sbx::cli
