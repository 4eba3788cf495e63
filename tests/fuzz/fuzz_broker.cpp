// libFuzzer target: one request as the agent sends it to the egress broker, read the way the
// broker reads it (Boost.Beast's parser, then the target, the authority, the host name and the
// allow list, the credential path, the coding headers); the same bytes as a DNS question for the
// broker's resolver, and as an address or range for the address policy. Any crash, leak or
// sanitizer report is a bug, and so is a broken invariant (__builtin_trap below).
#include <boost/asio/buffer.hpp>
#include <boost/beast/http.hpp>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "egress/broker-request.hpp"
#include "egress/egress-policy.hpp"

using namespace sbx::egress;
namespace http = boost::beast::http;

namespace {

const HostPolicy& policy() {
  static const HostPolicy p({"api.example.com", "*.example.org", "10.0.0.1", "::1"}, {"bad.example.org"});
  return p;
}
const AddressPolicy& addresses() {
  static const AddressPolicy p({"10.1.2.0/24", "fd00::/8", "127.0.0.1"});
  return p;
}

// A host through canonicalisation and the allow list; a canonical name must be a fixed point.
void check_host(std::string_view raw) {
  auto h = canonical_host(raw);
  if (!h) return;
  auto again = canonical_host(h->name);
  if (!again || again->name != h->name || again->is_ip != h->is_ip) __builtin_trap();
  (void)policy().allows(*h);
  if (h->is_ip) {
    auto a = IpAddress::parse(h->name);
    if (!a) __builtin_trap();  // canonical_host's address is one the address policy reads
    (void)addresses().allows(*a);
  }
}

void check_request(std::string_view text) {
  http::request_parser<http::string_body> p;
  p.header_limit(16 * 1024);
  p.body_limit(1 << 20);
  p.eager(true);
  boost::beast::error_code ec;
  p.put(boost::asio::buffer(text.data(), text.size()), ec);
  if (!p.is_header_done()) return;
  const auto& req = p.get();
  std::string host;
  int port = 0;
  if (req.method() == http::verb::connect) {
    if (split_authority(req.target(), host, port, 443)) {
      if (port < 1 || port > 65535) __builtin_trap();
      check_host(host);
    }
  } else {
    auto t = route_target(req.target(), 3128);
    if (t.kind == Target::Kind::Plain) {
      if (t.path.empty() || t.path.front() != '/') __builtin_trap();
      if (split_authority(t.authority, host, port, 80)) check_host(host);
    } else if (t.kind == Target::Kind::Credential) {
      if (t.rest.empty() || t.rest.front() != '/') __builtin_trap();
      (void)escapes_prefix(t.rest);
    }
  }
  for (auto& f : req) (void)coded(f.value(), f.name() == http::field::transfer_encoding);
}

void check_dns(std::string_view msg) {
  uint16_t id = 0;
  auto q = parse_dns_query(msg, &id);
  if (!q) {
    if (make_dns_error(id, kDnsFormErr).size() != 12) __builtin_trap();
    return;
  }
  if (q->question_end > msg.size()) __builtin_trap();
  check_host(q->name);
  auto reply = make_dns_reply(msg, *q, kDnsNoError, {std::string(4, '\x0a'), std::string(16, '\xfd')});
  if (reply.size() != q->question_end + 16 + 28) __builtin_trap();
}

void check_addresses(std::string_view text) {
  if (auto c = parse_cidr(text.substr(0, 64))) {
    auto again = parse_cidr(c->text());
    if (!again || again->text() != c->text() || !c->contains(c->net)) __builtin_trap();
  }
  for (size_t n : {size_t{4}, size_t{16}}) {
    if (text.size() < n) continue;
    auto a = IpAddress::from_bytes(text.substr(0, n));
    if (!a) __builtin_trap();
    bool special = special_range(*a).has_value();
    if (!special && !addresses().allows(*a)) __builtin_trap();  // only special ranges are refused
    if (!IpAddress::parse(a->text())) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  check_request(text);
  check_dns(text);
  check_addresses(text);
  return 0;
}
