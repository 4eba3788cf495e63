#include "profile.hpp"

#include <unistd.h>

#include <boost/json.hpp>
#include <charconv>
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

void parse_into(Profile& p, const json::value& doc) {
  Fields top(doc, "");
  if (auto* v = top.get("name")) p.name = as_string(*v, "name");
  if (auto* v = top.get("version")) {
    if (!v->is_int64() || v->as_int64() != 1) throw ProfileError("version: this supervisor reads profile version 1");
  }
  top.get("description");
  if (auto* r = top.get("resources")) {
    Fields f(*r, "resources");
    if (auto* v = f.get("grace")) p.resources.grace_ms = as_duration(*v, "resources.grace");
    f.done();
  }
  if (auto* r = top.get("isolation")) {
    Fields f(*r, "isolation");
    if (auto* v = f.get("namespaces")) {
      if (!v->is_bool()) throw ProfileError("isolation.namespaces: expected true or false");
      p.isolation.namespaces = v->as_bool();
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
