// The page server (ui/server.hpp): HTTP and the page's WebSocket with Boost.Beast on one thread,
// the secret checked on every request before anything else is looked at.
#include "ui/server.hpp"

#include <boost/json.hpp>
#include <chrono>
#include <sandboxer/client.hpp>
#include <set>

#include "journal/journal.hpp"
#include "os/sys.hpp"
#include "ui/assets.hpp"
#include "ui/hub.hpp"
#include "ui/snapshot-http.hpp"

namespace sbx::ui {

namespace {

// The page's own files allow nothing from elsewhere: no CDN, no other origin, no frames.
constexpr const char* kCsp =
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; font-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

// Every answer's own headers, but a refusal's (a bare 403).
void set_headers(http::response_header<>& h) {
  h.set(http::field::server, "sandboxer-ui");
  h.set(http::field::cache_control, "no-store");
  h.set("Referrer-Policy", "no-referrer");
  h.set("X-Content-Type-Options", "nosniff");
  h.set("Content-Security-Policy", kCsp);
}

// The most a request's body may hold but an import's.
constexpr uint64_t kMaxBody = 64 * 1024;

// A bare refusal: its status and one line saying it, the connection closed after it.
http::response<http::string_body> refusal(unsigned version, http::status status) {
  http::response<http::string_body> res{status, version};
  res.set(http::field::content_type, "text/plain");
  res.body() = status == http::status::forbidden ? "forbidden\n" : "request body too large\n";
  res.keep_alive(false);
  res.prepare_payload();
  return res;
}

bool same_secret(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

}  // namespace

void Hub::publish() {
  for (auto* p : pages) p->pump();
}

std::string Hub::scrub(std::string text) const {
  if (box.token.empty()) return text;
  for (size_t at = text.find(box.token); at != std::string::npos; at = text.find(box.token, at))
    text.replace(at, box.token.size(), "[redacted]");
  return text;
}

struct Server::Impl {
  // The io_context goes last: destroying it destroys the coroutines still waiting, and the page
  // sessions among them still use the Hub they share.
  asio::io_context io;
  std::shared_ptr<Hub> hub_ptr = std::make_shared<Hub>(io);
  Hub& hub = *hub_ptr;
  tcp::acceptor acceptor{io};
  asio::signal_set signals{io, SIGINT, SIGTERM};
  asio::steady_timer retry{io};   ///< live: reconnects the feed; replay: follows the journal
  std::shared_ptr<BoxLink> feed;  ///< live: the one subscription to the box
  std::string secret;
  std::string journal_dir;
  std::set<std::string> unreadable;  ///< replay: the journal's segments it could not read, shown once
  int follow_ms = 250;
  uint16_t port = 0;

  asio::awaitable<void> accept_loop();
  asio::awaitable<void> http_session(tcp::socket sock);
  http::response<http::string_body> answer(const http::request<http::string_body>& req, std::string_view rest);
  /// Where a request may go: "" when refused (403), else the path after the secret.
  std::optional<std::string> authorize(const http::request_header<>& req) const;
  void connect_feed();
  void follow_journal();
};

std::optional<std::string> Server::Impl::authorize(const http::request_header<>& req) const {
  // The Host a browser sends is ours only when the page was opened by its address: a page of
  // another site reaching 127.0.0.1 through a DNS name (rebinding) is refused here too.
  auto host = req[http::field::host];
  std::string p = std::to_string(port);
  if (host != "127.0.0.1:" + p && host != "localhost:" + p) return std::nullopt;
  std::string_view target = req.target();
  if (target.empty() || target[0] != '/') return std::nullopt;
  target.remove_prefix(1);
  auto slash = target.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  if (!same_secret(target.substr(0, slash), secret)) return std::nullopt;
  auto rest = target.substr(slash + 1);
  if (auto q = rest.find('?'); q != std::string_view::npos) rest = rest.substr(0, q);
  return std::string(rest);
}

http::response<http::string_body> Server::Impl::answer(const http::request<http::string_body>& req,
                                                       std::string_view rest) {
  http::response<http::string_body> res{http::status::ok, req.version()};
  set_headers(res.base());
  auto asset = find_asset(rest.empty() ? "index.html" : rest);
  if (req.method() != http::verb::get && req.method() != http::verb::head) {
    res.result(http::status::method_not_allowed);
    res.body() = "method not allowed\n";
  } else if (!asset) {
    res.result(http::status::not_found);
    res.body() = "not found\n";
  } else {
    res.set(http::field::content_type, asset->content_type);
    if (req.method() == http::verb::get) res.body() = std::string(asset->body);
  }
  res.keep_alive(req.keep_alive());
  res.prepare_payload();
  return res;
}

asio::awaitable<void> Server::Impl::http_session(tcp::socket sock) {
  beast::tcp_stream stream(std::move(sock));
  beast::flat_buffer buf;
  try {
    for (;;) {
      // No limit on the header's Content-Length here (Beast checks it as the header ends): an
      // import's is the archive's; every other request's body is bounded below.
      http::request_parser<http::empty_body> head;
      head.body_limit(boost::none);
      stream.expires_after(std::chrono::seconds(30));
      co_await http::async_read_header(stream, buf, head, asio::use_awaitable);
      auto rest = authorize(head.get().base());
      std::string origin = "http://" + std::string(head.get()[http::field::host]);
      // An import's body is the archive: read as it goes to the box, by serve_import. A POST
      // from another origin (a form of another site) is refused below.
      if (rest && *rest == kImportPath && head.get().method() == http::verb::post &&
          head.get()[http::field::origin] == origin) {
        stream.expires_never();  // each read of the upload has its own limit
        co_await serve_import(hub_ptr, stream, buf, head, set_headers);
        break;
      }
      // A wrong or missing secret, another Host, a WebSocket or an import from another origin:
      // nothing but the refusal, whatever was asked.
      bool forbidden = !rest || *rest == "ws" || *rest == kImportPath;
      if (head.content_length().value_or(0) > kMaxBody || head.chunked()) {
        // No page sends such a body but an import's: refused unread.
        auto res = refusal(head.get().version(), forbidden ? http::status::forbidden : http::status::payload_too_large);
        co_await http::async_write(stream, res, asio::use_awaitable);
        break;
      }
      http::request_parser<http::string_body> parser{std::move(head)};
      parser.body_limit(kMaxBody);
      co_await http::async_read(stream, buf, parser, asio::use_awaitable);
      auto req = parser.release();
      if (rest && *rest == "ws" && websocket::is_upgrade(req) && req[http::field::origin] == origin) {
        stream.expires_never();
        auto page = std::make_shared<PageSession>(hub_ptr, std::move(stream));
        co_await page->run(std::move(req));
        co_return;
      }
      if (auto id = rest ? snapshot_download(*rest) : std::nullopt; id && req.method() == http::verb::get) {
        stream.expires_never();  // each write of the download has its own limit
        co_await serve_snapshot(hub_ptr, stream, req.version(), std::move(*id), set_headers);
        break;
      }
      auto res = forbidden ? refusal(req.version(), http::status::forbidden) : answer(req, *rest);
      co_await http::async_write(stream, res, asio::use_awaitable);
      if (!res.keep_alive()) break;
    }
  } catch (const std::exception&) {
    // One client's connection failed or timed out; the server goes on.
  }
  boost::system::error_code ec;
  stream.socket().shutdown(tcp::socket::shutdown_both, ec);
}

asio::awaitable<void> Server::Impl::accept_loop() {
  for (;;) {
    auto [ec, sock] = co_await acceptor.async_accept(asio::as_tuple(asio::use_awaitable));
    if (ec == asio::error::operation_aborted) co_return;
    if (ec) continue;
    asio::co_spawn(io, http_session(std::move(sock)), asio::detached);
  }
}

void Server::Impl::connect_feed() {
  hub.box_state = "connecting";
  feed = std::make_shared<BoxLink>(
      io, hub.box,
      [this](std::string text) {
        hub.box_state = "connected";
        // Events only (they have a seq); the subscribe reply is not the page's business.
        if (text.find("\"seq\"") == std::string::npos) return;
        if (hub.store.append(hub.scrub(std::move(text)))) hub.publish();
      },
      [this](std::string why) {
        hub.box_state = why;
        if (hub.store.ended()) return;
        // The box may be restarting, or the feed was closed for being slow: come back for what
        // follows the last event kept.
        retry.expires_after(std::chrono::seconds(1));
        retry.async_wait([this](boost::system::error_code ec) {
          if (!ec) connect_feed();
        });
      });
  feed->start();
  boost::json::object sub{{"id", "ui-feed"}, {"op", "subscribe"}, {"since", hub.store.last_seq()}};
  feed->send(boost::json::serialize(sub));
}

void Server::Impl::follow_journal() {
  size_t before = hub.store.size();
  auto r = journal::Journal::read(
      journal_dir, hub.store.last_seq(),
      [&](uint64_t, std::string_view line) {
        hub.store.append(line);
        return true;
      },
      nullptr,
      [&](const journal::Journal::Gap& g) {
        // A segment damaged on disk: the timeline says which seqs it lost, in their place, and goes
        // on after them (where the newest segment ends is not known: at its first seq lost).
        if (unreadable.insert(g.segment).second)
          hub.store.append(journal::Journal::unreadable_event(g, g.last_or(g.first), ""));
        return true;
      });
  if (!r) hub.box_state = "read journal " + journal_dir + ": " + r.error().message();
  if (hub.store.size() != before) {
    hub.publish();
    follow_ms = 250;
  } else {
    // A finished box's journal is read again less and less often.
    follow_ms = std::min(follow_ms * 2, 8000);
  }
  if (hub.store.ended()) return;
  // Another process may still be writing it: the page follows it as `sandboxer log` would.
  retry.expires_after(std::chrono::milliseconds(follow_ms));
  retry.async_wait([this](boost::system::error_code ec) {
    if (!ec) follow_journal();
  });
}

base::Result<std::unique_ptr<Server>> Server::start(ServerOptions opts) {
  if (!have_bundle())
    return base::fail("serve the page: this sandboxer was built without it (node and npm were missing)", "no_bundle");
  auto impl = std::make_unique<Impl>();
  impl->secret = opts.secret.empty() ? os::random_hex(24) : opts.secret;
  impl->hub.store = Store(opts.spool_dir);
  if (!opts.box_url.empty()) {
    try {
      impl->hub.box = sdk::ws_target({opts.box_url, opts.box_token, opts.insecure});
    } catch (const std::exception& e) {
      return base::fail(std::string("box URL: ") + e.what(), "bad_request");
    }
    impl->hub.live = true;
    impl->hub.source = opts.box_url;
  } else {
    impl->hub.source = opts.journal_dir;
    impl->journal_dir = opts.journal_dir;
  }
  boost::system::error_code ec;
  tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), opts.port);
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return base::fail("listen on 127.0.0.1:" + std::to_string(opts.port) + ": " + ec.message(), "bind");
  impl->port = impl->acceptor.local_endpoint().port();
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

std::string Server::address() const {
  return "http://127.0.0.1:" + std::to_string(impl_->port) + "/" + impl_->secret + "/";
}

void Server::run() {
  auto& im = *impl_;
  im.signals.async_wait([this](boost::system::error_code ec, int) {
    if (!ec) stop();
  });
  asio::co_spawn(im.io, im.accept_loop(), asio::detached);
  if (im.hub.live)
    im.connect_feed();
  else
    im.follow_journal();
  im.io.run();
}

void Server::stop() { impl_->io.stop(); }

}  // namespace sbx::ui
