#pragma once
// The egress policy's pure parts: host names brought to one canonical form, the allow/deny
// matcher, and the minimal DNS message handling the broker's resolver needs. No I/O here, so the
// unit tests cover every rule.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.hpp"

namespace sbx::egress {

/// A host as the policy compares it: lowercase A-labels (IDNA for Unicode names), no trailing
/// dot; an IP literal in its canonical text form (IPv6 without brackets).
struct CanonicalHost {
  std::string name;
  bool is_ip = false;
};

/// Canonicalizes a host from a request, a DNS question or a profile. The error says why for
/// anything that is not a plain host name or IP literal (empty labels, odd characters, an
/// all-numeric last label that is not a valid address, names longer than DNS allows, Unicode
/// that IDNA refuses).
base::Result<CanonicalHost> canonical_host(std::string_view raw);

/// Allow and deny lists of exact names, IP literals and `*.suffix` patterns.
class HostPolicy {
 public:
  /// Throws std::invalid_argument naming the bad entry.
  HostPolicy(const std::vector<std::string>& allow, const std::vector<std::string>& deny);
  HostPolicy() = default;

  /// Whether `host` (canonical) may be reached; when not, the error says which rule refused it.
  /// Deny wins; `*.x` matches names below x but not x itself; an IP literal matches only an
  /// identical IP entry.
  base::Result<void> allows(const CanonicalHost& host) const;

 private:
  struct Pattern {
    std::string text;  // for messages
    std::string host;  // canonical name, or the suffix without "*."
    bool wildcard = false;
    bool is_ip = false;
  };
  static Pattern parse_pattern(const std::string& entry, const char* list);
  static bool matches(const Pattern& p, const CanonicalHost& h);
  std::vector<Pattern> allow_, deny_;
};

/// An IP address as the broker connects to it: IPv4 in the first 4 bytes, or IPv6 in all 16.
struct IpAddress {
  std::array<uint8_t, 16> bytes{};
  bool v4 = false;

  /// A literal in its plain text form ("10.0.0.1", "fd00::1"; no brackets, no zone); nullopt
  /// for anything else.
  static std::optional<IpAddress> parse(std::string_view text);
  /// 4 bytes (IPv4) or 16 (IPv6), as on the wire; nullopt for any other size.
  static std::optional<IpAddress> from_bytes(std::string_view raw);
  std::string text() const;
  /// An IPv4-mapped IPv6 address (::ffff:a.b.c.d) is the IPv4 address it carries: a socket
  /// connecting to it reaches that address.
  IpAddress unmapped() const;
  bool operator==(const IpAddress&) const = default;
};

/// A range of addresses: "10.1.2.0/24", "fd00::/8"; a bare address is a /32 or /128.
struct Cidr {
  IpAddress net;
  int bits = 0;
  bool contains(const IpAddress& a) const;  // false across families
  bool overlaps(const Cidr& o) const;
  std::string text() const;
};

/// Parses a range strictly: the address part a plain literal, the length 0..32 or 0..128 in
/// decimal, no host bits set (the error then names the range meant), no IPv4-mapped IPv6 range
/// (write the IPv4 one). The error says why for anything else.
base::Result<Cidr> parse_cidr(std::string_view text);

/// Where `a` is not a public unicast address, the special-purpose range it lies in and what that
/// range is ("169.254.0.0/16 (link-local: cloud metadata services such as 169.254.169.254)");
/// for an address that embeds an IPv4 one (NAT64 64:ff9b::/96, 6to4 2002::/16), the range of
/// the address it embeds. nullopt for a public address.
std::optional<std::string> special_range(const IpAddress& a);

/// The address half of the egress policy: any public address may be connected to (the name
/// was allowed by HostPolicy already); an address in a special-purpose range (private, loopback,
/// link-local and metadata, shared, multicast, reserved, unique local, NAT64 of any of those) only
/// when a range of `network.allow_cidrs` holds it.
class AddressPolicy {
 public:
  /// Throws std::invalid_argument naming the bad entry (by index) and what is wrong with it.
  explicit AddressPolicy(const std::vector<std::string>& allow_cidrs);
  AddressPolicy() = default;

  /// Whether the broker may connect to `a` (IPv4-mapped addresses are read as their IPv4
  /// address); when not, the error names the address, its range and the missing allowance.
  base::Result<void> allows(const IpAddress& a) const;

 private:
  std::vector<Cidr> allow_;
};

/// One DNS question as the broker's resolver reads it.
struct DnsQuestion {
  uint16_t id = 0;
  uint16_t flags = 0;
  std::string name;  // as sent, dots between labels, no trailing dot
  uint16_t qtype = 0;
  uint16_t qclass = 0;
  size_t question_end = 0;  // offset just past the question in the message
};

inline constexpr uint16_t kDnsTypeA = 1, kDnsTypeAAAA = 28;
inline constexpr uint8_t kDnsNoError = 0, kDnsFormErr = 1, kDnsServFail = 2, kDnsNxDomain = 3, kDnsNotImp = 4,
                         kDnsRefused = 5;

/// Parses a query with exactly one question (no compression in it). nullopt for anything else;
/// `id` is set whenever the message had a header, so a FORMERR can still be answered.
std::optional<DnsQuestion> parse_dns_query(std::string_view msg, uint16_t* id = nullptr);

/// A reply to `q` (taken from `query`) with `rcode` and the given addresses as answers: 4-byte
/// entries for A, 16-byte entries for AAAA.
std::string make_dns_reply(std::string_view query, const DnsQuestion& q, uint8_t rcode,
                           const std::vector<std::string>& addresses = {}, uint32_t ttl = 60);

/// A header-only reply (FORMERR and the like) for a message we could not read.
std::string make_dns_error(uint16_t id, uint8_t rcode);

}  // namespace sbx::egress
