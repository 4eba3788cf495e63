#include "protocol/protocol.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/encoding.hpp"
#include "profile/profile.hpp"

namespace sbx::protocol {

namespace {
std::string field(std::string_view key) { return "field " + std::string(key) + ": "; }
const char* kind_of(const boost::json::value& v) {
  switch (v.kind()) {
    case boost::json::kind::null:
      return "null";
    case boost::json::kind::bool_:
      return "a boolean";
    case boost::json::kind::int64:
    case boost::json::kind::uint64:
    case boost::json::kind::double_:
      return "a number";
    case boost::json::kind::string:
      return "a string";
    case boost::json::kind::array:
      return "an array";
    case boost::json::kind::object:
      return "an object";
  }
  return "?";
}
}  // namespace

Request parse_request(std::string_view text, boost::json::value* id_out) {
  if (text.size() > kMaxTextFrame)
    throw RequestError("frame_too_large", "text frame of " + std::to_string(text.size()) +
                                              " bytes exceeds the cap of " + std::to_string(kMaxTextFrame) + " bytes");
  boost::system::error_code ec;
  boost::json::parse_options po;
  po.max_depth = 32;
  auto v = boost::json::parse(text, ec, {}, po);
  if (ec) throw RequestError("bad_json", "the frame is not valid JSON: " + ec.message());
  if (!v.is_object()) throw RequestError("bad_request", std::string("a request is a JSON object, not ") + kind_of(v));
  Request r;
  r.fields = std::move(v.as_object());
  if (auto* id = r.fields.if_contains("id")) {
    bool ok = id->is_string() || id->is_null() || id->is_int64() || id->is_uint64();
    if (ok) r.id = *id;
    if (id_out) *id_out = r.id;
    if (!ok)
      throw RequestError("bad_request", std::string("field id: expected an integer or a string, got ") + kind_of(*id));
  }
  auto* op = r.fields.if_contains("op");
  if (!op) throw RequestError("bad_request", "field op: missing");
  if (!op->is_string())
    throw RequestError("bad_request", std::string("field op: expected a string, got ") + kind_of(*op));
  r.op = op->as_string();
  return r;
}

boost::json::value leading_id(std::string_view s) {
  size_t i = 0;
  auto space = [&] {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  };
  auto take = [&](std::string_view t) {
    space();
    if (s.substr(i, t.size()) != t) return false;
    i += t.size();
    return true;
  };
  if (!take("{") || !take("\"id\"") || !take(":")) return nullptr;
  space();
  size_t start = i;
  if (i < s.size() && s[i] == '"') {
    for (++i; i < s.size() && s[i] != '"'; ++i)
      if (s[i] == '\\') ++i;
    if (i++ >= s.size()) return nullptr;  // cut off inside the string
  } else {
    while (i < s.size() && ((s[i] >= '0' && s[i] <= '9') || s[i] == '-')) ++i;
  }
  size_t end = i;
  space();
  // Nothing, too long, or not followed by the next field or the end (1.5, cut off).
  if (end == start || end - start > 256 || i >= s.size() || (s[i] != ',' && s[i] != '}')) return nullptr;
  boost::system::error_code ec;
  auto v = boost::json::parse(s.substr(start, end - start), ec);
  if (ec || !(v.is_string() || v.is_int64() || v.is_uint64())) return nullptr;
  return v;
}

std::optional<std::string> opt_string(const boost::json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  if (!v || v->is_null()) return std::nullopt;
  if (!v->is_string()) throw RequestError("bad_request", field(key) + "expected a string, got " + kind_of(*v));
  return std::string(v->as_string());
}

std::string need_string(const boost::json::object& o, std::string_view key) {
  auto s = opt_string(o, key);
  if (!s) throw RequestError("bad_request", field(key) + "missing");
  return *s;
}

const boost::json::value* b64_twin(const boost::json::object& o, std::string_view key) {
  std::string b64key = std::string(key) + "_b64";
  auto* b64 = o.if_contains(b64key);
  if (!b64 || b64->is_null()) return nullptr;
  if (auto* v = o.if_contains(key); v && !v->is_null())
    throw RequestError("bad_request", "fields " + std::string(key) + " and " + b64key + ": give one of them, not both");
  return b64;
}

std::optional<std::string> opt_path(const boost::json::object& o, std::string_view key) {
  if (!b64_twin(o, key)) return opt_string(o, key);
  std::string b64key = std::string(key) + "_b64";
  auto b64 = opt_string(o, b64key);
  std::string raw;
  if (!base::base64_decode(*b64, raw)) throw RequestError("bad_request", field(b64key) + "not valid base64");
  return raw;
}

std::string need_path(const boost::json::object& o, std::string_view key) {
  auto p = opt_path(o, key);
  if (!p) throw RequestError("bad_request", field(key) + "missing");
  return *p;
}

std::vector<std::string> need_path_list(const boost::json::object& o, std::string_view key) {
  if (!b64_twin(o, key)) return need_string_array(o, key);
  std::string b64key = std::string(key) + "_b64";
  std::vector<std::string> out;
  for (auto& e : need_string_array(o, b64key)) {
    std::string raw;
    if (!base::base64_decode(e, raw)) throw RequestError("bad_request", field(b64key) + "an item is not valid base64");
    out.push_back(std::move(raw));
  }
  return out;
}

std::optional<int64_t> opt_int(const boost::json::object& o, std::string_view key, int64_t min, int64_t max) {
  auto* v = o.if_contains(key);
  if (!v || v->is_null()) return std::nullopt;
  int64_t n;
  if (v->is_int64()) {
    n = v->as_int64();
  } else if (v->is_uint64()) {
    if (v->as_uint64() > static_cast<uint64_t>(max))
      throw RequestError("bad_request", field(key) + "out of range (at most " + std::to_string(max) + ")");
    n = static_cast<int64_t>(v->as_uint64());
  } else if (v->is_double()) {
    double d = v->as_double();
    if (!std::isfinite(d) || d != std::floor(d) || d < static_cast<double>(min) || d > static_cast<double>(max))
      throw RequestError("bad_request", field(key) + "expected an integer in [" + std::to_string(min) + ", " +
                                            std::to_string(max) + "]");
    n = static_cast<int64_t>(d);
  } else {
    throw RequestError("bad_request", field(key) + "expected an integer, got " + kind_of(*v));
  }
  if (n < min || n > max)
    throw RequestError("bad_request",
                       field(key) + "out of range [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  return n;
}

std::optional<bool> opt_bool(const boost::json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  if (!v || v->is_null()) return std::nullopt;
  if (!v->is_bool()) throw RequestError("bad_request", field(key) + "expected a boolean, got " + kind_of(*v));
  return v->as_bool();
}

std::vector<std::string> need_string_array(const boost::json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  if (!v) throw RequestError("bad_request", field(key) + "missing");
  if (!v->is_array())
    throw RequestError("bad_request", field(key) + "expected an array of strings, got " + kind_of(*v));
  std::vector<std::string> out;
  for (auto& e : v->as_array()) {
    if (!e.is_string())
      throw RequestError("bad_request", field(key) + "expected an array of strings, found " + kind_of(e));
    out.emplace_back(e.as_string());
  }
  return out;
}

std::optional<int64_t> opt_duration_ms(const boost::json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  if (!v || v->is_null()) return std::nullopt;
  if (v->is_string()) {
    try {
      return profile::parse_duration_ms(v->as_string(), std::string(key));
    } catch (const std::exception& e) {
      throw RequestError("bad_request", e.what());
    }
  }
  double s = v->is_double()   ? v->as_double()
             : v->is_int64()  ? static_cast<double>(v->as_int64())
             : v->is_uint64() ? static_cast<double>(v->as_uint64())
                              : -1;
  if (!v->is_number())
    throw RequestError("bad_request", field(key) + "expected seconds or a duration string, got " + kind_of(*v));
  if (!std::isfinite(s) || s < 0 || s > 86400.0 * 365)
    throw RequestError("bad_request", field(key) + "out of range (0 to a year of seconds)");
  return static_cast<int64_t>(s * 1000);
}

boost::json::object ok_reply(const boost::json::value& id) { return {{"id", id}, {"ok", true}}; }

boost::json::object error_reply(const boost::json::value& id, std::string_view code, std::string_view message) {
  // A message may name a path the agent chose (fs.remove's "d/<name>: ..."): JSON text is UTF-8.
  return {{"id", id}, {"ok", false}, {"error", {{"code", code}, {"message", base::utf8_lossy(message)}}}};
}

boost::json::object reply_with_id(const boost::json::value& id, const boost::json::object& body) {
  boost::json::object reply{{"id", id}};
  for (auto& kv : body) reply[kv.key()] = kv.value();
  if (!reply.contains("ok")) reply["ok"] = true;
  return reply;
}

void put_header(std::string& out, const BinaryHeader& h) {
  unsigned char b[kBinaryHeader];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<unsigned char>(h.id >> (8 * i));
  for (int i = 0; i < 8; ++i) b[4 + i] = static_cast<unsigned char>(h.offset >> (8 * i));
  b[12] = h.flags;
  out.append(reinterpret_cast<const char*>(b), sizeof b);
}

std::optional<BinaryHeader> get_header(std::string_view f) {
  if (f.size() < kBinaryHeader) return std::nullopt;
  auto u = [&](size_t i) { return static_cast<uint64_t>(static_cast<unsigned char>(f[i])); };
  BinaryHeader h;
  for (int i = 0; i < 4; ++i) h.id |= static_cast<uint32_t>(u(static_cast<size_t>(i)) << (8 * i));
  for (int i = 0; i < 8; ++i) h.offset |= u(static_cast<size_t>(4 + i)) << (8 * i);
  h.flags = static_cast<uint8_t>(u(12));
  return h;
}

void put_text_or_b64(boost::json::object& o, std::string_view key, std::string_view v, bool known_utf8) {
  if (known_utf8 || base::utf8_valid_prefix(v) == v.size())
    o[key] = v;
  else
    o[std::string(key) + "_b64"] = base::base64_encode(v);
}

void put_list_text_or_b64(boost::json::object& o, std::string_view key, const std::vector<std::string>& v) {
  bool text =
      std::all_of(v.begin(), v.end(), [](const std::string& s) { return base::utf8_valid_prefix(s) == s.size(); });
  boost::json::array a;
  for (auto& s : v) a.emplace_back(text ? s : base::base64_encode(s));
  o[text ? std::string(key) : std::string(key) + "_b64"] = std::move(a);
}

void put_bytes(boost::json::object& ev, std::string_view data, bool known_utf8) {
  put_text_or_b64(ev, "data", data, known_utf8);
}

}  // namespace sbx::protocol
