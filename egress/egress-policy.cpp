#include "egress/egress-policy.hpp"

#include <arpa/inet.h>
#include <idn2.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "os/library.hpp"

namespace sbx::egress {

namespace {

bool all_of(std::string_view s, bool (*pred)(char)) {
  for (char c : s)
    if (!pred(c)) return false;
  return !s.empty();
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_hex_label_char(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || c == 'x'; }

// libidn2, loaded by its soname the first time a name is not ASCII: most boxes name none, and a
// linked libidn2 (with its libunistring) was two more libraries for the loader at every start
// of the supervisor and the CLI.
struct LibIdn2 {
  decltype(&::idn2_to_ascii_8z) to_ascii_8z = nullptr;
  decltype(&::idn2_strerror) strerror = nullptr;
  decltype(&::idn2_free) free = nullptr;
};

base::Result<const LibIdn2*> load_idn2() {
  auto l = os::Library::open("libidn2", SBX_LIBIDN2_SONAME, "no_libidn2");
  if (!l) return l.error();
  static LibIdn2 lib;
  if (auto r = l->get(lib.to_ascii_8z, "idn2_to_ascii_8z"); !r) return r.error();
  if (auto r = l->get(lib.strerror, "idn2_strerror"); !r) return r.error();
  if (auto r = l->get(lib.free, "idn2_free"); !r) return r.error();
  return &lib;
}

const base::Result<const LibIdn2*>& libidn2() {
  static const base::Result<const LibIdn2*> lib = load_idn2();  // once, under the static's guard
  return lib;
}

}  // namespace

base::Result<CanonicalHost> canonical_host(std::string_view raw) {
  auto fail = [](std::string text) { return base::fail(std::move(text)); };
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
    const auto& idn = libidn2();
    if (!idn) return base::fail("no A-label for a name that is not ASCII: " + idn.error().message, idn.error().code);
    char* out = nullptr;
    int rc = (*idn)->to_ascii_8z(name.c_str(), &out, IDN2_NONTRANSITIONAL | IDN2_NFC_INPUT);
    if (rc != IDN2_OK) return fail(std::string("not a valid internationalized name: ") + (*idn)->strerror(rc));
    name = out;
    (*idn)->free(out);
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
    std::string_view label =
        std::string_view(name).substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (label.empty()) return fail("empty label in host");
    if (label.size() > 63) return fail("label longer than 63 characters in host");
    for (char c : label)
      if (!(is_digit(c) || (c >= 'a' && c <= 'z') || c == '-' || c == '_'))
        return fail(
            std::string("character '") +
            (c >= 0x20 && c < 0x7f ? std::string(1, c) : "\\x" + std::to_string(static_cast<unsigned char>(c))) +
            "' not allowed in a host name");
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
  auto h = canonical_host(body);
  if (!h) throw std::invalid_argument(std::string(list) + ": \"" + entry + "\": " + h.error().message);
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

base::Result<void> HostPolicy::allows(const CanonicalHost& h) const {
  for (auto& d : deny_)
    if (matches(d, h)) return base::fail("denied by \"" + d.text + "\"");
  for (auto& a : allow_)
    if (matches(a, h)) return {};
  return base::fail("not on the allow list");
}

// ---- addresses ----

std::optional<IpAddress> IpAddress::parse(std::string_view text) {
  if (text.empty() || text.size() >= INET6_ADDRSTRLEN) return std::nullopt;
  std::string s(text);
  IpAddress a;
  if (s.find(':') == std::string::npos) {
    // inet_pton, unlike inet_aton, takes only the four dotted decimals: no "127.1", no hex.
    if (::inet_pton(AF_INET, s.c_str(), a.bytes.data()) != 1) return std::nullopt;
    a.v4 = true;
    return a;
  }
  if (::inet_pton(AF_INET6, s.c_str(), a.bytes.data()) != 1) return std::nullopt;
  return a;
}

std::optional<IpAddress> IpAddress::from_bytes(std::string_view raw) {
  if (raw.size() != 4 && raw.size() != 16) return std::nullopt;
  IpAddress a;
  a.v4 = raw.size() == 4;
  std::memcpy(a.bytes.data(), raw.data(), raw.size());
  return a;
}

std::string IpAddress::text() const {
  char buf[INET6_ADDRSTRLEN];
  ::inet_ntop(v4 ? AF_INET : AF_INET6, bytes.data(), buf, sizeof buf);
  return buf;
}

IpAddress IpAddress::unmapped() const {
  static constexpr std::array<uint8_t, 12> kMapped{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (v4 || !std::equal(kMapped.begin(), kMapped.end(), bytes.begin())) return *this;
  IpAddress a;
  a.v4 = true;
  std::copy(bytes.begin() + 12, bytes.end(), a.bytes.begin());
  return a;
}

namespace {
// Whether the first `bits` bits of two addresses agree.
bool same_prefix(const IpAddress& a, const IpAddress& b, int bits) {
  int whole = bits / 8;
  if (!std::equal(a.bytes.begin(), a.bytes.begin() + whole, b.bytes.begin())) return false;
  if (bits % 8 == 0) return true;
  auto mask = static_cast<uint8_t>(0xff << (8 - bits % 8));
  return (a.bytes[whole] & mask) == (b.bytes[whole] & mask);
}
}  // namespace

bool Cidr::contains(const IpAddress& a) const { return a.v4 == net.v4 && same_prefix(a, net, bits); }

bool Cidr::overlaps(const Cidr& o) const {
  return o.net.v4 == net.v4 && same_prefix(o.net, net, std::min(bits, o.bits));
}

std::string Cidr::text() const { return net.text() + "/" + std::to_string(bits); }

base::Result<Cidr> parse_cidr(std::string_view text) {
  auto fail = [](std::string t) { return base::fail(std::move(t)); };
  auto slash = text.find('/');
  auto addr = IpAddress::parse(text.substr(0, slash));
  if (!addr) return fail("not an IPv4 or IPv6 address (a range is written like 10.1.2.0/24 or fd00::/8)");
  Cidr c{*addr, addr->v4 ? 32 : 128};
  if (slash != std::string_view::npos) {
    auto len = text.substr(slash + 1);
    if (len.empty() || len.size() > 3 || !all_of(len, is_digit) || (len.size() > 1 && len[0] == '0'))
      return fail("the prefix length after / must be a decimal number");
    int bits = std::atoi(std::string(len).c_str());
    if (bits > (addr->v4 ? 32 : 128))
      return fail("a prefix length of " + std::to_string(bits) + " is more than an " + (addr->v4 ? "IPv4" : "IPv6") +
                  " address has");
    c.bits = bits;
  }
  if (!addr->v4 && addr->unmapped().v4) return fail("an IPv4-mapped range: write the IPv4 range itself");
  IpAddress masked = c.net;
  for (int i = 0; i < 16; ++i) {
    int keep = std::clamp(c.bits - i * 8, 0, 8);
    masked.bytes[i] &= static_cast<uint8_t>(0xff00 >> keep);
  }
  if (!(masked == c.net)) return fail("host bits are set (the range is " + Cidr{masked, c.bits}.text() + ")");
  return c;
}

namespace {

struct SpecialRange {
  Cidr range;
  const char* what;
  int embeds_at = -1;  // where the IPv4 address it carries starts (NAT64, 6to4); -1: refused whole
};

// The special-purpose ranges of the IANA registries (RFC 6890 and successors) that are not
// globally reachable, plus the metadata endpoints clouds put on addresses of their own. The
// more specific entries come first, so an address is named by its narrowest range.
const std::vector<SpecialRange>& special_ranges() {
  static const std::vector<SpecialRange> table = [] {
    std::vector<SpecialRange> t;
    auto add = [&t](const char* cidr, const char* what, int embeds_at = -1) {
      t.push_back({*parse_cidr(cidr), what, embeds_at});
    };
    add("0.0.0.0/8", "\"this network\"; 0.0.0.0 reaches this machine");
    add("10.0.0.0/8", "private, RFC 1918");
    add("100.64.0.0/10", "shared address space, carrier-grade NAT; Alibaba Cloud metadata at 100.100.100.200");
    add("127.0.0.0/8", "loopback: this machine");
    add("168.63.129.16/32", "Azure platform endpoint (WireServer)");
    add("169.254.0.0/16", "link-local: cloud metadata services such as 169.254.169.254");
    add("172.16.0.0/12", "private, RFC 1918");
    add("192.0.0.0/24", "IETF protocol assignments; Oracle Cloud metadata at 192.0.0.192");
    add("192.0.2.0/24", "documentation, TEST-NET-1");
    add("192.88.99.0/24", "6to4 relay anycast, deprecated");
    add("192.168.0.0/16", "private, RFC 1918");
    add("198.18.0.0/15", "benchmarking, RFC 2544");
    add("198.51.100.0/24", "documentation, TEST-NET-2");
    add("203.0.113.0/24", "documentation, TEST-NET-3");
    add("224.0.0.0/4", "multicast");
    add("240.0.0.0/4", "reserved, and the broadcast address");
    add("::/128", "unspecified: this machine");
    add("::1/128", "loopback: this machine");
    add("::/96", "IPv4-compatible, deprecated");
    add("64:ff9b::/96", "NAT64", 12);
    add("64:ff9b:1::/48", "local-use NAT64, RFC 8215");
    add("100::/64", "discard-only, RFC 6666");
    add("2001::/32", "Teredo");
    add("2001:db8::/32", "documentation");
    add("2002::/16", "6to4", 2);
    add("fc00::/7", "unique local, RFC 4193; AWS metadata at fd00:ec2::254");
    add("fe80::/10", "link-local");
    add("fec0::/10", "site-local, deprecated");
    add("ff00::/8", "multicast");
    return t;
  }();
  return table;
}

}  // namespace

std::optional<std::string> special_range(const IpAddress& addr) {
  IpAddress a = addr.unmapped();
  for (auto& r : special_ranges()) {
    if (!r.range.contains(a)) continue;
    std::string where = r.range.text() + " (" + r.what + ")";
    if (r.embeds_at < 0) return where;
    // A translator would carry the connection on to the IPv4 address inside: that one decides.
    IpAddress inner;
    inner.v4 = true;
    std::copy_n(a.bytes.begin() + r.embeds_at, 4, inner.bytes.begin());
    auto in = special_range(inner);
    if (!in) return std::nullopt;
    return where + " for " + inner.text() + ", which is in " + *in;
  }
  return std::nullopt;
}

AddressPolicy::AddressPolicy(const std::vector<std::string>& allow_cidrs) {
  for (size_t i = 0; i < allow_cidrs.size(); ++i) {
    auto where = "allow_cidrs[" + std::to_string(i) + "]: \"" + allow_cidrs[i] + "\": ";
    auto c = parse_cidr(allow_cidrs[i]);
    if (!c) throw std::invalid_argument(where + c.error().message);
    bool special = false;
    for (auto& r : special_ranges()) special |= c->overlaps(r.range);
    if (!special)
      throw std::invalid_argument(where + "holds no special-purpose address (public addresses need no allowance; " +
                                  "names still need network.allow)");
    allow_.push_back(*c);
  }
}

base::Result<void> AddressPolicy::allows(const IpAddress& addr) const {
  IpAddress a = addr.unmapped();
  auto range = special_range(a);
  if (!range) return {};
  for (auto& c : allow_)
    if (c.contains(a)) return {};
  return base::fail(a.text() + " is in " + *range + ", which network.allow_cidrs does not allow");
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

}  // namespace sbx::egress
