#include <doctest/doctest.h>

#include "egress/broker-request.hpp"
#include "egress/egress-policy.hpp"
#include "profile/profile.hpp"

namespace profile = sbx::profile;
namespace egress = sbx::egress;

using namespace sbx::profile;

namespace {
std::string canon(std::string_view s) {
  auto h = egress::canonical_host(s);
  return h ? h->name : "<refused>";
}
bool allowed(const egress::HostPolicy& p, std::string_view host) {
  auto h = egress::canonical_host(host);
  return h && p.allows(*h);
}
// A query for `name` (type A) as a resolver library sends it.
std::string query(std::string_view name, uint16_t qtype = egress::kDnsTypeA) {
  std::string m = {'\x12', '\x34', '\x01', '\x00', 0, 1, 0, 0, 0, 0, 0, 0};
  size_t start = 0;
  while (start <= name.size()) {
    size_t dot = name.find('.', start);
    auto label = name.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
    m.push_back(static_cast<char>(label.size()));
    m.append(label);
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  m.push_back(0);
  m.push_back(static_cast<char>(qtype >> 8));
  m.push_back(static_cast<char>(qtype & 0xff));
  m.push_back(0);
  m.push_back(1);
  return m;
}
}  // namespace

TEST_CASE("egress: host names are brought to one form") {
  CHECK(canon("API.Example.COM.") == "api.example.com");
  CHECK(canon("127.1") == "127.0.0.1");
  CHECK(canon("0x7f.0.0.1") == "127.0.0.1");
  CHECK(canon("2130706433") == "127.0.0.1");
  CHECK(canon("[::1]") == "::1");
  CHECK(canon("0:0::1") == "::1");
  CHECK(canon("b\xc3\xbc"
              "cher.de") == "xn--bcher-kva.de");
  CHECK(canon("1.2.3.999") == "<refused>");
  CHECK(canon("a..b") == "<refused>");
  CHECK(canon("") == "<refused>");
  CHECK(canon(".") == "<refused>");
  CHECK(canon("a b.com") == "<refused>");
  CHECK(canon("evil.com%2f.good.com") == "<refused>");
  CHECK(canon("user@host") == "<refused>");
  CHECK(canon(std::string(64, 'a') + ".com") == "<refused>");
  CHECK(egress::canonical_host("127.0.0.1")->is_ip);
  CHECK_FALSE(egress::canonical_host("example.com")->is_ip);
}

TEST_CASE("egress: allow and deny lists") {
  egress::HostPolicy p({"api.anthropic.com", "*.pypi.org", "10.0.0.1"}, {"evil.pypi.org"});
  CHECK(allowed(p, "api.anthropic.com"));
  CHECK(allowed(p, "API.ANTHROPIC.COM."));
  CHECK(allowed(p, "files.pypi.org"));
  CHECK(allowed(p, "a.b.pypi.org"));
  SUBCASE("*.x does not match x") { CHECK_FALSE(allowed(p, "pypi.org")); }
  SUBCASE("deny wins") { CHECK_FALSE(allowed(p, "evil.pypi.org")); }
  SUBCASE("lookalikes") {
    CHECK_FALSE(allowed(p, "api.anthropic.com.evil.com"));
    CHECK_FALSE(allowed(p, "xapi.anthropic.com"));
    CHECK_FALSE(allowed(p, "api-anthropic.com"));
    CHECK_FALSE(allowed(p, "notpypi.org"));
    CHECK_FALSE(allowed(p, "api.anthr\xd0\xbepic.com"));  // Cyrillic o
    CHECK_FALSE(allowed(p, "xn--pypi-org.evil"));
  }
  SUBCASE("IP literals only when listed") {
    CHECK(allowed(p, "10.0.0.1"));
    CHECK(allowed(p, "10.1"));  // the same address, spelled otherwise
    CHECK_FALSE(allowed(p, "10.0.0.2"));
    CHECK_FALSE(allowed(p, "127.0.0.1"));
  }
  auto refused = p.allows(*egress::canonical_host("evil.pypi.org"));
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error().message.find("evil.pypi.org") != std::string::npos);
  CHECK_THROWS_AS(egress::HostPolicy({"*"}, {}), std::invalid_argument);
  CHECK_THROWS_AS(egress::HostPolicy({"a.*.com"}, {}), std::invalid_argument);
  CHECK_THROWS_AS(egress::HostPolicy({"*.10.0.0.1"}, {}), std::invalid_argument);
}

TEST_CASE("egress: special-purpose address ranges") {
  auto ip = [](std::string_view t) {
    auto a = egress::IpAddress::parse(t);
    REQUIRE(a);
    return *a;
  };
  auto range = [&](std::string_view t) { return egress::special_range(ip(t)).value_or("public"); };
  // Every range of the issue, IPv4 and IPv6, each named by its narrowest entry.
  for (auto [entry_addr, want] : std::initializer_list<std::pair<const char*, const char*>>{
           {"0.0.0.0", "0.0.0.0/8"},
           {"10.1.2.3", "10.0.0.0/8"},
           {"100.100.100.200", "100.64.0.0/10"},
           {"127.0.0.1", "127.0.0.0/8"},
           {"127.255.255.254", "127.0.0.0/8"},
           {"169.254.169.254", "169.254.0.0/16"},
           {"172.31.255.255", "172.16.0.0/12"},
           {"192.0.0.192", "192.0.0.0/24"},
           {"192.168.1.1", "192.168.0.0/16"},
           {"198.19.0.1", "198.18.0.0/15"},
           {"224.0.0.1", "224.0.0.0/4"},
           {"255.255.255.255", "240.0.0.0/4"},
           {"168.63.129.16", "168.63.129.16/32"},
           {"::", "::/128"},
           {"::1", "::1/128"},
           {"::ffff:10.0.0.1", "10.0.0.0/8"},
           {"::ffff:169.254.169.254", "169.254.0.0/16"},
           {"::10.0.0.1", "::/96"},
           {"64:ff9b::a01:203", "64:ff9b::/96 (NAT64) for 10.1.2.3, which is in 10.0.0.0/8"},
           {"64:ff9b::7f00:1", "for 127.0.0.1, which is in 127.0.0.0/8"},
           {"64:ff9b:1::1", "64:ff9b:1::/48"},
           {"fd00::1", "fc00::/7"},
           {"fd00:ec2::254", "fc00::/7"},
           {"fe80::1", "fe80::/10"},
           {"ff02::1", "ff00::/8"},
           {"2001:db8::1", "2001:db8::/32"},
           {"2002:a9fe:a9fe::1", "2002::/16 (6to4) for 169.254.169.254"}}) {
    const char* addr = entry_addr;  // CAPTURE's lambda takes no structured binding before clang 16
    CAPTURE(addr);
    CHECK(range(addr).find(want) != std::string::npos);
  }
  // Public addresses, including translations of public ones.
  for (auto* addr : {"1.1.1.1", "8.8.8.8", "100.63.255.255", "100.128.0.0", "172.32.0.1", "11.0.0.1", "2606:4700::1111",
                     "64:ff9b::101:101", "::ffff:1.1.1.1", "2002:101:101::1", "168.63.129.17"}) {
    CAPTURE(addr);
    CHECK(range(addr) == "public");
  }
}

TEST_CASE("egress: ranges are parsed strictly") {
  auto why = [](std::string_view t) {
    auto c = egress::parse_cidr(t);
    return c ? std::string("ok") : c.error().message;
  };
  CHECK(why("10.1.2.0/24") == "ok");
  CHECK(why("fd00::/8") == "ok");
  CHECK(why("127.0.0.1") == "ok");
  CHECK(egress::parse_cidr("127.0.0.1")->bits == 32);
  CHECK(egress::parse_cidr("::1")->bits == 128);
  CHECK(why("10.1.2.3/24").find("host bits are set (the range is 10.1.2.0/24)") != std::string::npos);
  CHECK(why("10.0.0.0/33").find("more than an IPv4") != std::string::npos);
  CHECK(why("10.0.0.0/08").find("decimal") != std::string::npos);
  CHECK(why("10.0.0.0/").find("decimal") != std::string::npos);
  CHECK(why("10.0.0.0/+8").find("decimal") != std::string::npos);
  CHECK(why("10.0.0/8").find("not an IPv4 or IPv6") != std::string::npos);
  CHECK(why("010.0.0.0/8").find("not an IPv4 or IPv6") != std::string::npos);
  CHECK(why("[fd00::]/8").find("not an IPv4 or IPv6") != std::string::npos);
  CHECK(why("example.com/8").find("not an IPv4 or IPv6") != std::string::npos);
  CHECK(why("::ffff:10.0.0.0/104").find("IPv4-mapped") != std::string::npos);
  CHECK(why("").find("not an IPv4") != std::string::npos);
}

TEST_CASE("egress: special ranges are refused unless allowed by range") {
  auto ip = [](std::string_view t) { return *egress::IpAddress::parse(t); };
  egress::AddressPolicy none(std::vector<std::string>{});
  CHECK(none.allows(ip("93.184.216.34")).has_value());
  auto why = none.allows(ip("169.254.169.254")).error().message;
  CHECK(why ==
        "169.254.169.254 is in 169.254.0.0/16 (link-local: cloud metadata services such as 169.254.169.254), "
        "which network.allow_cidrs does not allow");
  why = none.allows(ip("::ffff:127.0.0.1")).error().message;
  CHECK(why.starts_with("127.0.0.1 is in 127.0.0.0/8"));
  egress::AddressPolicy some({"10.1.2.0/24", "127.0.0.1", "fd00::/8", "64:ff9b::a01:200/120"});
  CHECK(some.allows(ip("10.1.2.3")).has_value());
  CHECK_FALSE(some.allows(ip("10.1.3.3")).has_value());
  CHECK(some.allows(ip("127.0.0.1")).has_value());
  CHECK(some.allows(ip("::ffff:127.0.0.1")).has_value());
  CHECK_FALSE(some.allows(ip("127.0.0.2")).has_value());
  CHECK(some.allows(ip("fd00::1")).has_value());
  CHECK_FALSE(some.allows(ip("fe80::1")).has_value());
  // A translated address is allowed by a range holding it, not by one holding what it embeds.
  CHECK(some.allows(ip("64:ff9b::a01:203")).has_value());
  CHECK_FALSE(egress::AddressPolicy({"10.0.0.0/8"}).allows(ip("64:ff9b::a01:203")).has_value());
  CHECK_THROWS_WITH_AS(egress::AddressPolicy({"10.0.0.0/8", "10.1.2.3/24"}),
                       doctest::Contains("allow_cidrs[1]: \"10.1.2.3/24\""), std::invalid_argument);
  CHECK_THROWS_WITH_AS(egress::AddressPolicy({"8.8.8.0/24"}), doctest::Contains("no special-purpose address"),
                       std::invalid_argument);
  CHECK_NOTHROW(egress::AddressPolicy({"0.0.0.0/0"}));
}

TEST_CASE("egress: DNS questions") {
  auto m = query("Files.PyPI.org");
  auto q = egress::parse_dns_query(m);
  REQUIRE(q);
  CHECK(q->id == 0x1234);
  CHECK(q->name == "Files.PyPI.org");
  CHECK(q->qtype == egress::kDnsTypeA);
  auto r = egress::make_dns_reply(m, *q, egress::kDnsNoError, {std::string("\x7f\x00\x00\x01", 4)});
  CHECK(r.size() == m.size() + 16);
  CHECK((static_cast<unsigned char>(r[2]) & 0x80));  // a response
  CHECK(r[7] == 1);                                  // one answer
  auto refused = egress::make_dns_reply(m, *q, egress::kDnsRefused);
  CHECK((refused[3] & 0xf) == egress::kDnsRefused);
  SUBCASE("malformed messages are not read") {
    CHECK_FALSE(egress::parse_dns_query(m.substr(0, 11)));
    CHECK_FALSE(egress::parse_dns_query(m.substr(0, m.size() - 1)));
    std::string two = m;
    two[5] = 2;
    CHECK_FALSE(egress::parse_dns_query(two));
    std::string reply = m;
    reply[2] = '\x81';
    CHECK_FALSE(egress::parse_dns_query(reply));
    std::string ptr = m.substr(0, 12) + "\xc0\x0c" + std::string("\0\1\0\1", 4);
    CHECK_FALSE(egress::parse_dns_query(ptr));
    std::string dotted = query("a.b");
    dotted[13] = '.';  // the label "a" becomes "."
    CHECK_FALSE(egress::parse_dns_query(dotted));
    uint16_t id = 0;
    CHECK_FALSE(egress::parse_dns_query(m.substr(0, 13), &id));
    CHECK(id == 0x1234);
  }
  SUBCASE("names longer than DNS allows") {
    std::string long_name;
    for (int i = 0; i < 5; ++i) long_name += std::string(60, 'a') + ".";
    long_name += "com";
    CHECK_FALSE(egress::parse_dns_query(query(long_name)));
  }
}

TEST_CASE("profile: network and credentials") {
  auto p = profile::parse_profile(
      R"({"network":{"mode":"proxy","allow":["api.example.com"],"resolve":{"api.example.com":"127.0.0.1"}},
    "credentials":[{"name":"anthropic","source":{"env":"KEY"},"bind":{"host":"api.example.com","port":8443},
                    "inject":{"header":"X-Api-Key","format":"{}"},"placeholder_env":"ANTHROPIC_API_KEY",
                    "base_url_env":"ANTHROPIC_BASE_URL"}]})");
  CHECK(p.network.mode == profile::NetworkPolicy::Mode::Proxy);
  REQUIRE(p.credentials.size() == 1);
  CHECK(p.credentials[0].header == "x-api-key");
  CHECK(p.credentials[0].placeholder == "sbx-placeholder-anthropic");
  CHECK_THROWS_WITH_AS(profile::apply_override(p, "network.mode=host"),
                       doctest::Contains("need network.mode \"proxy\""), sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"network":{"mode":"open"}})"), doctest::Contains("network.mode"),
                       sbx::profile::ProfileError);
  SUBCASE("a string is short for the mode") {
    CHECK(profile::parse_profile(R"({"network":"none"})").network.mode == profile::NetworkPolicy::Mode::None);
    profile::Profile q = parse_profile(R"({"network":{"mode":"proxy","allow":["a.com"]}})");
    profile::apply_override(q, "network=host");
    CHECK(q.network.mode == profile::NetworkPolicy::Mode::Host);
    CHECK(q.network.allow == std::vector<std::string>{"a.com"});  // the rest of the object stays
    CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"network":"wifi"})"), doctest::Contains("network"),
                         sbx::profile::ProfileError);
    CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"network":7})"), doctest::Contains("network"),
                         sbx::profile::ProfileError);
  }
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"network":{"allow":["a.*.com"]}})"),
                       doctest::Contains("network.allow"), sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"network":{"resolve":{"a.com":"nope"}}})"),
                       doctest::Contains("network.resolve.a.com"), sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(
      profile::parse_profile(
          R"({"network":{"mode":"proxy"},"credentials":[{"name":"x","source":{"env":"K","file":"/f"},"bind":{"host":"h"}}]})"),
      doctest::Contains("credentials[0].source"), sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(
      profile::parse_profile(
          R"({"network":{"mode":"proxy"},"credentials":[{"name":"x","source":{"env":"K"},"bind":{"scheme":"http","host":"h"}}]})"),
      doctest::Contains("credentials[0].bind.scheme"), sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(
      profile::parse_profile(
          R"({"network":{"mode":"proxy","deny":["h.com"]},"credentials":[{"name":"x","source":{"env":"K"},"bind":{"host":"h.com"}}]})"),
      doctest::Contains("denied"), sbx::profile::ProfileError);
  CHECK(
      profile::parse_profile(R"({"network":{"allow_cidrs":["10.1.2.0/24","fd00::/8"]}})").network.allow_cidrs.size() ==
      2);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"network":{"allow_cidrs":["10.1.2.3/24"]}})"),
                       doctest::Contains("network.allow_cidrs[0]: \"10.1.2.3/24\": host bits are set"),
                       sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"network":{"allow_cidrs":"10.0.0.0/8"}})"),
                       doctest::Contains("network.allow_cidrs: expected a list"), sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"network":{"allow_cidrs":[10]}})"),
                       doctest::Contains("network.allow_cidrs[0]"), sbx::profile::ProfileError);
}

TEST_CASE("broker: targets and coding headers") {
  auto t = egress::route_target("http://www.example.org:8080?x=1", 3128);
  CHECK(t.kind == egress::Target::Kind::Plain);
  CHECK(t.authority == "www.example.org:8080");
  CHECK(t.path == "/?x=1");
  t = egress::route_target("http://LOCALHOST:3128/api/v1?q", 3128);
  CHECK(t.kind == egress::Target::Kind::Credential);
  CHECK(t.own_url);
  CHECK(t.credential == "api");
  CHECK(t.rest == "/v1?q");
  t = egress::route_target("/api?q", 3128);
  CHECK(t.kind == egress::Target::Kind::Credential);
  CHECK(t.rest == "/?q");
  CHECK(egress::route_target("http://127.0.0.1:3129/api", 3128).kind == egress::Target::Kind::Plain);
  CHECK(egress::route_target("*", 3128).kind == egress::Target::Kind::Bad);
  CHECK(egress::route_target("https://x/", 3128).kind == egress::Target::Kind::Bad);
  CHECK_FALSE(egress::coded("", false));
  CHECK_FALSE(egress::coded(" identity ", false));
  CHECK(egress::coded("gzip", false));
  CHECK(egress::coded("identity, br", false));
  CHECK_FALSE(egress::coded("chunked", true));
  CHECK(egress::coded("gzip, chunked", true));
  CHECK(egress::coded("chunked", false));
}
