#include "egress-policy.hpp"

#include <arpa/inet.h>
#include <idn2.h>

#include <cstdlib>
#include <stdexcept>

namespace sbx::supervisor {

namespace {

bool set_why(std::string* why, std::string text) {
  if (why) *why = std::move(text);
  return false;
}

bool all_of(std::string_view s, bool (*pred)(char)) {
  for (char c : s)
    if (!pred(c)) return false;
  return !s.empty();
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex_label_char(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || c == 'x'; }

}  // namespace

std::optional<CanonicalHost> canonical_host(std::string_view raw, std::string* why) {
  auto fail = [&](std::string text) -> std::optional<CanonicalHost> {
    set_why(why, std::move(text));
    return std::nullopt;
  };
  if (raw.empty()) return fail("empty host");
  if (raw.size() > 1024) return fail("host too long");
  // IPv6 literals: bracketed in URLs and CONNECT targets, bare in profiles.
  std::string_view v6 = raw;
  if (v6.front() == '[') {
    if (v6.back() != ']') return fail("unbalanced brackets in host");
    v6 = v6.substr(1, v6.size() - 2);
  }
  if (v6.find(':') != std::string_view::npos || raw.front() == '[') {
    struct in6_addr a6 {};
    std::string s(v6);
    if (::inet_pton(AF_INET6, s.c_str(), &a6) != 1) return fail("not a valid IPv6 address");
    char buf[INET6_ADDRSTRLEN];
    ::inet_ntop(AF_INET6, &a6, buf, sizeof buf);
    return CanonicalHost{buf, true};
  }

  std::string name(raw);
  bool ascii = true;
  for (unsigned char c : name) ascii &= c < 0x80;
  if (!ascii) {
    // Unicode names become their A-labels (IDNA2008 with TR46 mapping), so a lookalike in
    // another script compares as the different name it is.
    char* out = nullptr;
    int rc = idn2_to_ascii_8z(name.c_str(), &out, IDN2_NONTRANSITIONAL | IDN2_NFC_INPUT);
    if (rc != IDN2_OK) return fail(std::string("not a valid internationalized name: ") + idn2_strerror(rc));
    name = out;
    idn2_free(out);
  }
  for (auto& c : name)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  if (name.ends_with('.')) name.pop_back();
  if (name.empty()) return fail("empty host");
  if (name.size() > 253) return fail("host longer than 253 characters");

  size_t start = 0;
  std::string_view last;
  for (;;) {
    size_t dot = name.find('.', start);
    std::string_view label = std::string_view(name).substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (label.empty()) return fail("empty label in host");
    if (label.size() > 63) return fail("label longer than 63 characters in host");
    for (char c : label)
      if (!(is_digit(c) || (c >= 'a' && c <= 'z') || c == '-' || c == '_'))
        return fail(std::string("character '") + (c >= 0x20 && c < 0x7f ? std::string(1, c) : "\\x" + std::to_string(static_cast<unsigned char>(c))) + "' not allowed in a host name");
    last = label;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  // Resolvers read "127.1", "0x7f.0.0.1" and "2130706433" as addresses: such a name is the
  // address it spells, and a numeric last label that spells none is refused.
  struct in_addr a4 {};
  if (all_of(last, is_hex_label_char) && (all_of(last, is_digit) || last.starts_with("0x"))) {
    if (::inet_aton(name.c_str(), &a4) == 0) return fail("looks like an IPv4 address but is not one");
    return CanonicalHost{::inet_ntoa(a4), true};
  }
  return CanonicalHost{std::move(name), false};
}

HostPolicy::Pattern HostPolicy::parse_pattern(const std::string& entry, const char* list) {
  Pattern p;
  p.text = entry;
  std::string_view body = entry;
  if (body.starts_with("*.")) {
    p.wildcard = true;
    body.remove_prefix(2);
  }
  if (body.find('*') != std::string_view::npos)
    throw std::invalid_argument(std::string(list) + ": \"" + entry + "\": a pattern is an exact host or *.suffix");
  std::string why;
  auto h = canonical_host(body, &why);
  if (!h) throw std::invalid_argument(std::string(list) + ": \"" + entry + "\": " + why);
  if (p.wildcard && h->is_ip)
    throw std::invalid_argument(std::string(list) + ": \"" + entry + "\": *. patterns take names, not addresses");
  p.host = h->name;
  p.is_ip = h->is_ip;
  return p;
}

HostPolicy::HostPolicy(const std::vector<std::string>& allow, const std::vector<std::string>& deny) {
  for (auto& a : allow) allow_.push_back(parse_pattern(a, "allow"));
  for (auto& d : deny) deny_.push_back(parse_pattern(d, "deny"));
}

bool HostPolicy::matches(const Pattern& p, const CanonicalHost& h) {
  if (p.is_ip != h.is_ip) return false;
  if (!p.wildcard) return p.host == h.name;
  return h.name.size() > p.host.size() + 1 && h.name.ends_with(p.host) &&
         h.name[h.name.size() - p.host.size() - 1] == '.';
}

bool HostPolicy::allows(const CanonicalHost& h, std::string* why) const {
  for (auto& d : deny_)
    if (matches(d, h)) return set_why(why, "denied by \"" + d.text + "\"");
  for (auto& a : allow_)
    if (matches(a, h)) return true;
  return set_why(why, "not on the allow list");
}

// ---- DNS ----

namespace {
uint16_t be16(std::string_view m, size_t off) {
  return static_cast<uint16_t>((static_cast<unsigned char>(m[off]) << 8) | static_cast<unsigned char>(m[off + 1]));
}
void put16(std::string& out, uint16_t v) {
  out.push_back(static_cast<char>(v >> 8));
  out.push_back(static_cast<char>(v & 0xff));
}
void put32(std::string& out, uint32_t v) {
  put16(out, static_cast<uint16_t>(v >> 16));
  put16(out, static_cast<uint16_t>(v & 0xffff));
}
}  // namespace

std::optional<DnsQuestion> parse_dns_query(std::string_view m, uint16_t* id) {
  if (m.size() < 12) return std::nullopt;
  DnsQuestion q;
  q.id = be16(m, 0);
  if (id) *id = q.id;
  q.flags = be16(m, 2);
  bool is_reply = q.flags & 0x8000;
  unsigned opcode = (q.flags >> 11) & 0xf;
  // One question, no answers; one additional record (an EDNS OPT) is tolerated and ignored.
  if (is_reply || opcode != 0 || be16(m, 4) != 1 || be16(m, 6) != 0 || be16(m, 8) != 0 || be16(m, 10) > 1)
    return std::nullopt;
  size_t off = 12;
  size_t wire_len = 0;
  for (;;) {
    if (off >= m.size()) return std::nullopt;
    auto len = static_cast<unsigned char>(m[off++]);
    if (len == 0) break;
    if (len & 0xc0) return std::nullopt;  // no compression pointers in a question we read
    if (off + len > m.size()) return std::nullopt;
    wire_len += len + 1;
    if (wire_len > 254) return std::nullopt;
    std::string_view label = m.substr(off, len);
    // A dot or a control byte inside a label would read as a different name once joined.
    for (unsigned char c : label)
      if (c == '.' || c <= 0x20 || c >= 0x7f) return std::nullopt;
    if (!q.name.empty()) q.name.push_back('.');
    q.name.append(label);
    off += len;
  }
  if (q.name.empty() || off + 4 > m.size()) return std::nullopt;
  q.qtype = be16(m, off);
  q.qclass = be16(m, off + 2);
  q.question_end = off + 4;
  return q;
}

std::string make_dns_reply(std::string_view query, const DnsQuestion& q, uint8_t rcode,
                           const std::vector<std::string>& addresses, uint32_t ttl) {
  std::string out;
  put16(out, q.id);
  put16(out, static_cast<uint16_t>(0x8000 | (q.flags & 0x0100) | 0x0080 | (rcode & 0xf)));
  put16(out, 1);
  put16(out, static_cast<uint16_t>(addresses.size()));
  put16(out, 0);
  put16(out, 0);
  out.append(query.substr(12, q.question_end - 12));
  for (auto& a : addresses) {
    put16(out, 0xc00c);  // the name of the question, by pointer
    put16(out, a.size() == 16 ? kDnsTypeAAAA : kDnsTypeA);
    put16(out, 1);
    put32(out, ttl);
    put16(out, static_cast<uint16_t>(a.size()));
    out.append(a);
  }
  return out;
}

std::string make_dns_error(uint16_t id, uint8_t rcode) {
  std::string out;
  put16(out, id);
  put16(out, static_cast<uint16_t>(0x8000 | 0x0080 | (rcode & 0xf)));
  for (int i = 0; i < 4; ++i) put16(out, 0);
  return out;
}

}  // namespace sbx::supervisor
