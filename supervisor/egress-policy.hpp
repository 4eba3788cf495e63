#pragma once
// The egress policy's pure parts: host names brought to one canonical form, the allow/deny
// matcher, and the minimal DNS message handling the broker's resolver needs. No I/O here, so the
// unit tests cover every rule.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sbx::supervisor {

/// A host as the policy compares it: lowercase A-labels (IDNA for Unicode names), no trailing
/// dot; an IP literal in its canonical text form (IPv6 without brackets).
struct CanonicalHost {
  std::string name;
  bool is_ip = false;
};

/// Canonicalizes a host from a request, a DNS question or a profile. Returns nullopt with `why`
/// for anything that is not a plain host name or IP literal (empty labels, odd characters, an
/// all-numeric last label that is not a valid address, names longer than DNS allows, Unicode
/// that IDNA refuses).
std::optional<CanonicalHost> canonical_host(std::string_view raw, std::string* why = nullptr);

/// Allow and deny lists of exact names, IP literals and `*.suffix` patterns.
class HostPolicy {
 public:
  /// Throws std::invalid_argument naming the bad entry.
  HostPolicy(const std::vector<std::string>& allow, const std::vector<std::string>& deny);
  HostPolicy() = default;

  /// Whether `host` (canonical) may be reached; when not, `why` says which rule refused it.
  /// Deny wins; `*.x` matches names below x but not x itself; an IP literal matches only an
  /// identical IP entry.
  bool allows(const CanonicalHost& host, std::string* why = nullptr) const;

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

/// One DNS question as the broker's resolver reads it.
struct DnsQuestion {
  uint16_t id = 0;
  uint16_t flags = 0;
  std::string name;      // as sent, dots between labels, no trailing dot
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

}  // namespace sbx::supervisor
