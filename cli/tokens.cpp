#include "tokens.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include "os/sys.hpp"

namespace sbx::cli {

namespace {
// As shims/common.py and sdk/python normalize it: scheme and host lower-case, no fragment, no
// trailing slash, so "WS://127.0.0.1:7777/" and "ws://127.0.0.1:7777" are one box.
std::string normalized(std::string url) {
  while (!url.empty() && (url.back() == ' ' || url.back() == '\n')) url.pop_back();
  if (auto hash = url.find('#'); hash != std::string::npos) url.erase(hash);
  auto scheme_end = url.find("://");
  size_t host_end = scheme_end == std::string::npos ? 0 : url.find_first_of("/?", scheme_end + 3);
  if (scheme_end != std::string::npos) {
    if (host_end == std::string::npos) host_end = url.size();
    for (size_t i = 0; i < host_end; ++i) url[i] = static_cast<char>(std::tolower(static_cast<unsigned char>(url[i])));
    // The path loses its trailing slashes, the query (if any) stays as it is.
    auto q = url.find('?', host_end);
    std::string path = url.substr(host_end, q == std::string::npos ? std::string::npos : q - host_end);
    while (!path.empty() && path.back() == '/') path.pop_back();
    url = url.substr(0, host_end) + path + (q == std::string::npos ? "" : url.substr(q));
  }
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
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
        c == '_' || c == '~') {
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
