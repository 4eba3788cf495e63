#include "cli/tokens.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>

#include "cli/session.hpp"
#include "os/sys.hpp"

namespace sbx::cli {

namespace {
// As shims/common.py and sdk/python normalize it: scheme and host lower-case, no fragment, no
// trailing slash, so "WS://127.0.0.1:7777/" and "ws://127.0.0.1:7777" are one box.
std::string normalized(std::string url) {
  while (!url.empty() && (url.back() == ' ' || url.back() == '\n')) url.pop_back();
  if (auto hash = url.find('#'); hash != std::string::npos) url.erase(hash);
  auto scheme_end = url.find("://");
  if (scheme_end == std::string::npos) return url;
  size_t host_end = url.find_first_of("/?", scheme_end + 3);
  if (host_end == std::string::npos) host_end = url.size();
  for (size_t i = 0; i < host_end; ++i) url[i] = static_cast<char>(std::tolower(static_cast<unsigned char>(url[i])));
  // The path loses its trailing slashes; the query, if any, stays as it is.
  auto q = url.find('?', host_end);
  std::string path = url.substr(host_end, q == std::string::npos ? std::string::npos : q - host_end);
  while (!path.empty() && path.back() == '/') path.pop_back();
  return url.substr(0, host_end) + path + (q == std::string::npos ? "" : url.substr(q));
}

std::string trim(std::string t) {
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  return t;
}
}  // namespace

namespace {
[[noreturn]] void refuse(const std::string& why) {
  throw std::runtime_error(why + ": refusing to keep tokens there (set HOME or XDG_STATE_HOME)");
}
void own_private_dir(const std::string& dir) {
  if (auto r = os::own_private_dir(dir); !r) refuse(r.error().message);
}
}  // namespace

std::string state_home() {
  auto dir = os::state_home();
  if (!dir) refuse(dir.error().message);
  return *dir;
}

std::string token_dir() {
  std::string home = state_home();
  if (auto r = os::make_dirs(home, 0700); !r) throw std::runtime_error("create " + home + ": " + r.error().message());
  std::string dir = home + "/tokens";
  own_private_dir(dir);
  return dir;
}

std::string token_path(const std::string& url) {
  static const char* kHex = "0123456789ABCDEF";
  std::string name;
  for (unsigned char c : normalized(url)) {
    if (std::isalnum(c) || c == '.' || c == '-' || c == '_' || c == '~') {
      name += static_cast<char>(c);
    } else {
      name += '%';
      name += kHex[c >> 4];
      name += kHex[c & 15];
    }
  }
  return token_dir() + "/" + name;
}

std::string create_token_file(const std::string& path) {
  std::string token = os::random_hex(32);
  // A new file, never one that is there (nor what a symlink there points to).
  os::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) throw std::runtime_error("create token file " + path + ": " + os::last_error().message());
  ::fchmod(fd.get(), 0600);
  if (auto r = os::write_all(fd.get(), token + "\n"); !r)
    throw std::runtime_error("write " + path + ": " + r.error().message());
  return token;
}

std::string find_token(const std::string& url, const std::string& token_file) {
  if (!token_file.empty()) {
    auto t = os::read_file(token_file);
    if (!t) throw std::runtime_error("read --token-file " + token_file + ": " + t.error().message());
    return trim(*t);
  }
  if (auto* e = std::getenv("SANDBOXER_TOKEN"); e && *e) return e;
  std::string p = token_path(url);
  if (auto t = os::read_file(p)) return trim(*t);
  // A box that ended removed the token it stored: where nothing answers either, that is the news.
  if (auto why = unreachable(url))
    throw std::runtime_error("no token for " + url + ", and no box answers there: " + *why +
                             " (a box removes the token it stored when it ends; `sandboxer ps --all` lists the "
                             "stopped ones)");
  throw std::runtime_error("no token for " + url + ": give --token-file FILE or SANDBOXER_TOKEN (none stored at " + p +
                           ")");
}

void save_token(const std::string& url, const std::string& token) {
  auto path = token_path(url);
  if (auto r = os::write_file_atomic(path, token + "\n", 0600); !r)
    throw std::runtime_error("write " + path + ": " + r.error().message());
}

void forget_token(const std::string& url) { ::unlink(token_path(url).c_str()); }

}  // namespace sbx::cli
