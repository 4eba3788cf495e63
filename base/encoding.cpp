#include "base/encoding.hpp"

#include <time.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace sbx::base {

std::string rfc3339(int64_t sec, long nsec) {
  // The civil date by arithmetic (<chrono>'s calendar): gmtime_r takes glibc's time zone lock at
  // every call and reads /etc/localtime at the first (tzset), though UTC needs neither.
  using namespace std::chrono;
  sys_days day = floor<days>(sys_seconds{seconds{sec}});
  year_month_day ymd{day};
  int64_t in_day = sec - duration_cast<seconds>(day.time_since_epoch()).count();
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04d-%02u-%02uT%02d:%02d:%02d.%06ldZ", static_cast<int>(ymd.year()),
                static_cast<unsigned>(ymd.month()), static_cast<unsigned>(ymd.day()), static_cast<int>(in_day / 3600),
                static_cast<int>(in_day / 60 % 60), static_cast<int>(in_day % 60), nsec / 1000);
  return buf;
}

std::string rfc3339_now() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return rfc3339(ts.tv_sec, ts.tv_nsec);
}

namespace {
// Returns the length of the valid sequence starting at s[i], 0 if invalid, or -n if the
// sequence is a valid but truncated prefix of length n.
int utf8_seq(std::string_view s, size_t i) noexcept {
  auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = b(i);
  if (c < 0x80) return 1;
  int len;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  size_t avail = s.size() - i;
  for (int k = 1; k < len; ++k) {
    if (static_cast<size_t>(k) >= avail) return -k;
    unsigned char x = b(i + k);
    unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (x < l || x > h) return 0;
  }
  return len;
}
}  // namespace

std::string utf8_lossy(std::string_view s) {
  std::string out;
  while (!s.empty()) {
    size_t ok = utf8_valid_prefix(s);
    out.append(s.substr(0, ok));
    if (ok == s.size()) break;
    out.append("\xEF\xBF\xBD");  // U+FFFD for the one byte that stopped it
    s.remove_prefix(ok + 1);
  }
  return out;
}

namespace {
// The length of the ASCII run at the start of [p, p + n), give or take: a multiple of the block
// size that holds no byte with its high bit set (the caller goes on byte by byte from there).
size_t ascii_run(const char* p, size_t n) noexcept {
  size_t i = 0;
#ifdef __SSE2__
  // 64 bytes a step: four 16-byte loads, their high bits gathered at once.
  while (i + 64 <= n) {
    auto at = [&](size_t k) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i + k)); };
    __m128i any = _mm_or_si128(_mm_or_si128(at(0), at(16)), _mm_or_si128(at(32), at(48)));
    if (_mm_movemask_epi8(any) != 0) break;
    i += 64;
  }
#endif
  uint64_t w;
  while (i + 8 <= n && (std::memcpy(&w, p + i, 8), (w & 0x8080808080808080ull) == 0)) i += 8;
  return i;
}
}  // namespace

size_t utf8_valid_prefix(std::string_view s) noexcept {
  size_t i = 0;
  while (i < s.size()) {
    // Fast path for ASCII runs, many bytes at a time while none has its high bit set.
    i += ascii_run(s.data() + i, s.size() - i);
    if (i == s.size()) break;
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    int n = utf8_seq(s, i);
    if (n <= 0) return i;
    i += static_cast<size_t>(n);
  }
  return i;
}

size_t utf8_incomplete_tail(std::string_view s) noexcept {
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    size_t i = s.size() - back;
    unsigned char c = static_cast<unsigned char>(s[i]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: look further back
    int n = utf8_seq(s, i);
    return n < 0 ? back : 0;
  }
  return 0;
}

namespace {
// A byte JSON writes escaped: '"', '\\' and the controls below 0x20 (as boost::json does: not
// 0x7f, not '/', and bytes past 0x7f as they are).
bool needs_escape(unsigned char c) { return c < 0x20 || c == '"' || c == '\\'; }

// The first byte in [p, end) that needs an escape, or with `high` one past 0x7f, or end.
template <bool high>
const char* find_escape(const char* p, const char* end) {
#ifdef __SSE2__
  const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\'), ctl = _mm_set1_epi8(0x1f);
  while (end - p >= 16) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
                               _mm_cmpeq_epi8(_mm_min_epu8(v, ctl), v));  // v <= 0x1f, unsigned
    int m = _mm_movemask_epi8(hit);
    if constexpr (high) m |= _mm_movemask_epi8(v);  // the bytes' own high bits
    if (m != 0) return p + __builtin_ctz(static_cast<unsigned>(m));
    p += 16;
  }
#endif
  while (p < end && !needs_escape(static_cast<unsigned char>(*p)) && (!high || static_cast<unsigned char>(*p) < 0x80))
    ++p;
  return p;
}

// The two-character escape of c (\n for a newline), or 0 where JSON writes \u00XX.
char short_escape(unsigned char c) {
  switch (c) {
    case '"':
    case '\\':
      return static_cast<char>(c);
    case '\b':
      return 'b';
    case '\t':
      return 't';
    case '\n':
      return 'n';
    case '\f':
      return 'f';
    case '\r':
      return 'r';
    default:
      return 0;
  }
}

constexpr char kHex[] = "0123456789abcdef";

// Appends \u00XX for the byte or code point c (below 0x100).
void append_u_escape(std::string& out, unsigned char c) {
  const char u[6] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 15]};
  out.append(u, 6);
}

// Appends the escape of c, a byte below 0x20, '"' or '\\'.
void append_escape(std::string& out, unsigned char c) {
  char two = short_escape(c);
  if (two) {
    out.push_back('\\');
    out.push_back(two);
  } else {
    append_u_escape(out, c);
  }
}

// Appends `s` escaped, `high`: stopping at the first byte past 0x7f, whose offset it returns
// (s.size() when there is none).
template <bool high>
size_t append_escaped(std::string& out, std::string_view s) {
  const char *p = s.data(), *end = p + s.size();
  while (p < end) {
    const char* q = find_escape<high>(p, end);
    out.append(p, static_cast<size_t>(q - p));
    if (q == end) break;
    auto c = static_cast<unsigned char>(*q);
    if constexpr (high)
      if (c >= 0x80) return static_cast<size_t>(q - s.data());
    append_escape(out, c);
    p = q + 1;
  }
  return s.size();
}

// Appends `s`, valid UTF-8, escaped, with each C1 control (U+0080..U+009F: C2 80..C2 9F) as its
// \u escape. A valid C2 is always followed by one continuation byte.
void append_valid(std::string& out, std::string_view s) {
  size_t from = 0;
  for (size_t at = s.find('\xC2'); at != std::string_view::npos; at = s.find('\xC2', at + 2)) {
    auto next = static_cast<unsigned char>(s[at + 1]);
    if (next > 0x9F) continue;
    append_escaped<false>(out, s.substr(from, at - from));
    append_u_escape(out, next);
    from = at + 2;
  }
  append_escaped<false>(out, s.substr(from));
}

void append_string(std::string& out, std::string_view s) {
  // Room for the string and a few escapes: a line of output grows once, not at every escape.
  out.reserve(out.size() + s.size() + s.size() / 16 + 8);
  out.push_back('"');
  // ASCII, the common case, in the one scan the escapes need; from the first byte past 0x7f,
  // valid runs escaped and each byte that stops one written as U+FFFD, as utf8_lossy.
  s.remove_prefix(append_escaped<true>(out, s));
  while (!s.empty()) {
    size_t ok = utf8_valid_prefix(s);
    append_valid(out, s.substr(0, ok));
    if (ok == s.size()) break;
    out.append("\xEF\xBF\xBD");
    s.remove_prefix(ok + 1);
  }
  out.push_back('"');
}
}  // namespace

std::string json_escape_c1(std::string_view json) {
  std::string out;
  size_t from = 0;
  for (size_t at = json.find('\xC2'); at != std::string_view::npos && at + 1 < json.size();
       at = json.find('\xC2', at + 1)) {
    auto next = static_cast<unsigned char>(json[at + 1]);
    if (next < 0x80 || next > 0x9F) continue;
    if (out.empty()) out.reserve(json.size() + 16);
    out.append(json.substr(from, at - from));
    append_u_escape(out, next);
    from = ++at + 1;
  }
  if (from == 0) return std::string(json);
  out.append(json.substr(from));
  return out;
}

std::string json_text(const boost::json::object& o) {
  std::string out;
  json_append(out, o);
  return out;
}

void json_append(std::string& out, const boost::json::object& o) {
  out.push_back('{');
  bool first = true;
  for (const auto& kv : o) {
    if (!first) out.push_back(',');
    first = false;
    append_string(out, kv.key());
    out.push_back(':');
    json_append(out, kv.value());
  }
  out.push_back('}');
}

void json_append(std::string& out, const boost::json::value& v) {
  switch (v.kind()) {
    case boost::json::kind::string:
      return append_string(out, v.get_string());
    case boost::json::kind::object:
      return json_append(out, v.get_object());
    case boost::json::kind::array: {
      out.push_back('[');
      bool first = true;
      for (const auto& e : v.get_array()) {
        if (!first) out.push_back(',');
        first = false;
        json_append(out, e);
      }
      out.push_back(']');
      return;
    }
    default: {
      // A number, a bool or null: boost's own text for it (its double format included).
      char buf[64];
      boost::json::serializer sr;
      sr.reset(&v);
      out.append(sr.read(buf, sizeof buf));
      return;
    }
  }
}

static constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  auto u = [&](size_t k) { return static_cast<unsigned char>(in[k]); };
  for (; i + 2 < in.size(); i += 3) {
    unsigned v = (u(i) << 16) | (u(i + 1) << 8) | u(i + 2);
    out += kB64[v >> 18];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    out += kB64[v & 63];
  }
  if (i + 1 == in.size()) {
    unsigned v = u(i) << 16;
    out += kB64[v >> 18];
    out += kB64[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    unsigned v = (u(i) << 16) | (u(i + 1) << 8);
    out += kB64[v >> 18];
    out += kB64[(v >> 12) & 63];
    out += kB64[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  out.reserve(in.size() / 4 * 3);
  while (!in.empty() && in.back() == '=') in.remove_suffix(1);
  unsigned acc = 0;
  int bits = 0;
  for (char ch : in) {
    int v;
    if (ch >= 'A' && ch <= 'Z')
      v = ch - 'A';
    else if (ch >= 'a' && ch <= 'z')
      v = ch - 'a' + 26;
    else if (ch >= '0' && ch <= '9')
      v = ch - '0' + 52;
    else if (ch == '+')
      v = 62;
    else if (ch == '/')
      v = 63;
    else
      return false;
    acc = (acc << 6) | static_cast<unsigned>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  // A single leftover sextet cannot encode a byte.
  return bits < 6;
}

void put_bytes_field(boost::json::object& o, std::string_view key, std::string_view v) {
  if (utf8_valid_prefix(v) == v.size()) {
    o[key] = v;
    return;
  }
  o[key] = utf8_lossy(v);
  o[std::string(key) + "_b64"] = base64_encode(v);
}

void put_bytes_list(boost::json::object& o, std::string_view key, const std::vector<std::string>& v) {
  boost::json::array text, b64;
  bool all_utf8 = true;
  for (auto& s : v) all_utf8 = all_utf8 && utf8_valid_prefix(s) == s.size();
  for (auto& s : v) {
    text.emplace_back(all_utf8 ? s : utf8_lossy(s));
    if (!all_utf8) b64.emplace_back(base64_encode(s));
  }
  o[key] = std::move(text);
  if (!all_utf8) o[std::string(key) + "_b64"] = std::move(b64);
}

namespace {

std::string bytes_of(const boost::json::value& v, const std::string& field, bool b64) {
  if (!v.is_string()) throw std::invalid_argument(field + ": expected a string");
  if (!b64) return std::string(v.as_string());
  std::string raw;
  if (!base64_decode(v.as_string(), raw)) throw std::invalid_argument(field + ": not valid base64");
  return raw;
}

}  // namespace

std::optional<std::string> get_bytes_field(const boost::json::object& o, std::string_view key) {
  std::string b64key = std::string(key) + "_b64";
  if (auto* v = o.if_contains(b64key)) return bytes_of(*v, b64key, true);
  if (auto* v = o.if_contains(key)) return bytes_of(*v, std::string(key), false);
  return std::nullopt;
}

std::optional<std::vector<std::string>> get_bytes_list(const boost::json::object& o, std::string_view key) {
  std::string b64key = std::string(key) + "_b64";
  bool b64 = o.contains(b64key);
  const boost::json::value* v = b64 ? o.if_contains(b64key) : o.if_contains(key);
  if (!v) return std::nullopt;
  std::string name = b64 ? b64key : std::string(key);
  if (!v->is_array()) throw std::invalid_argument(name + ": expected an array of strings");
  std::vector<std::string> out;
  for (auto& e : v->as_array()) out.push_back(bytes_of(e, name, b64));
  return out;
}

}  // namespace sbx::base
