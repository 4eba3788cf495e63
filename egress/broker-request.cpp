#include "egress/broker-request.hpp"

#include <cctype>

namespace sbx::egress {

namespace {
bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}
}  // namespace

bool split_authority(std::string_view a, std::string& host, int& port, int default_port) {
  port = default_port;
  size_t colon = std::string_view::npos;
  if (a.starts_with('[')) {
    size_t close = a.find(']');
    if (close == std::string_view::npos) return false;
    host = std::string(a.substr(0, close + 1));
    if (close + 1 < a.size()) {
      if (a[close + 1] != ':') return false;
      colon = close + 1;
    }
  } else {
    colon = a.rfind(':');
    host = std::string(a.substr(0, colon));
  }
  if (colon != std::string_view::npos) {
    auto p = a.substr(colon + 1);
    if (p.empty() || p.size() > 5) return false;
    port = 0;
    for (char c : p) {
      if (c < '0' || c > '9') return false;
      port = port * 10 + (c - '0');
    }
    if (port < 1 || port > 65535) return false;
  }
  return !host.empty() && host.find('@') == std::string::npos;
}

bool escapes_prefix(std::string_view path) {
  path = path.substr(0, path.find('?'));
  std::string lower(path);
  for (auto& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (auto* bad : {"%2e", "%2f", "%5c", "\\"})
    if (lower.find(bad) != std::string::npos) return true;
  size_t start = 0;
  while (start <= lower.size()) {
    size_t slash = lower.find('/', start);
    auto seg = std::string_view(lower).substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (seg == "." || seg == "..") return true;
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return false;
}

bool coded(std::string_view value, bool transfer) {
  while (!value.empty()) {
    auto comma = value.find(',');
    auto token = value.substr(0, comma);
    while (!token.empty() && (token.front() == ' ' || token.front() == '\t')) token.remove_prefix(1);
    while (!token.empty() && (token.back() == ' ' || token.back() == '\t')) token.remove_suffix(1);
    if (!token.empty() && !iequals(token, "identity") && !(transfer && iequals(token, "chunked"))) return true;
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return false;
}

Target route_target(std::string_view target, int proxy_port) {
  Target t;
  std::string local;
  if (target.starts_with("http://") || target.starts_with("HTTP://")) {
    auto rest = target.substr(7);
    size_t slash = rest.find_first_of("/?");
    t.authority = std::string(rest.substr(0, slash));
    t.path = slash == std::string_view::npos ? "/" : std::string(rest.substr(slash));
    if (t.path.front() == '?') t.path = "/" + t.path;
    std::string h;
    int port;
    // A client that sends even the broker's own URL through the proxy reaches the credentials.
    if (!split_authority(t.authority, h, port, 80) || port != proxy_port ||
        !(h == "127.0.0.1" || iequals(h, "localhost"))) {
      t.kind = Target::Kind::Plain;
      return t;
    }
    local = t.path;
    target = local;
    t.own_url = true;
  }
  if (!target.starts_with('/')) return t;
  auto name_end = target.find_first_of("/?", 1);
  t.kind = Target::Kind::Credential;
  t.credential =
      std::string(target.substr(1, name_end == std::string_view::npos ? std::string_view::npos : name_end - 1));
  t.rest = name_end == std::string_view::npos ? "/" : std::string(target.substr(name_end));
  if (t.rest.front() == '?') t.rest = "/" + t.rest;
  return t;
}

}  // namespace sbx::egress
