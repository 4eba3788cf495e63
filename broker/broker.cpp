#include "broker/broker.hpp"

#include <spdlog/spdlog.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/as_tuple.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <optional>
#include <thread>

#include "base/encoding.hpp"
#include "egress/broker-request.hpp"
#include "egress/egress-policy.hpp"
#include "os/openssl.hpp"
#include "os/socket-owner.hpp"

namespace sbx::broker {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using udp = asio::ip::udp;
using asio::awaitable;
using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

namespace {

constexpr auto nothrow = asio::as_tuple(asio::use_awaitable);
constexpr size_t kMaxConnections = 256;
constexpr size_t kMaxDnsTcpConnections = 16;
// Lookups the resolver passes on to the system's (a name neither pinned nor an address) at once;
// past this a question is answered SERVFAIL at once rather than queued without bound.
constexpr size_t kMaxDnsInFlight = 64;
// Threads that run the system's resolver (getaddrinfo blocks); made at the first lookup.
constexpr size_t kLookupThreads = 4;
constexpr uint64_t kMaxResponseBody = 1ull << 30;  // streamed, never held whole
constexpr auto kTunnelIdle = std::chrono::minutes(10);

auto log() {
  static auto l = spdlog::default_logger()->clone("broker");
  return l;
}

Response text_response(http::status st, std::string text, unsigned version = 11) {
  Response r{st, version};
  r.set(http::field::server, "sandboxer-broker");
  r.set(http::field::content_type, "text/plain; charset=utf-8");
  r.keep_alive(false);
  r.body() = std::move(text) + "\n";
  r.prepare_payload();
  return r;
}

bool iequals(std::string_view a, std::string_view b) { return beast::iequals(a, b); }

// Headers that describe one hop, never forwarded; and the ways a caller could send a credential.
bool hop_by_hop(std::string_view name) {
  for (auto* h : {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
                  "trailer", "transfer-encoding", "upgrade", "expect"})
    if (iequals(name, h)) return true;
  return false;
}
bool auth_header(std::string_view name) {
  for (auto* h : {"authorization", "x-api-key", "api-key", "x-goog-api-key", "cookie"})
    if (iequals(name, h)) return true;
  return false;
}

void replace_all(std::string& s, std::string_view what, std::string_view with) {
  if (what.empty()) return;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + with.size()))
    s.replace(at, what.size(), with);
}

// Who sent a request: the agent's end of the connection, to find the process holding it.
struct Peer {
  bool tcp = true;
  uint16_t port = 0;
  uint16_t local = 0;  // the broker's own port it reached; 0: the proxy port (TCP) or 53 (UDP)
};

// The agent's connection while one request is served: a relayed response is written straight
// to it (streamed); an error response is left to the caller.
struct Conn {
  beast::tcp_stream& client;
  Peer peer;
  bool keep = true;       // the connection can serve another request afterwards
  bool streamed = false;  // the response was written already
};

}  // namespace

struct Broker::Impl {
  BrokerConfig cfg;
  egress::HostPolicy policy;
  Sink sink;
  std::vector<std::unique_ptr<ssl::context>> tls;  // by credential; outlives the io_context's handlers
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  udp::socket dns{io};
  tcp::acceptor dns_tcp{io};
  egress::AddressPolicy addresses;
  std::atomic<size_t> connections{0};
  std::atomic<size_t> dns_tcp_connections{0};
  size_t dns_inflight = 0;  // on the broker's thread only
  // Refusals are reported at most kDenyBurst per second; the rest are counted and the count
  // rides on the next report, so a flood cannot flood the journal.
  static constexpr int kDenyBurst = 50;
  std::chrono::steady_clock::time_point deny_window{};
  int deny_count = 0;
  uint64_t deny_suppressed = 0;
  std::thread thread;
  std::optional<asio::thread_pool> lookups;  // after `io`: joined before it is destroyed

  Impl(BrokerConfig c, Sink s)
      : cfg(std::move(c)),
        policy(cfg.network.allow, cfg.network.deny),
        sink(std::move(s)),
        addresses(cfg.network.allow_cidrs) {}

  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(cfg.network.timeout_ms); }

  void deny(std::string what, std::string host, int port, std::string reason, boost::json::object extra = {},
            Peer peer = {}) {
    auto now = std::chrono::steady_clock::now();
    if (now - deny_window >= std::chrono::seconds(1)) {
      deny_window = now;
      deny_count = 0;
    }
    if (++deny_count > kDenyBurst) {
      ++deny_suppressed;
      return;
    }
    if (deny_suppressed) {
      extra["suppressed_before"] = deny_suppressed;
      deny_suppressed = 0;
    }
    if (peer.port && cfg.netns_pid > 0) {
      auto local = peer.local ? peer.local : peer.tcp ? static_cast<uint16_t>(cfg.network.proxy_port) : uint16_t{53};
      if (auto pid = os::socket_owner(cfg.netns_pid, cfg.netns, peer.tcp, peer.port, local)) extra["pid"] = *pid;
    }
    boost::json::object e{{"type", "policy.denied"}, {"what", std::move(what)}, {"host", std::move(host)}};
    if (port > 0) e["port"] = port;
    e["reason"] = std::move(reason);
    e["proc"] = cfg.proc;
    for (auto& kv : extra) e[kv.key()] = kv.value();
    // The sink must never see a secret: refusals carry names, hosts and reasons only.
    try {
      sink(std::move(e));
    } catch (...) {
    }
  }

  // Which credential's placeholder, if any, the request carries (target, any header, body).
  std::optional<size_t> placeholder_in(const Request& req) const {
    for (size_t i = 0; i < cfg.credentials.size(); ++i) {
      const auto& ph = cfg.credentials[i].placeholder;
      bool found =
          std::string_view(req.target()).find(ph) != std::string_view::npos || req.body().find(ph) != std::string::npos;
      for (auto& f : req)
        found |= f.value().find(ph) != std::string_view::npos || f.name_string().find(ph) != std::string_view::npos;
      if (found) return i;
    }
    return std::nullopt;
  }

  // What resolving a host gave: the addresses the broker may connect to, or why there are none.
  struct Resolved {
    boost::system::error_code ec;  // access_denied: every address was in a range not allowed
    std::vector<tcp::endpoint> eps;
    std::string refused, why;  // the first address refused, and the reason
    boost::json::object denial() const { return {{"address", refused}}; }
  };

  static egress::IpAddress ip_of(const asio::ip::address& a) {
    if (a.is_v4()) {
      auto b = a.to_v4().to_bytes();
      return *egress::IpAddress::from_bytes(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
    }
    auto b = a.to_v6().to_bytes();
    return *egress::IpAddress::from_bytes(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
  }

  // The system's resolver, for a name neither pinned nor an address. Asio's async_resolve runs
  // every lookup of a context on one thread of its own, one after another, so a name whose DNS
  // is slow held every lookup behind it (the agent's DNS questions and the proxy's connects
  // alike); each lookup runs getaddrinfo on the pool instead, kLookupThreads at once (at most
  // kMaxDnsInFlight of the agent's wait), and its result is handed back on the broker's thread.
  template <class Token>
  auto async_lookup(std::string host, int port, Token&& token) {
    return asio::async_initiate<Token, void(boost::system::error_code, tcp::resolver::results_type)>(
        [this](auto handler, std::string host, int port) {
          if (!lookups) lookups.emplace(kLookupThreads);
          asio::post(*lookups, [this, handler = std::move(handler), host = std::move(host), port,
                                work = asio::make_work_guard(io)]() mutable {
            tcp::resolver r(io);  // its synchronous resolve is getaddrinfo, on this thread
            boost::system::error_code ec;
            auto found = r.resolve(host, std::to_string(port), ec);
            asio::post(io, [handler = std::move(handler), ec, found = std::move(found)]() mutable {
              std::move(handler)(ec, std::move(found));
            });
          });
        },
        token, std::move(host), port);
  }

  // A host's addresses (a `resolve` pin, the address it is, or the system's resolver), each
  // checked against the address policy. The caller connects only to what this returns: the name
  // is resolved once and what was checked is what is used, so a name that DNS re-points between a
  // check and a connect (rebinding) gains nothing.
  awaitable<Resolved> resolve(const std::string& host, int port) {
    Resolved out;
    std::vector<asio::ip::address> found;
    std::string h = host;
    if (auto it = cfg.network.resolve.find(host); it != cfg.network.resolve.end()) h = it->second;
    boost::system::error_code ec;
    if (auto addr = asio::ip::make_address(h, ec); !ec) {
      found.push_back(addr);
    } else {
      auto [rec, results] = co_await async_lookup(h, port, nothrow);
      if (rec) {
        out.ec = rec;
        co_return out;
      }
      for (auto& e : results) found.push_back(e.endpoint().address());
    }
    for (auto& a : found) {
      if (auto ok = addresses.allows(ip_of(a))) {
        out.eps.emplace_back(a, static_cast<uint16_t>(port));
      } else if (out.refused.empty()) {
        out.refused = ip_of(a).unmapped().text();
        out.why = std::move(ok.error().message);
      }
    }
    if (out.eps.empty() && out.refused.empty()) out.ec = asio::error::host_not_found;
    if (out.eps.empty() && !out.refused.empty()) out.ec = asio::error::access_denied;
    co_return out;
  }

  awaitable<Resolved> connect(beast::tcp_stream& s, const std::string& host, int port) {
    auto r = co_await resolve(host, port);
    if (r.ec) co_return r;
    s.expires_after(timeout());
    auto [cec, ep] = co_await s.async_connect(r.eps, nothrow);
    r.ec = cec;
    co_return r;
  }

  // Relays the upstream's response to the agent as it arrives (an LLM's streamed tokens reach
  // the agent live), chunked toward HTTP/1.1 clients, with the secret (should an upstream echo
  // it) replaced by the placeholder, in headers and across chunk boundaries alike. Returns the
  // error when nothing was sent to the agent yet (the caller answers 502); once the header is
  // out, a failure can only end the connection.
  template <class Stream>
  awaitable<std::optional<std::string>> relay(Stream& s, beast::tcp_stream& up_tcp, Request& up_req, Conn& conn,
                                              unsigned version, const profile::Credential* c,
                                              const std::string* secret) {
    up_tcp.expires_after(timeout());
    auto [wec, wn] = co_await http::async_write(s, up_req, nothrow);
    if (wec) co_return "send: " + wec.message();
    beast::flat_buffer b;
    http::response_parser<http::buffer_body> p;
    p.header_limit(64 * 1024);
    p.body_limit(kMaxResponseBody);
    up_tcp.expires_after(timeout());
    auto [hec, hn] = co_await http::async_read_header(s, b, p, nothrow);
    if (hec) co_return "read response: " + hec.message();
    if (secret) {
      // The request asked for identity; a body coded all the same would carry the secret past
      // the scrub, so it is not relayed at all.
      for (auto field : {http::field::content_encoding, http::field::transfer_encoding}) {
        auto v = p.get()[field];
        if (!egress::coded(v, field == http::field::transfer_encoding)) continue;
        std::string why = "upstream answered with " + std::string(http::to_string(field)) + ": " +
                          std::string(v.substr(0, 64)) +
                          " (asked for identity); the secret could not be scrubbed from it";
        deny("credential", c->host, c->port, why, {{"credential", c->name}}, conn.peer);
        co_return why;
      }
    }

    http::response<http::buffer_body> res{p.get().result(), version};
    for (auto& f : p.get()) {
      if (hop_by_hop(f.name_string()) || iequals(f.name_string(), "content-length")) continue;
      std::string v(f.value());
      if (secret) replace_all(v, *secret, c->placeholder);
      res.insert(f.name_string(), v);
    }
    bool bodyless = p.get().result_int() / 100 == 1 || p.get().result() == http::status::no_content ||
                    p.get().result() == http::status::not_modified || up_req.method() == http::verb::head;
    if (version >= 11) {
      res.keep_alive(conn.keep);
      if (!bodyless) res.chunked(true);
    } else {
      conn.keep = false;
      res.keep_alive(false);
    }
    conn.streamed = true;
    res.body().data = nullptr;
    res.body().more = !bodyless;
    http::response_serializer<http::buffer_body> sr{res};
    conn.client.expires_after(timeout());
    auto [cec, cn] = co_await http::async_write_header(conn.client, sr, nothrow);
    if (cec) {
      conn.keep = false;
      co_return std::nullopt;
    }
    std::string carry;
    size_t hold = secret ? secret->size() - 1 : 0;
    std::array<char, 16384> buf;
    bool ok = true;
    while (!bodyless && !p.is_done()) {
      p.get().body().data = buf.data();
      p.get().body().size = buf.size();
      up_tcp.expires_after(timeout());
      // read_some: whatever has arrived goes on at once, rather than waiting to fill `buf`.
      auto [rec, rn] = co_await http::async_read_some(s, b, p, nothrow);
      if (rec == http::error::need_buffer) rec = {};
      if (rec == ssl::error::stream_truncated && p.is_done()) rec = {};
      if (rec) {
        log()->warn("relay a response: {}", rec.message());
        ok = false;
        break;
      }
      carry.append(buf.data(), buf.size() - p.get().body().size);
      if (secret) replace_all(carry, *secret, c->placeholder);
      // Only a tail that could be the start of the secret waits for the next piece.
      size_t held = 0;
      if (!p.is_done())
        for (size_t k = std::min(hold, carry.size()); k > 0 && held == 0; --k)
          if (std::string_view(carry).ends_with(std::string_view(*secret).substr(0, k))) held = k;
      size_t send = carry.size() - held;
      if (send == 0) continue;
      res.body().data = carry.data();
      res.body().size = send;
      res.body().more = true;
      conn.client.expires_after(timeout());
      auto [xec, xn] = co_await http::async_write(conn.client, sr, nothrow);
      if (xec && xec != http::error::need_buffer) {
        ok = false;
        break;
      }
      carry.erase(0, send);
    }
    if (ok && !bodyless) {
      res.body().data = nullptr;
      res.body().size = 0;
      res.body().more = false;
      conn.client.expires_after(timeout());
      auto [xec, xn] = co_await http::async_write(conn.client, sr, nothrow);
      ok = !xec;
    }
    if (!ok) conn.keep = false;
    co_return std::nullopt;
  }

  // The upstream request: the caller's, less hop-by-hop headers and (for credentials) less any
  // credential the caller sent.
  Request upstream_request(const Request& req, std::string target, const std::string& host_header, bool strip_auth) {
    Request up{req.method(), target, 11};
    for (auto& f : req) {
      auto n = f.name_string();
      if (hop_by_hop(n) || iequals(n, "host") || iequals(n, "content-length")) continue;
      if (strip_auth && auth_header(n)) continue;
      up.insert(n, f.value());
    }
    up.set(http::field::host, host_header);
    up.keep_alive(false);
    up.body() = req.body();
    up.prepare_payload();
    return up;
  }

  awaitable<Response> credential_request(Request& req, size_t ci, std::string rest, Conn& conn) {
    Peer peer = conn.peer;
    const profile::Credential& c = cfg.credentials[ci];
    const std::string& secret = cfg.secrets[ci];
    if (auto other = placeholder_in(req); other && *other != ci) {
      const auto& o = cfg.credentials[*other];
      deny("credential", c.host, c.port, "placeholder of credential \"" + o.name + "\" sent toward " + c.host,
           {{"credential", o.name}}, peer);
      co_return text_response(http::status::forbidden,
                              "sandboxer broker: credential \"" + o.name + "\" is not bound to " + c.host,
                              req.version());
    }
    if (egress::escapes_prefix(rest)) {
      deny("credential", c.host, c.port, "path leaves the binding's prefix", {{"credential", c.name}}, peer);
      co_return text_response(http::status::forbidden,
                              "sandboxer broker: \".\" and \"..\" segments (plain or %-encoded) are refused",
                              req.version());
    }
    std::string host_header = c.host + (c.port == 443 ? "" : ":" + std::to_string(c.port));
    Request up = upstream_request(req, c.path_prefix + rest, host_header, true);
    up.erase(c.header);
    // The response is scrubbed of the secret byte by byte, which works only on the whole body as
    // plain bytes: no compression (the agent's Accept-Encoding is not passed on) and no ranges
    // (a secret fetched a few bytes at a time would never match whole).
    up.set(http::field::accept_encoding, "identity");
    up.erase(http::field::range);
    up.erase(http::field::if_range);
    std::string value = c.format;
    replace_all(value, "{}", secret);
    up.set(c.header, value);

    beast::ssl_stream<beast::tcp_stream> s(io, *tls[ci]);
    auto where = c.host + ":" + std::to_string(c.port);
    auto fail = [&](std::string what) {
      log()->warn("credential {}: upstream {}: {}", c.name, where, what);
      return text_response(http::status::bad_gateway, "sandboxer broker: upstream " + where + ": " + what,
                           req.version());
    };
    if (auto r = co_await connect(beast::get_lowest_layer(s), c.host, c.port); r.ec == asio::error::access_denied) {
      auto extra = r.denial();
      extra["credential"] = c.name;
      deny("credential", c.host, c.port, r.why, std::move(extra), peer);
      co_return text_response(http::status::forbidden, "sandboxer broker: upstream " + where + ": " + r.why,
                              req.version());
    } else if (r.ec) {
      co_return fail("connect: " + r.ec.message());
    }
    auto canonical = egress::canonical_host(c.host);
    bool is_ip = canonical && canonical->is_ip;
    if (!is_ip) SSL_set_tlsext_host_name(s.native_handle(), c.host.c_str());
    s.set_verify_mode(ssl::verify_peer);
    s.set_verify_callback(ssl::host_name_verification(c.host));
    beast::get_lowest_layer(s).expires_after(timeout());
    auto [hec] = co_await s.async_handshake(ssl::stream_base::client, nothrow);
    if (hec) co_return fail("TLS handshake: " + hec.message());
    auto err = co_await relay(s, beast::get_lowest_layer(s), up, conn, req.version(), &c, &secret);
    up.set(c.header, "");
    if (err) co_return fail(*err);
    co_return Response{};
  }

  awaitable<Response> forward_plain(Request& req, const std::string& authority, std::string path, Conn& conn) {
    Peer peer = conn.peer;
    std::string raw_host;
    int port;
    if (!egress::split_authority(authority, raw_host, port, 80))
      co_return text_response(http::status::bad_request, "sandboxer broker: bad host in target", req.version());
    auto h = egress::canonical_host(raw_host);
    if (!h) {
      deny("egress", raw_host.substr(0, 255), port, h.error().message, {}, peer);
      co_return text_response(http::status::forbidden, "sandboxer broker: " + h.error().message, req.version());
    }
    if (auto ok = policy.allows(*h); !ok) {
      std::string why = ok.error().message;
      deny("egress", h->name, port, why, {}, peer);
      co_return text_response(http::status::forbidden, "sandboxer broker: " + h->name + " is " + why, req.version());
    }
    if (auto ci = placeholder_in(req)) {
      const auto& c = cfg.credentials[*ci];
      deny("credential", h->name, port, "placeholder of credential \"" + c.name + "\" sent toward " + h->name,
           {{"credential", c.name}}, peer);
      co_return text_response(http::status::forbidden,
                              "sandboxer broker: credential \"" + c.name + "\" is not bound to " + h->name,
                              req.version());
    }
    beast::tcp_stream s(io);
    auto where = h->name + ":" + std::to_string(port);
    if (auto r = co_await connect(s, h->name, port); r.ec == asio::error::access_denied) {
      deny("egress", h->name, port, r.why, r.denial(), peer);
      co_return text_response(http::status::forbidden, "sandboxer broker: " + h->name + ": " + r.why, req.version());
    } else if (r.ec) {
      co_return text_response(http::status::bad_gateway, "sandboxer broker: " + where + ": " + r.ec.message(),
                              req.version());
    }
    Request up = upstream_request(req, path.empty() ? "/" : path, authority, false);
    auto err = co_await relay(s, s, up, conn, req.version(), nullptr, nullptr);
    if (err)
      co_return text_response(http::status::bad_gateway, "sandboxer broker: " + where + ": " + *err, req.version());
    co_return Response{};
  }

  awaitable<Response> handle(Request& req, Conn& conn) {
    auto t = egress::route_target(req.target(), cfg.network.proxy_port);
    if (t.kind == egress::Target::Kind::Plain) co_return co_await forward_plain(req, t.authority, t.path, conn);
    if (t.kind == egress::Target::Kind::Bad)
      co_return text_response(
          http::status::bad_request,
          "sandboxer broker: use CONNECT for https, http://host/... for plain HTTP, or /<credential>/...",
          req.version());
    if (t.own_url) req.target(t.path);
    for (size_t i = 0; i < cfg.credentials.size(); ++i)
      if (cfg.credentials[i].name == t.credential) co_return co_await credential_request(req, i, t.rest, conn);
    co_return text_response(http::status::not_found,
                            "sandboxer broker: no credential named \"" + t.credential.substr(0, 64) + "\"",
                            req.version());
  }

  static awaitable<void> pump(std::shared_ptr<tcp::socket> from, std::shared_ptr<tcp::socket> to,
                              std::shared_ptr<asio::steady_timer> idle) {
    std::array<char, 16384> buf;
    for (;;) {
      auto [ec, n] = co_await from->async_read_some(asio::buffer(buf), nothrow);
      if (ec) break;
      idle->expires_after(kTunnelIdle);
      auto [wec, wn] = co_await asio::async_write(*to, asio::buffer(buf.data(), n), nothrow);
      if (wec) break;
    }
    boost::system::error_code ig;
    to->shutdown(tcp::socket::shutdown_send, ig);
    from->shutdown(tcp::socket::shutdown_receive, ig);
  }

  awaitable<void> tunnel(beast::tcp_stream& client, beast::flat_buffer& buf, const Request& req, Peer peer) {
    std::string raw_host;
    int port;
    auto refuse = [&](http::status st, std::string text) -> awaitable<void> {
      auto r = text_response(st, "sandboxer broker: " + text, req.version());
      client.expires_after(timeout());
      co_await http::async_write(client, r, nothrow);
    };
    if (!egress::split_authority(req.target(), raw_host, port, 443)) {
      co_await refuse(http::status::bad_request, "CONNECT needs host:port");
      co_return;
    }
    auto h = egress::canonical_host(raw_host);
    if (!h) {
      deny("egress", raw_host.substr(0, 255), port, h.error().message, {}, peer);
      co_await refuse(http::status::forbidden, h.error().message);
      co_return;
    }
    if (auto ok = policy.allows(*h); !ok) {
      std::string why = ok.error().message;
      deny("egress", h->name, port, why, {}, peer);
      co_await refuse(http::status::forbidden, h->name + " is " + why);
      co_return;
    }
    beast::tcp_stream up(io);
    if (auto r = co_await connect(up, h->name, port); r.ec == asio::error::access_denied) {
      deny("egress", h->name, port, r.why, r.denial(), peer);
      co_await refuse(http::status::forbidden, h->name + ": " + r.why);
      co_return;
    } else if (r.ec) {
      co_await refuse(http::status::bad_gateway, h->name + ":" + std::to_string(port) + ": " + r.ec.message());
      co_return;
    }
    client.expires_after(timeout());
    auto [wec, wn] = co_await asio::async_write(
        client, asio::buffer(std::string_view("HTTP/1.1 200 Connection established\r\n\r\n")), nothrow);
    if (wec) co_return;
    if (buf.size() > 0) {
      auto [ec2, n2] = co_await asio::async_write(up, buf.data(), nothrow);
      if (ec2) co_return;
      buf.consume(buf.size());
    }
    client.expires_never();
    up.expires_never();
    auto a = std::make_shared<tcp::socket>(client.release_socket());
    auto b = std::make_shared<tcp::socket>(up.release_socket());
    // Both directions until both end, or until the tunnel is idle for too long.
    auto idle = std::make_shared<asio::steady_timer>(io);
    idle->expires_after(kTunnelIdle);
    auto ex = co_await asio::this_coro::executor;
    auto done = std::make_shared<int>(0);
    auto finish = [a, b, idle, done](std::exception_ptr) {
      if (++*done == 2) idle->cancel();
    };
    asio::co_spawn(ex, pump(a, b, idle), finish);
    asio::co_spawn(ex, pump(b, a, idle), finish);
    for (;;) {
      auto [tec] = co_await idle->async_wait(nothrow);
      if (*done == 2) break;
      if (!tec && idle->expiry() <= std::chrono::steady_clock::now()) break;
    }
    boost::system::error_code ig;
    a->close(ig);
    b->close(ig);
  }

  awaitable<void> serve(tcp::socket sock) {
    struct Count {
      std::atomic<size_t>& n;
      ~Count() { --n; }
    } count{connections};
    boost::system::error_code pec;
    Peer peer{true, sock.remote_endpoint(pec).port()};
    beast::tcp_stream client(std::move(sock));
    beast::flat_buffer buf;
    try {
      for (;;) {
        http::request_parser<http::string_body> parser;
        parser.header_limit(static_cast<uint32_t>(cfg.network.max_header_bytes));
        parser.body_limit(static_cast<uint64_t>(cfg.network.max_body_bytes));
        // A client gets `timeout` for a whole header: a slow one is dropped, not waited for.
        client.expires_after(timeout());
        auto [ec, n] = co_await http::async_read_header(client, buf, parser, nothrow);
        if (ec) {
          if (ec == http::error::header_limit)
            co_await http::async_write(client,
                                       text_response(http::status::request_header_fields_too_large,
                                                     "sandboxer broker: header larger than " +
                                                         std::to_string(cfg.network.max_header_bytes) + " bytes"),
                                       nothrow);
          else if (ec == http::error::body_limit)  // a Content-Length past the bound, known from the header
            co_await http::async_write(client,
                                       text_response(http::status::payload_too_large,
                                                     "sandboxer broker: body larger than " +
                                                         std::to_string(cfg.network.max_body_bytes) + " bytes"),
                                       nothrow);
          else if (ec != http::error::end_of_stream && ec != beast::error::timeout && ec != asio::error::eof &&
                   ec != asio::error::connection_reset)
            co_await http::async_write(
                client,
                text_response(http::status::bad_request, "sandboxer broker: malformed request: " + ec.message()),
                nothrow);
          break;
        }
        auto& req = parser.get();
        if (req.method() == http::verb::connect) {
          co_await tunnel(client, buf, req, peer);
          co_return;
        }
        if (iequals(req[http::field::expect], "100-continue") && !parser.is_done())
          co_await asio::async_write(client, asio::buffer(std::string_view("HTTP/1.1 100 Continue\r\n\r\n")), nothrow);
        if (!parser.is_done()) {
          auto [bec, bn] = co_await http::async_read(client, buf, parser, nothrow);
          if (bec) {
            if (bec == http::error::body_limit)
              co_await http::async_write(client,
                                         text_response(http::status::payload_too_large,
                                                       "sandboxer broker: body larger than " +
                                                           std::to_string(cfg.network.max_body_bytes) + " bytes"),
                                         nothrow);
            else if (bec != beast::error::timeout)
              co_await http::async_write(
                  client,
                  text_response(http::status::bad_request, "sandboxer broker: malformed body: " + bec.message()),
                  nothrow);
            break;
          }
        }
        Request r = parser.release();
        bool keep = r.keep_alive();
        Conn conn{client, peer, keep};
        Response res = co_await handle(r, conn);
        if (conn.streamed) {
          if (!conn.keep) break;
          continue;
        }
        res.keep_alive(keep && res.result() != http::status::forbidden && res.result_int() < 500);
        client.expires_after(timeout());
        auto [wec, wn] = co_await http::async_write(client, res, nothrow);
        if (wec || !res.keep_alive()) break;
      }
    } catch (const std::exception& e) {
      log()->warn("serve a connection: {}", e.what());
    }
    boost::system::error_code ig;
    client.socket().shutdown(tcp::socket::shutdown_both, ig);
  }

  // Accepts on `acc` until it closes, each connection served by `serve_fn` (HTTP or DNS over
  // TCP), at most `limit` at once (counted in `open`, which the server decrements).
  awaitable<void> accept_loop(tcp::acceptor& acc, awaitable<void> (Impl::*serve_fn)(tcp::socket),
                              std::atomic<size_t>& open, size_t limit) {
    for (;;) {
      auto [ec, sock] = co_await acc.async_accept(nothrow);
      if (ec == asio::error::operation_aborted || !acc.is_open()) co_return;
      if (ec) {
        // Out of fds and the like: back off a moment instead of spinning.
        asio::steady_timer t(io, std::chrono::milliseconds(50));
        co_await t.async_wait(nothrow);
        continue;
      }
      if (open >= limit) continue;  // `sock` closes here
      ++open;
      asio::co_spawn(io, (this->*serve_fn)(std::move(sock)), asio::detached);
    }
  }

  awaitable<void> answer_dns(std::string msg, udp::endpoint from) {
    std::string reply = co_await dns_reply(msg, Peer{false, from.port()});
    if (!reply.empty()) co_await dns.async_send_to(asio::buffer(reply), from, nothrow);
  }

  // The answer to one DNS message, the same over UDP and TCP ("" for no answer at all).
  awaitable<std::string> dns_reply(const std::string& msg, Peer peer) {
    uint16_t id = 0;
    std::string reply;
    auto q = egress::parse_dns_query(msg, &id);
    if (!q) {
      if (msg.size() >= 12) reply = egress::make_dns_error(id, egress::kDnsFormErr);
    } else {
      auto h = egress::canonical_host(q->name);
      auto ok = h ? policy.allows(*h) : base::Result<void>(h.error());
      if (!ok) {
        // A name that is not allowed is never resolved: nothing of it leaves the box, so a
        // secret spelled into its labels goes nowhere.
        deny("dns", q->name.substr(0, 255), 0, ok.error().message, {}, peer);
        reply = egress::make_dns_reply(msg, *q, egress::kDnsRefused);
      } else if (q->qclass != 1 || (q->qtype != egress::kDnsTypeA && q->qtype != egress::kDnsTypeAAAA)) {
        reply = egress::make_dns_reply(msg, *q, egress::kDnsNoError);
      } else {
        reply = co_await dns_answer(msg, *q, *h, peer);
      }
    }
    co_return reply;
  }

  // The answer to an allowed name's A or AAAA question: the addresses the broker itself would
  // connect to. An address in a range the profile does not allow is left out rather than handed
  // to the agent (the agent reaches nothing by address anyway, and it need not learn the host's
  // internal network); a name with no other address is REFUSED and reported.
  awaitable<std::string> dns_answer(const std::string& msg, const egress::DnsQuestion& q,
                                    const egress::CanonicalHost& host, Peer peer) {
    const std::string& name = host.name;
    // Pins and addresses are answered at once; only a lookup waits on the system's resolver.
    bool lookup = !host.is_ip && !cfg.network.resolve.contains(name);
    if (lookup && dns_inflight >= kMaxDnsInFlight) {
      deny("dns", name, 0, "more than " + std::to_string(kMaxDnsInFlight) + " lookups in flight", {}, peer);
      co_return egress::make_dns_reply(msg, q, egress::kDnsServFail);
    }
    struct InFlight {
      size_t& n;
      bool on;
      ~InFlight() { n -= on; }
    } inflight{dns_inflight, lookup};
    dns_inflight += lookup;
    auto r = co_await resolve(name, 0);
    std::vector<std::string> addrs;
    for (auto& e : r.eps) {
      auto a = e.address();
      if (q.qtype == egress::kDnsTypeA && a.is_v4()) {
        auto bytes = a.to_v4().to_bytes();
        addrs.emplace_back(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      } else if (q.qtype == egress::kDnsTypeAAAA && a.is_v6()) {
        auto bytes = a.to_v6().to_bytes();
        addrs.emplace_back(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      }
      if (addrs.size() >= 8) break;
    }
    std::sort(addrs.begin(), addrs.end());
    addrs.erase(std::unique(addrs.begin(), addrs.end()), addrs.end());
    if (r.ec == asio::error::access_denied) deny("dns", name, 0, r.why, r.denial(), peer);
    co_return egress::make_dns_reply(msg, q,
                                     r.ec == asio::error::host_not_found  ? egress::kDnsNxDomain
                                     : r.ec == asio::error::access_denied ? egress::kDnsRefused
                                     : r.ec                               ? egress::kDnsServFail
                                                                          : egress::kDnsNoError,
                                     addrs);
  }

  // DNS over TCP (RFC 7766): two bytes of length, then the message; answers in the same framing,
  // several queries per connection, each within the broker's timeout.
  awaitable<void> serve_dns_tcp(tcp::socket sock) {
    struct Count {
      std::atomic<size_t>& n;
      ~Count() { --n; }
    } count{dns_tcp_connections};
    Peer peer{true, 0, 53};
    boost::system::error_code ig;
    if (auto ep = sock.remote_endpoint(ig); !ig) peer.port = ep.port();
    beast::tcp_stream client(std::move(sock));
    for (int queries = 0; queries < 100; ++queries) {
      std::array<unsigned char, 2> len{};
      client.expires_after(timeout());
      auto [ec, n] = co_await asio::async_read(client, asio::buffer(len), nothrow);
      if (ec) break;
      size_t size = static_cast<size_t>(len[0]) << 8 | len[1];
      if (size == 0) break;
      std::string msg(size, '\0');
      auto [ec2, n2] = co_await asio::async_read(client, asio::buffer(msg), nothrow);
      if (ec2) break;
      std::string reply = co_await dns_reply(msg, peer);
      if (reply.empty() || reply.size() > 0xffff) break;
      std::string framed;
      framed.push_back(static_cast<char>(reply.size() >> 8));
      framed.push_back(static_cast<char>(reply.size() & 0xff));
      framed += reply;
      auto [wec, wn] = co_await asio::async_write(client, asio::buffer(framed), nothrow);
      if (wec) break;
    }
    client.socket().shutdown(tcp::socket::shutdown_both, ig);
  }

  awaitable<void> dns_loop() {
    std::array<char, 1500> buf;
    for (;;) {
      udp::endpoint from;
      auto [ec, n] = co_await dns.async_receive_from(asio::buffer(buf), from, nothrow);
      if (ec == asio::error::operation_aborted || !dns.is_open()) co_return;
      if (ec) continue;
      asio::co_spawn(io, answer_dns(std::string(buf.data(), n), from), asio::detached);
    }
  }
};

Broker::Broker(BrokerConfig cfg, os::UniqueFd tcp_fd, os::UniqueFd udp_fd, Sink sink, os::UniqueFd dns_tcp_fd)
    : impl_(std::make_unique<Impl>(std::move(cfg), std::move(sink))) {
  auto& im = *impl_;
  // TLS only for credentials (tunnels and plain HTTP need none): OpenSSL is loaded here, first.
  if (!im.cfg.credentials.empty())
    if (auto& lib = os::libssl(); !lib)
      throw std::runtime_error(lib.error().message + " (for the credentials of network \"proxy\")");
  for (auto& c : im.cfg.credentials) {
    auto ctx = std::make_unique<ssl::context>(ssl::context::tls_client);
    boost::system::error_code ec;
    if (!c.ca_file.empty())
      ctx->load_verify_file(c.ca_file, ec);
    else
      ctx->set_default_verify_paths(ec);
    if (ec)
      throw std::runtime_error("credential " + c.name + ": load trust anchors" +
                               (c.ca_file.empty() ? "" : " from " + c.ca_file) + ": " + ec.message());
    im.tls.push_back(std::move(ctx));
  }
  boost::system::error_code ec;
  im.acceptor.assign(tcp::v4(), tcp_fd.get(), ec);
  if (ec) throw std::runtime_error("broker: adopt the listening socket: " + ec.message());
  tcp_fd.release();
  if (udp_fd) {
    im.dns.assign(udp::v4(), udp_fd.get(), ec);
    if (ec) throw std::runtime_error("broker: adopt the DNS socket: " + ec.message());
    udp_fd.release();
    asio::co_spawn(im.io, im.dns_loop(), asio::detached);
  }
  if (dns_tcp_fd) {
    im.dns_tcp.assign(tcp::v4(), dns_tcp_fd.get(), ec);
    if (ec) throw std::runtime_error("broker: adopt the DNS (TCP) socket: " + ec.message());
    dns_tcp_fd.release();
    asio::co_spawn(im.io,
                   im.accept_loop(im.dns_tcp, &Impl::serve_dns_tcp, im.dns_tcp_connections, kMaxDnsTcpConnections),
                   asio::detached);
  }
  asio::co_spawn(im.io, im.accept_loop(im.acceptor, &Impl::serve, im.connections, kMaxConnections), asio::detached);
  im.thread = std::thread([&im] {
    for (;;) {
      try {
        im.io.run();
        return;
      } catch (const std::exception& e) {
        log()->error("broker loop: {}", e.what());
      }
    }
  });
}

Broker::~Broker() {
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  // Secrets do not linger in freed memory longer than they must.
  for (auto& s : impl_->cfg.secrets) std::fill(s.begin(), s.end(), '\0');
}

}  // namespace sbx::broker
