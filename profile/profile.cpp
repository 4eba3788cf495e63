#include "profile/profile.hpp"

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdlib>

#include "egress/egress-policy.hpp"
#include "os/sys.hpp"
#include "profile/agent-env.hpp"

namespace sbx::profile {

namespace json = boost::json;

namespace {

// The decimal number that starts `s` (a sign, digits, a point, an exponent), as std::from_chars
// reads one, read with strtod in the C locale this process never changes. libstdc++ 12's
// from_chars for a double calls libm's fesetround, and that one call made the loader map and
// relocate libm at every start of the supervisor (~0.3 MiB resident). Returns where the number
// ends, or nullptr when there is none or it is out of a double's range.
const char* leading_number(std::string_view s, double& v) {
  size_t i = 0;
  auto digits = [&] {
    size_t from = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
    return i - from;
  };
  if (i < s.size() && s[i] == '-') ++i;
  size_t n = digits();
  if (i < s.size() && s[i] == '.') {
    ++i;
    n += digits();
  }
  if (n == 0) return nullptr;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t mantissa_end = i++;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits() == 0) i = mantissa_end;  // "5e" or "5em": the number is 5
  }
  std::string number(s.substr(0, i));
  errno = 0;
  v = std::strtod(number.c_str(), nullptr);
  if (errno == ERANGE) return nullptr;
  return s.data() + i;
}

}  // namespace

int64_t parse_duration_ms(std::string_view s, const std::string& field) {
  double v = 0;
  const char* p = leading_number(s, v);
  if (!p || v < 0 || !std::isfinite(v))
    throw ProfileError(field + ": \"" + std::string(s) + "\" is not a duration (like 10s, 500ms, 2h)");
  std::string_view unit(p, static_cast<size_t>(s.data() + s.size() - p));
  double mult;
  if (unit.empty() || unit == "s")
    mult = 1000;
  else if (unit == "ms")
    mult = 1;
  else if (unit == "m")
    mult = 60000;
  else if (unit == "h")
    mult = 3600000;
  else if (unit == "d")
    mult = 86400000;
  else
    throw ProfileError(field + ": unknown unit \"" + std::string(unit) + "\" (use ms, s, m, h, d)");
  // As parse_size: a double past int64's range does not convert (undefined behaviour).
  double ms = v * mult;
  if (ms > 9.0e18) throw ProfileError(field + ": " + std::string(s) + " is too long");
  return static_cast<int64_t>(ms);
}

int64_t parse_size(std::string_view s, const std::string& field) {
  double v = 0;
  const char* p = leading_number(s, v);
  if (!p || v < 0 || !std::isfinite(v))
    throw ProfileError(field + ": \"" + std::string(s) + "\" is not a size (like 512M, 4G)");
  std::string unit(p, static_cast<size_t>(s.data() + s.size() - p));
  if (unit.size() >= 2 && (unit.ends_with("iB") || unit.ends_with("ib")))
    unit.erase(unit.size() - 2);
  else if (unit.size() == 2 && (unit[1] == 'B' || unit[1] == 'b'))
    unit.pop_back();
  double mult;
  if (unit.empty() || unit == "B" || unit == "b")
    mult = 1;
  else if (unit == "k" || unit == "K")
    mult = 1024.0;
  else if (unit == "m" || unit == "M")
    mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "G")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "T")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    throw ProfileError(field + ": unknown unit \"" + unit + "\" (use K, M, G, T)");
  double bytes = v * mult;
  if (bytes > 9.0e18) throw ProfileError(field + ": " + std::string(s) + " is too large");
  return static_cast<int64_t>(bytes);
}

namespace {

// Walks an object, refusing any key not consumed.
class Fields {
 public:
  Fields(const json::value& v, std::string path) : path_(std::move(path)) {
    if (!v.is_object()) throw ProfileError(where() + ": expected an object");
    obj_ = &v.as_object();
  }
  const json::value* get(std::string_view key) {
    seen_.emplace_back(key);
    return obj_->if_contains(key);
  }
  std::string field(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }
  void done() const {
    for (auto& kv : *obj_) {
      bool known = false;
      for (auto& s : seen_) known |= s == kv.key();
      if (!known) throw ProfileError(field(kv.key()) + ": unknown field");
    }
  }

 private:
  std::string where() const { return path_.empty() ? "profile" : path_; }
  std::string path_;
  const json::object* obj_ = nullptr;
  std::vector<std::string> seen_;
};

std::string as_string(const json::value& v, const std::string& field) {
  if (!v.is_string()) throw ProfileError(field + ": expected a string");
  return std::string(v.as_string());
}

int64_t as_duration(const json::value& v, const std::string& field) {
  if (v.is_string()) return parse_duration_ms(v.as_string(), field);
  if (v.is_number()) {
    double d = v.to_number<double>();
    if (d < 0) throw ProfileError(field + ": must not be negative");
    return static_cast<int64_t>(d * 1000);
  }
  throw ProfileError(field + ": expected a duration string like \"10s\"");
}

int64_t as_size(const json::value& v, const std::string& field) {
  if (v.is_string()) return parse_size(v.as_string(), field);
  if (v.is_int64() && v.as_int64() >= 0) return v.as_int64();
  if (v.is_uint64()) return static_cast<int64_t>(v.as_uint64());
  throw ProfileError(field + ": expected a size like \"512M\" or a number of bytes");
}

int64_t as_count(const json::value& v, const std::string& field, int64_t min, int64_t max) {
  if (!v.is_int64() && !v.is_uint64()) throw ProfileError(field + ": expected a whole number");
  int64_t n = v.is_int64() ? v.as_int64() : static_cast<int64_t>(std::min<uint64_t>(v.as_uint64(), INT64_MAX));
  if (n < min || n > max)
    throw ProfileError(field + ": " + std::to_string(n) + " is impossible (allowed " + std::to_string(min) + ".." +
                       std::to_string(max) + ")");
  return n;
}

std::string as_choice(const json::value& v, const std::string& field, std::initializer_list<const char*> allowed) {
  std::string s = as_string(v, field);
  std::string list;
  for (auto* a : allowed) {
    if (s == a) return s;
    list += std::string(list.empty() ? "" : ", ") + a;
  }
  throw ProfileError(field + ": \"" + s + "\" is not one of " + list);
}

std::vector<std::string> as_string_list(const json::value& v, const std::string& field) {
  if (!v.is_array()) throw ProfileError(field + ": expected a list of strings");
  std::vector<std::string> out;
  size_t i = 0;
  for (auto& e : v.as_array()) out.push_back(as_string(e, field + "[" + std::to_string(i++) + "]"));
  return out;
}

std::vector<std::string> as_path_list(const json::value& v, const std::string& field) {
  auto out = as_string_list(v, field);
  for (size_t i = 0; i < out.size(); ++i)
    if (!out[i].starts_with("/"))
      throw ProfileError(field + "[" + std::to_string(i) + "]: \"" + out[i] + "\" is not an absolute path");
  return out;
}

void parse_user(Profile& p, const json::value& v) {
  const std::string f = "isolation.user";
  if (v.is_string()) {
    std::string s(v.as_string());
    if (s == "root") {
      p.isolation.uid = p.isolation.gid = 0;
      return;
    }
    if (s == "nobody") {
      p.isolation.uid = p.isolation.gid = 65534;
      return;
    }
    auto colon = s.find(':');
    uint32_t uid = 0, gid = 0;
    auto a = std::from_chars(s.data(), s.data() + (colon == std::string::npos ? s.size() : colon), uid);
    bool ok = a.ec == std::errc() && a.ptr == s.data() + (colon == std::string::npos ? s.size() : colon);
    gid = uid;
    if (ok && colon != std::string::npos) {
      auto b = std::from_chars(s.data() + colon + 1, s.data() + s.size(), gid);
      ok = b.ec == std::errc() && b.ptr == s.data() + s.size() && colon + 1 < s.size();
    }
    if (!ok) throw ProfileError(f + ": \"" + s + "\" is not root, nobody or UID[:GID]");
    p.isolation.uid = uid;
    p.isolation.gid = gid;
    return;
  }
  if (v.is_int64() || v.is_uint64()) {
    p.isolation.uid = p.isolation.gid = static_cast<uint32_t>(as_count(v, f, 0, 4294967294LL));
    return;
  }
  if (v.is_null()) {
    p.isolation.uid.reset();
    p.isolation.gid.reset();
    return;
  }
  if (!v.is_object())
    throw ProfileError(f + ": expected \"root\", \"nobody\", \"UID:GID\", a uid or {\"uid\": N, \"gid\": N}");
  Fields u(v, f);
  const json::value* uv = u.get("uid");
  const json::value* gv = u.get("gid");
  u.done();
  if (!uv) throw ProfileError(f + ".uid: required");
  p.isolation.uid = static_cast<uint32_t>(as_count(*uv, f + ".uid", 0, 4294967294LL));
  p.isolation.gid = gv ? static_cast<uint32_t>(as_count(*gv, f + ".gid", 0, 4294967294LL)) : *p.isolation.uid;
}

// ---- network and credentials ----
int64_t as_int(const json::value& v, const std::string& field, int64_t lo, int64_t hi) {
  if (!v.is_int64() && !v.is_uint64()) throw ProfileError(field + ": expected an integer");
  int64_t n = v.is_int64() ? v.as_int64() : static_cast<int64_t>(std::min<uint64_t>(v.as_uint64(), INT64_MAX));
  if (n < lo || n > hi)
    throw ProfileError(field + ": must be between " + std::to_string(lo) + " and " + std::to_string(hi));
  return n;
}

bool is_token(std::string_view s, std::string_view extra) {
  if (s.empty()) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          extra.find(c) != std::string_view::npos))
      return false;
  return true;
}

void parse_network(NetworkPolicy& n, const json::value& v) {
  // "network": "none" is short for {"mode": "none"}.
  if (v.is_string()) {
    auto s = as_choice(v, "network", {"none", "proxy", "host"});
    n.mode = s == "none"    ? NetworkPolicy::Mode::None
             : s == "proxy" ? NetworkPolicy::Mode::Proxy
                            : NetworkPolicy::Mode::Host;
    return;
  }
  if (!v.is_object()) throw ProfileError("network: expected \"none\", \"proxy\", \"host\" or an object with a mode");
  Fields f(v, "network");
  if (auto* m = f.get("mode")) {
    auto s = as_string(*m, "network.mode");
    if (s == "host")
      n.mode = NetworkPolicy::Mode::Host;
    else if (s == "none")
      n.mode = NetworkPolicy::Mode::None;
    else if (s == "proxy")
      n.mode = NetworkPolicy::Mode::Proxy;
    else
      throw ProfileError("network.mode: \"" + s + "\" is not one of host, none, proxy");
  }
  if (auto* a = f.get("allow")) n.allow = as_string_list(*a, "network.allow");
  if (auto* d = f.get("deny")) n.deny = as_string_list(*d, "network.deny");
  if (auto* c = f.get("allow_cidrs")) n.allow_cidrs = as_string_list(*c, "network.allow_cidrs");
  if (auto* r = f.get("resolve")) {
    if (!r->is_object()) throw ProfileError("network.resolve: expected an object of host: address");
    n.resolve.clear();
    for (auto& kv : r->as_object()) {
      std::string field = "network.resolve." + std::string(kv.key());
      auto h = egress::canonical_host(kv.key());
      if (!h || h->is_ip) throw ProfileError(field + ": not a host name");
      auto addr = as_string(kv.value(), field);
      auto ip = egress::canonical_host(addr);
      if (!ip || !ip->is_ip) throw ProfileError(field + ": \"" + addr + "\" is not an IP address");
      n.resolve[h->name] = ip->name;
    }
  }
  if (auto* x = f.get("proxy_port")) n.proxy_port = static_cast<int>(as_int(*x, "network.proxy_port", 1, 65535));
  if (n.proxy_port == 53) throw ProfileError("network.proxy_port: 53 is the broker's DNS port");
  if (auto* x = f.get("max_header_bytes")) n.max_header_bytes = as_int(*x, "network.max_header_bytes", 1024, 1 << 20);
  if (auto* x = f.get("max_body_bytes")) n.max_body_bytes = as_int(*x, "network.max_body_bytes", 0, int64_t{1} << 30);
  if (auto* x = f.get("timeout")) n.timeout_ms = as_duration(*x, "network.timeout");
  f.done();
  try {
    egress::HostPolicy check(n.allow, n.deny);
    egress::AddressPolicy addresses(n.allow_cidrs);
  } catch (const std::invalid_argument& e) {
    throw ProfileError(std::string("network.") + e.what());
  }
}

Credential parse_credential(const json::value& v, const std::string& path) {
  Credential c;
  Fields f(v, path);
  auto* name = f.get("name");
  if (!name) throw ProfileError(path + ".name: required");
  c.name = as_string(*name, path + ".name");
  if (!is_token(c.name, "-_")) throw ProfileError(path + ".name: use letters, digits, - and _");
  if (auto* s = f.get("source")) {
    Fields sf(*s, path + ".source");
    if (auto* x = sf.get("file")) c.source_file = as_string(*x, path + ".source.file");
    if (auto* x = sf.get("env")) c.source_env = as_string(*x, path + ".source.env");
    sf.done();
  }
  if (c.source_file.empty() == c.source_env.empty())
    throw ProfileError(path + ".source: give exactly one of file or env");
  auto* b = f.get("bind");
  if (!b) throw ProfileError(path + ".bind: required (the only destination that gets the secret)");
  Fields bf(*b, path + ".bind");
  if (auto* x = bf.get("scheme")) c.scheme = as_string(*x, path + ".bind.scheme");
  if (c.scheme != "https") throw ProfileError(path + ".bind.scheme: only https (the secret never travels in clear)");
  auto* host = bf.get("host");
  if (!host) throw ProfileError(path + ".bind.host: required");
  auto h = egress::canonical_host(as_string(*host, path + ".bind.host"));
  if (!h) throw ProfileError(path + ".bind.host: " + h.error().message);
  c.host = h->name;
  if (auto* x = bf.get("port")) c.port = static_cast<int>(as_int(*x, path + ".bind.port", 1, 65535));
  if (auto* x = bf.get("path_prefix")) c.path_prefix = as_string(*x, path + ".bind.path_prefix");
  if (c.path_prefix.ends_with('/')) c.path_prefix.pop_back();
  if (!c.path_prefix.empty() && c.path_prefix.front() != '/')
    throw ProfileError(path + ".bind.path_prefix: must start with /");
  bf.done();
  if (auto* i = f.get("inject")) {
    Fields inf(*i, path + ".inject");
    if (auto* x = inf.get("header")) c.header = as_string(*x, path + ".inject.header");
    if (auto* x = inf.get("format")) c.format = as_string(*x, path + ".inject.format");
    inf.done();
  }
  if (!is_token(c.header, "-_")) throw ProfileError(path + ".inject.header: not a header name");
  if (c.format.find("{}") == std::string::npos)
    throw ProfileError(path + ".inject.format: must contain {} (the secret)");
  for (char& ch : c.header) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  c.placeholder = "sbx-placeholder-" + c.name;
  if (auto* x = f.get("placeholder")) c.placeholder = as_string(*x, path + ".placeholder");
  if (c.placeholder.size() < 8 || !is_token(c.placeholder, "-_."))
    throw ProfileError(path + ".placeholder: at least 8 characters of letters, digits, - _ .");
  if (auto* x = f.get("placeholder_env")) c.placeholder_env = as_string(*x, path + ".placeholder_env");
  if (auto* x = f.get("base_url_env")) c.base_url_env = as_string(*x, path + ".base_url_env");
  for (auto* e : {&c.placeholder_env, &c.base_url_env})
    if (!e->empty() && !is_token(*e, "_"))
      throw ProfileError(path + ": \"" + *e + "\" is not an environment variable name");
  if (auto* x = f.get("ca_file")) c.ca_file = as_string(*x, path + ".ca_file");
  f.done();
  return c;
}

void parse_credentials(std::vector<Credential>& out, const json::value& v) {
  if (!v.is_array()) throw ProfileError("credentials: expected a list");
  out.clear();
  for (size_t i = 0; i < v.as_array().size(); ++i) {
    auto c = parse_credential(v.as_array()[i], "credentials[" + std::to_string(i) + "]");
    for (auto& o : out)
      if (o.name == c.name)
        throw ProfileError("credentials[" + std::to_string(i) + "].name: \"" + c.name + "\" is used twice");
    out.push_back(std::move(c));
  }
}

// Rules that span both sections, checked after every parse and override.
void check_network(const Profile& p) {
  if (p.credentials.empty()) return;
  if (p.network.mode != NetworkPolicy::Mode::Proxy)
    throw ProfileError("credentials: need network.mode \"proxy\" (only the broker may hold them)");
  egress::HostPolicy policy(p.network.allow, p.network.deny);
  for (auto& c : p.credentials) {
    egress::CanonicalHost h{c.host, false};
    h.is_ip = egress::canonical_host(c.host)->is_ip;
    auto ok = policy.allows(h);
    std::string why = ok ? "" : ok.error().message;
    if (why.starts_with("denied")) throw ProfileError("credentials." + c.name + ".bind.host: " + c.host + " is " + why);
  }
}
// ---- end network and credentials ----

// "env": {"NAME": "value", ...}; merged over what is there (so `--set env.NAME=value` adds one),
// null removes a name.
void parse_env(std::map<std::string, std::string>& env, const json::value& v) {
  if (!v.is_object()) throw ProfileError("env: expected an object of NAME: \"value\"");
  for (auto& kv : v.as_object()) {
    std::string name(kv.key());
    if (auto ok = check_env_name(name); !ok) throw ProfileError("env." + name + ": " + ok.error().message);
    if (kv.value().is_null()) {
      env.erase(name);
      continue;
    }
    std::string value = as_string(kv.value(), "env." + name);
    if (value.find('\0') != std::string::npos) throw ProfileError("env." + name + ": the value holds a NUL byte");
    env[name] = std::move(value);
  }
}

// "checkpoint": the box's own snapshots of its main branch (profile.hpp, Profile::Checkpoint).
void parse_checkpoint(Profile& p, const json::value& v) {
  Fields f(v, "checkpoint");
  auto& c = p.checkpoint;
  if (auto* x = f.get("every")) {
    c.every_ms = as_duration(*x, "checkpoint.every");
    // A live checkpoint stops the agent for a moment: more often than each second it would hardly run.
    if (c.every_ms != 0 && c.every_ms < 1000) throw ProfileError("checkpoint.every: at least 1s (or 0 for none)");
  }
  if (auto* x = f.get("keep")) c.keep = as_count(*x, "checkpoint.keep", 1, 4095);
  if (auto* x = f.get("probe_timeout")) {
    c.probe_timeout_ms = as_duration(*x, "checkpoint.probe_timeout");
    if (c.probe_timeout_ms < 1000 || c.probe_timeout_ms > 600000)
      throw ProfileError("checkpoint.probe_timeout: between 1s and 10m");
  }
  for (auto [key, flag] : {std::pair{"on_stop", &c.on_stop}, std::pair{"on_idle", &c.on_idle}})
    if (auto* x = f.get(key)) {
      if (!x->is_bool()) throw ProfileError(std::string("checkpoint.") + key + ": expected true or false");
      *flag = x->as_bool();
    }
  // The profile says why it chose what it chose; the supervisor does not read it.
  if (auto* x = f.get("why")) as_string(*x, "checkpoint.why");
  f.done();
}

// The periodic snapshots must fit in the store beside one being taken (pruning follows it).
void check_checkpoint(const Profile& p) {
  if (!p.checkpoint.enabled()) return;
  if (p.checkpoint.keep >= p.resources.snapshots)
    throw ProfileError("checkpoint.keep: " + std::to_string(p.checkpoint.keep) +
                       " snapshots do not fit in resources.snapshots (" + std::to_string(p.resources.snapshots) +
                       "): keep must be below it, one more is taken before the oldest goes");
}

void parse_into(Profile& p, const json::value& doc) {
  Fields top(doc, "");
  if (auto* v = top.get("name")) p.name = as_string(*v, "name");
  if (auto* v = top.get("version")) {
    if (!v->is_int64() || v->as_int64() != 1) throw ProfileError("version: this supervisor reads profile version 1");
  }
  top.get("description");
  if (auto* r = top.get("resources")) {
    Fields f(*r, "resources");
    if (auto* v = f.get("memory")) {
      p.resources.memory = as_size(*v, "resources.memory");
      if (p.resources.memory != 0 && p.resources.memory < (8 << 20))
        throw ProfileError("resources.memory: " + std::to_string(p.resources.memory) +
                           " bytes is impossible (at least 8M, or 0 for no ceiling)");
    }
    if (auto* v = f.get("cpus")) {
      if (!v->is_number()) throw ProfileError("resources.cpus: expected a number of cores like 0.5");
      double c = v->to_number<double>();
      if (!(c >= 0) || c > 4096 || (c > 0 && c < 0.01))
        throw ProfileError("resources.cpus: " + json::serialize(*v) +
                           " is impossible (0.01..4096, or 0 for no ceiling)");
      p.resources.cpus = c;
    }
    if (auto* v = f.get("pids")) {
      p.resources.pids = as_count(*v, "resources.pids", 0, 4194304);
      if (p.resources.pids == 1) throw ProfileError("resources.pids: 1 is impossible (ns-init and the agent need 2)");
    }
    if (auto* v = f.get("open_files")) {
      p.resources.open_files = as_count(*v, "resources.open_files", 0, 1LL << 30);
      if (p.resources.open_files != 0 && p.resources.open_files < 16)
        throw ProfileError("resources.open_files: " + std::to_string(p.resources.open_files) +
                           " is impossible (at least 16)");
    }
    if (auto* v = f.get("disk")) {
      p.resources.disk = as_size(*v, "resources.disk");
      if (p.resources.disk != 0 && p.resources.disk < (1 << 20))
        throw ProfileError("resources.disk: " + std::to_string(p.resources.disk) +
                           " bytes is impossible (at least 1M)");
    }
    if (auto* v = f.get("timeout")) p.resources.timeout_ms = as_duration(*v, "resources.timeout");
    if (auto* v = f.get("idle")) p.resources.idle_ms = as_duration(*v, "resources.idle");
    if (auto* v = f.get("grace")) p.resources.grace_ms = as_duration(*v, "resources.grace");
    if (auto* v = f.get("pids_grace")) p.resources.pids_grace_ms = as_duration(*v, "resources.pids_grace");
    // Each copy runs with the full ceilings, so these bound what one box can take (0: none allowed).
    if (auto* v = f.get("copies")) p.resources.copies = as_count(*v, "resources.copies", 0, 1024);
    if (auto* v = f.get("snapshots")) p.resources.snapshots = as_count(*v, "resources.snapshots", 0, 4096);
    if (auto* v = f.get("ksm")) {
      if (!v->is_bool()) throw ProfileError("resources.ksm: must be true or false");
      p.resources.ksm = v->as_bool();
    }
    f.done();
  }
  if (auto* r = top.get("isolation")) {
    Fields f(*r, "isolation");
    if (auto* v = f.get("level"))
      p.isolation.level = as_choice(*v, "isolation.level", {"process", "container", "gvisor", "microvm"});
    if (auto* v = f.get("namespaces")) {
      if (v->is_bool()) {
        p.isolation.namespaces = v->as_bool();
      } else if (v->is_array()) {
        // The branch always gets pid and mount together (criu needs both); nothing else yet.
        auto names = as_string_list(*v, "isolation.namespaces");
        bool pid = false, mnt = false;
        for (auto& n : names) {
          if (n == "pid")
            pid = true;
          else if (n == "mount")
            mnt = true;
          else
            throw ProfileError("isolation.namespaces: \"" + n +
                               "\" is not supported (pid and mount; network is set by \"network\")");
        }
        if (pid != mnt) throw ProfileError("isolation.namespaces: pid and mount go together (or neither)");
        p.isolation.namespaces = pid;
      } else {
        throw ProfileError("isolation.namespaces: expected true, false or a list like [\"pid\", \"mount\"]");
      }
    }
    if (auto* v = f.get("without_namespaces"))
      p.isolation.without_namespaces = as_choice(*v, "isolation.without_namespaces", {"auto", "refuse", "run"});
    if (auto* v = f.get("user")) parse_user(p, *v);
    if (auto* v = f.get("capabilities")) {
      if (v->is_null())
        p.isolation.capabilities.reset();
      else
        p.isolation.capabilities = as_string_list(*v, "isolation.capabilities");
      // Names are checked against libcap's list by the policy (policy.cpp), which knows them.
    }
    if (auto* v = f.get("landlock")) {
      if (v->is_null() || (v->is_bool() && !v->as_bool())) {
        p.isolation.landlock.reset();
      } else {
        Fields l(*v, "isolation.landlock");
        Profile::Isolation::Landlock ll;
        if (auto* x = l.get("rw")) ll.rw = as_path_list(*x, "isolation.landlock.rw");
        if (auto* x = l.get("ro")) ll.ro = as_path_list(*x, "isolation.landlock.ro");
        l.done();
        p.isolation.landlock = std::move(ll);
      }
    }
    if (auto* v = f.get("masks")) p.isolation.masks = as_path_list(*v, "isolation.masks");
    if (auto* v = f.get("seccomp")) {
      p.isolation.seccomp = as_string(*v, "isolation.seccomp");
      const auto& s = p.isolation.seccomp;
      if (s != "default" && s != "none" && s.find('/') == std::string::npos && !s.ends_with(".json"))
        throw ProfileError("isolation.seccomp: \"" + s + "\" is not default, none or a policy file path");
    }
    f.done();
  }
  if (auto* n = top.get("network")) parse_network(p.network, *n);  // network and credentials
  if (auto* c = top.get("credentials")) parse_credentials(p.credentials, *c);
  if (auto* e = top.get("env")) parse_env(p.env, *e);
  if (auto* v = top.get("persistence"))
    p.persistence = as_choice(*v, "persistence", {"ephemeral", "persistent", "checkpoint"});
  if (auto* j = top.get("journal")) {
    Fields f(*j, "journal");
    if (auto* v = f.get("disk_cap")) {
      p.journal.disk_cap = as_size(*v, "journal.disk_cap");
      if (p.journal.disk_cap < 0) throw ProfileError("journal.disk_cap: negative");
    }
    if (auto* v = f.get("queue")) {
      p.journal.queue = as_size(*v, "journal.queue");
      if (p.journal.queue < 4096) throw ProfileError("journal.queue: at least 4KiB");
    }
    f.done();
  }
  if (auto* m = top.get("metrics")) {
    Fields f(*m, "metrics");
    if (auto* v = f.get("interval")) {
      p.metrics.interval_ms = as_duration(*v, "metrics.interval");
      if (p.metrics.interval_ms != 0 && p.metrics.interval_ms < 100)
        throw ProfileError("metrics.interval: at least 100ms (or 0 for none)");
    }
    f.done();
  }
  if (auto* c = top.get("checkpoint")) parse_checkpoint(p, *c);
  top.done();
  check_network(p);
  check_checkpoint(p);
}

}  // namespace

namespace {
void merge_document(json::object& into, const json::object& from) {
  for (auto& kv : from) {
    auto* cur = into.if_contains(kv.key());
    if (cur && cur->is_object() && kv.value().is_object())
      merge_document(cur->as_object(), kv.value().as_object());
    else
      into[kv.key()] = kv.value();
  }
}
}  // namespace

Profile parse_profile(std::string_view text) {
  boost::system::error_code ec;
  auto doc = json::parse(text, ec);
  if (ec) throw ProfileError("profile: not valid JSON: " + ec.message());
  Profile p;
  parse_into(p, doc);
  if (doc.is_object()) p.document = json::serialize(doc);
  return p;
}

ProfileSource find_profile(const std::string& name_or_path) {
  if (name_or_path.find('/') != std::string::npos || name_or_path.ends_with(".json")) {
    auto text = os::read_file(name_or_path);
    if (!text) throw ProfileError("profile " + name_or_path + ": " + text.error().message());
    return {name_or_path, std::move(*text)};
  }
  std::vector<std::string> candidates;
  if (auto* d = std::getenv("SANDBOXER_PROFILE_DIR"))
    candidates.push_back(std::string(d) + "/" + name_or_path + ".json");
  for (auto& dir : os::shipped_dirs("profiles")) candidates.push_back(dir + "/" + name_or_path + ".json");
  for (auto& c : candidates)
    if (auto text = os::read_file(c)) return {c, std::move(*text)};
  // A binary copied on its own (a build tree moved, a container without /usr/share) still has
  // the shipped profiles.
  for (auto& b : builtin_profiles())
    if (name_or_path == b.name) return {std::string("built-in ") + b.name, b.text};
  throw ProfileError("profile \"" + name_or_path + "\": not found (looked in " + candidates.front() + " and " +
                     std::to_string(candidates.size() - 1) + " more places, and among the built-in profiles)");
}

Profile load_profile(const std::string& name_or_path) {
  auto src = find_profile(name_or_path);
  try {
    return parse_profile(src.text);
  } catch (const ProfileError& e) {
    throw ProfileError(src.where + ": " + e.what());
  }
}

void apply_override(Profile& p, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) throw ProfileError("--set " + assignment + ": expected FIELD=VALUE");
  std::string path = assignment.substr(0, eq);
  std::string raw = assignment.substr(eq + 1);
  boost::system::error_code ec;
  json::value v = json::parse(raw, ec);
  if (ec) v = json::string(raw);
  // An environment variable's value is a string even when it reads as JSON (PORT=8080).
  if (path.starts_with("env.") && !v.is_null()) v = json::string(raw);
  // Build {"a":{"b":v}} and parse it over the current profile: one code path for validation.
  json::value doc = v;
  size_t end = path.size();
  for (;;) {
    size_t dot = path.rfind('.', end - 1);
    std::string key =
        path.substr(dot == std::string::npos ? 0 : dot + 1, end - (dot == std::string::npos ? 0 : dot + 1));
    doc = json::object{{key, doc}};
    if (dot == std::string::npos) break;
    end = dot;
  }
  try {
    parse_into(p, doc);
  } catch (const ProfileError& e) {
    throw ProfileError(std::string("--set ") + assignment + ": " + e.what());
  }
  // The document too, merged as parse_into merges: objects field by field, anything else replaced.
  auto whole = json::parse(p.document, ec);
  if (ec || !whole.is_object()) whole = json::object();
  merge_document(whole.as_object(), doc.as_object());
  p.document = json::serialize(whole);
}

}  // namespace sbx::profile
