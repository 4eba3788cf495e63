#include "profile.hpp"

#include <unistd.h>

#include <boost/json.hpp>
#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>

#include "os/sys.hpp"

namespace sbx::supervisor {

namespace json = boost::json;

int64_t parse_duration_ms(std::string_view s, const std::string& field) {
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || v < 0 || !std::isfinite(v))
    throw ProfileError(field + ": \"" + std::string(s) + "\" is not a duration (like 10s, 500ms, 2h)");
  std::string_view unit(p, static_cast<size_t>(s.data() + s.size() - p));
  double mult;
  if (unit.empty() || unit == "s") mult = 1000;
  else if (unit == "ms") mult = 1;
  else if (unit == "m") mult = 60000;
  else if (unit == "h") mult = 3600000;
  else if (unit == "d") mult = 86400000;
  else throw ProfileError(field + ": unknown unit \"" + std::string(unit) + "\" (use ms, s, m, h, d)");
  return static_cast<int64_t>(v * mult);
}

int64_t parse_size(std::string_view s, const std::string& field) {
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || v < 0 || !std::isfinite(v))
    throw ProfileError(field + ": \"" + std::string(s) + "\" is not a size (like 512M, 4G)");
  std::string unit(p, static_cast<size_t>(s.data() + s.size() - p));
  if (unit.size() >= 2 && (unit.ends_with("iB") || unit.ends_with("ib"))) unit.erase(unit.size() - 2);
  else if (unit.size() == 2 && (unit[1] == 'B' || unit[1] == 'b')) unit.pop_back();
  double mult;
  if (unit.empty() || unit == "B" || unit == "b") mult = 1;
  else if (unit == "k" || unit == "K") mult = 1024.0;
  else if (unit == "m" || unit == "M") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "G") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "T") mult = 1024.0 * 1024 * 1024 * 1024;
  else throw ProfileError(field + ": unknown unit \"" + unit + "\" (use K, M, G, T)");
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
  std::string field(std::string_view key) const { return path_.empty() ? std::string(key) : path_ + "." + std::string(key); }
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
  if (!v.is_object()) throw ProfileError(f + ": expected \"root\", \"nobody\", \"UID:GID\", a uid or {\"uid\": N, \"gid\": N}");
  Fields u(v, f);
  const json::value* uv = u.get("uid");
  const json::value* gv = u.get("gid");
  u.done();
  if (!uv) throw ProfileError(f + ".uid: required");
  p.isolation.uid = static_cast<uint32_t>(as_count(*uv, f + ".uid", 0, 4294967294LL));
  p.isolation.gid = gv ? static_cast<uint32_t>(as_count(*gv, f + ".gid", 0, 4294967294LL)) : *p.isolation.uid;
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
        throw ProfileError("resources.cpus: " + json::serialize(*v) + " is impossible (0.01..4096, or 0 for no ceiling)");
      p.resources.cpus = c;
    }
    if (auto* v = f.get("pids")) {
      p.resources.pids = as_count(*v, "resources.pids", 0, 4194304);
      if (p.resources.pids == 1) throw ProfileError("resources.pids: 1 is impossible (ns-init and the agent need 2)");
    }
    if (auto* v = f.get("open_files")) {
      p.resources.open_files = as_count(*v, "resources.open_files", 0, 1LL << 30);
      if (p.resources.open_files != 0 && p.resources.open_files < 16)
        throw ProfileError("resources.open_files: " + std::to_string(p.resources.open_files) + " is impossible (at least 16)");
    }
    if (auto* v = f.get("disk")) {
      p.resources.disk = as_size(*v, "resources.disk");
      if (p.resources.disk != 0 && p.resources.disk < (1 << 20))
        throw ProfileError("resources.disk: " + std::to_string(p.resources.disk) + " bytes is impossible (at least 1M)");
    }
    if (auto* v = f.get("timeout")) p.resources.timeout_ms = as_duration(*v, "resources.timeout");
    if (auto* v = f.get("idle")) p.resources.idle_ms = as_duration(*v, "resources.idle");
    if (auto* v = f.get("grace")) p.resources.grace_ms = as_duration(*v, "resources.grace");
    if (auto* v = f.get("pids_grace")) p.resources.pids_grace_ms = as_duration(*v, "resources.pids_grace");
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
          if (n == "pid") pid = true;
          else if (n == "mount") mnt = true;
          else throw ProfileError("isolation.namespaces: \"" + n + "\" is not supported (pid and mount; network is set by \"network\")");
        }
        if (pid != mnt) throw ProfileError("isolation.namespaces: pid and mount go together (or neither)");
        p.isolation.namespaces = pid;
      } else {
        throw ProfileError("isolation.namespaces: expected true, false or a list like [\"pid\", \"mount\"]");
      }
    }
    if (auto* v = f.get("user")) parse_user(p, *v);
    if (auto* v = f.get("capabilities")) {
      if (v->is_null()) p.isolation.capabilities.reset();
      else p.isolation.capabilities = as_string_list(*v, "isolation.capabilities");
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
    if (auto* v = f.get("seccomp")) {
      p.isolation.seccomp = as_string(*v, "isolation.seccomp");
      const auto& s = p.isolation.seccomp;
      if (s != "default" && s != "none" && s.find('/') == std::string::npos && !s.ends_with(".json"))
        throw ProfileError("isolation.seccomp: \"" + s + "\" is not default, none or a policy file path");
    }
    f.done();
  }
  if (auto* v = top.get("network")) p.network = as_choice(*v, "network", {"none", "proxy", "host"});
  if (auto* v = top.get("persistence"))
    p.persistence = as_choice(*v, "persistence", {"ephemeral", "persistent", "checkpoint"});
  if (auto* j = top.get("journal")) {
    Fields f(*j, "journal");
    if (auto* v = f.get("disk_cap")) {
      p.journal.disk_cap = as_size(*v, "journal.disk_cap");
      if (p.journal.disk_cap < 0) throw ProfileError("journal.disk_cap: negative");
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
  top.done();
}

}  // namespace

Profile parse_profile(std::string_view text) {
  boost::system::error_code ec;
  auto doc = json::parse(text, ec);
  if (ec) throw ProfileError("profile: not valid JSON: " + ec.message());
  Profile p;
  parse_into(p, doc);
  return p;
}

Profile load_profile(const std::string& name_or_path) {
  std::vector<std::string> candidates;
  if (name_or_path.find('/') != std::string::npos || name_or_path.ends_with(".json")) {
    candidates.push_back(name_or_path);
  } else {
    if (auto* d = std::getenv("SANDBOXER_PROFILE_DIR")) candidates.push_back(std::string(d) + "/" + name_or_path + ".json");
    // Beside the binary in a build tree or bundle, then the system locations.
    char exe[4096];
    ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
      std::string dir(exe, static_cast<size_t>(n));
      dir = dir.substr(0, dir.rfind('/'));
      candidates.push_back(dir + "/../profiles/" + name_or_path + ".json");
      candidates.push_back(dir + "/../../profiles/" + name_or_path + ".json");
      candidates.push_back(dir + "/../share/sandboxer/profiles/" + name_or_path + ".json");
    }
    candidates.push_back("/etc/sandboxer/profiles/" + name_or_path + ".json");
    candidates.push_back("/usr/share/sandboxer/profiles/" + name_or_path + ".json");
  }
  for (auto& c : candidates) {
    auto text = os::read_file(c);
    if (!text) continue;
    try {
      return parse_profile(*text);
    } catch (const ProfileError& e) {
      throw ProfileError(c + ": " + e.what());
    }
  }
  throw ProfileError("profile \"" + name_or_path + "\": not found (looked in " + candidates.front() +
                     (candidates.size() > 1 ? " and " + std::to_string(candidates.size() - 1) + " more places)" : ")"));
}

void apply_override(Profile& p, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) throw ProfileError("--set " + assignment + ": expected FIELD=VALUE");
  std::string path = assignment.substr(0, eq);
  std::string raw = assignment.substr(eq + 1);
  boost::system::error_code ec;
  json::value v = json::parse(raw, ec);
  if (ec) v = json::string(raw);
  // Build {"a":{"b":v}} and parse it over the current profile: one code path for validation.
  json::value doc = v;
  size_t end = path.size();
  for (;;) {
    size_t dot = path.rfind('.', end - 1);
    std::string key = path.substr(dot == std::string::npos ? 0 : dot + 1, end - (dot == std::string::npos ? 0 : dot + 1));
    doc = json::object{{key, doc}};
    if (dot == std::string::npos) break;
    end = dot;
  }
  try {
    parse_into(p, doc);
  } catch (const ProfileError& e) {
    throw ProfileError(std::string("--set ") + assignment + ": " + e.what());
  }
}

}  // namespace sbx::supervisor
