// sdk::WsStream: Beast's WebSocket client, plain or TLS, behind one type. Each operation is
// instantiated here for both stream types, once, and with one completion token each (an error
// code, thrown where the caller expects Beast's use_awaitable to throw), so that the files that
// use the stream compile none of Beast's composed operations themselves.
#include <openssl/ssl.h>

#include <type_traits>

#include "sandboxer/beast.hpp"

namespace sbx::sdk {

namespace {

using PlainWs = websocket::stream<beast::tcp_stream>;
using TlsWs = websocket::stream<beast::ssl_stream<beast::tcp_stream>>;

constexpr auto kConnectLimit = std::chrono::seconds(10);

auto with_error(boost::system::error_code& ec) { return asio::redirect_error(asio::use_awaitable, ec); }

void throw_if(const boost::system::error_code& ec) {
  if (ec) throw boost::system::system_error(ec);
}

template <class Ws>
asio::awaitable<void> open_stream(Ws& ws, const WsTarget& t, size_t read_max) {
  auto executor = co_await asio::this_coro::executor;
  asio::ip::tcp::resolver resolver(executor);
  boost::system::error_code ec;
  auto results = co_await resolver.async_resolve(t.host, t.port, with_error(ec));
  throw_if(ec);
  beast::get_lowest_layer(ws).expires_after(kConnectLimit);
  co_await beast::get_lowest_layer(ws).async_connect(results, with_error(ec));
  throw_if(ec);
  // A request and the small frames after it go out at once: with Nagle's algorithm the second
  // small write waited for the box's delayed ACK of the first, ~40 ms (a small file's upload).
  beast::get_lowest_layer(ws).socket().set_option(asio::ip::tcp::no_delay(true));
  if constexpr (std::is_same_v<Ws, TlsWs>) {
    // SNI, for a box behind a proxy that routes by name.
    SSL_set_tlsext_host_name(ws.next_layer().native_handle(), t.host.c_str());
    co_await ws.next_layer().async_handshake(asio::ssl::stream_base::client, with_error(ec));
    throw_if(ec);
  }
  beast::get_lowest_layer(ws).expires_never();
  ws.set_option(websocket::stream_base::timeout::suggested(beast::role_type::client));
  std::string auth = "Bearer " + t.token;
  ws.set_option(websocket::stream_base::decorator([auth](websocket::request_type& req) {
    req.set(beast::http::field::authorization, auth);
    req.set(beast::http::field::sec_websocket_protocol, protocol::kSubprotocol);
  }));
  ws.read_message_max(read_max);
  websocket::response_type res;
  co_await ws.async_handshake(res, t.host + ":" + t.port, t.path, with_error(ec));
  if (ec == websocket::error::upgrade_declined)
    throw std::runtime_error("the box refused the WebSocket upgrade: HTTP " + std::to_string(res.result_int()) + " " +
                             std::string(res.reason()));
  throw_if(ec);
}

template <class Ws>
asio::awaitable<void> close_stream(Ws& ws, std::chrono::steady_clock::duration limit) {
  asio::steady_timer timer(co_await asio::this_coro::executor, limit);
  timer.async_wait([&ws](boost::system::error_code ec) {
    if (!ec) beast::get_lowest_layer(ws).cancel();
  });
  boost::system::error_code ec;
  co_await ws.async_close(websocket::close_code::normal, with_error(ec));
  timer.cancel();
}

}  // namespace

WsStream::WsStream(asio::io_context& io, WsTarget t) : target_(std::move(t)) {
  if (target_.tls) {
    ssl_ = std::make_unique<asio::ssl::context>(asio::ssl::context::tls_client);
    configure_tls(*ssl_, target_);
    tls_ = std::make_unique<TlsWs>(io, *ssl_);
  } else {
    plain_ = std::make_unique<PlainWs>(io);
  }
}

WsStream::~WsStream() = default;

asio::awaitable<void> WsStream::open(size_t read_max) {
  if (tls_)
    co_await open_stream(*tls_, target_, read_max);
  else
    co_await open_stream(*plain_, target_, read_max);
}

asio::awaitable<std::string> WsStream::open_or_reason(size_t read_max) {
  try {
    co_await open(read_max);
    co_return std::string();
  } catch (const boost::system::system_error& e) {
    bool connected =
        tls_ ? beast::get_lowest_layer(*tls_).socket().is_open() : beast::get_lowest_layer(*plain_).socket().is_open();
    co_return connect_reason(e.code(), target_, connected);
  } catch (const std::exception& e) {
    co_return std::string(e.what());
  }
}

asio::awaitable<void> WsStream::write(asio::const_buffer data, bool binary) {
  boost::system::error_code ec;
  if (tls_) {
    tls_->binary(binary);
    co_await tls_->async_write(data, with_error(ec));
  } else {
    plain_->binary(binary);
    co_await plain_->async_write(data, with_error(ec));
  }
  throw_if(ec);
}

asio::awaitable<void> WsStream::read(beast::flat_buffer& buf) {
  boost::system::error_code ec;
  if (tls_)
    co_await tls_->async_read(buf, with_error(ec));
  else
    co_await plain_->async_read(buf, with_error(ec));
  throw_if(ec);
}

bool WsStream::got_text() const { return tls_ ? tls_->got_text() : plain_->got_text(); }

bool WsStream::got_binary() const { return tls_ ? tls_->got_binary() : plain_->got_binary(); }

websocket::close_reason WsStream::reason() const { return tls_ ? tls_->reason() : plain_->reason(); }

std::string WsStream::close_reason(const boost::system::error_code& ec) const {
  if (ec == websocket::error::closed) {
    auto r = reason();
    return std::string(r.reason.c_str()) + " (" + std::to_string(r.code) + ")";
  }
  return ec.message() + " (1006)";
}

asio::awaitable<void> WsStream::close(std::chrono::steady_clock::duration limit) {
  if (tls_)
    co_await close_stream(*tls_, limit);
  else
    co_await close_stream(*plain_, limit);
}

void WsStream::write_buffer_bytes(size_t n) {
  if (tls_)
    tls_->write_buffer_bytes(n);
  else
    plain_->write_buffer_bytes(n);
}

void WsStream::cancel() {
  if (tls_)
    beast::get_lowest_layer(*tls_).cancel();
  else
    beast::get_lowest_layer(*plain_).cancel();
}

void WsStream::close_socket() {
  if (tls_)
    beast::get_lowest_layer(*tls_).close();
  else
    beast::get_lowest_layer(*plain_).close();
}

WsTarget ws_target(const Endpoint& ep) {
  auto u = parse_url(ep.url);
  return {.host = u.host,
          .port = std::to_string(u.port),
          .path = u.path,
          .token = ep.token,
          .tls = u.tls,
          .insecure = ep.insecure};
}

void configure_tls(asio::ssl::context& ctx, const WsTarget& t) {
  ctx.set_default_verify_paths();
  ctx.set_verify_mode(t.insecure ? asio::ssl::verify_none : asio::ssl::verify_peer);
  if (!t.insecure) ctx.set_verify_callback(asio::ssl::host_name_verification(t.host));
}

std::string connect_reason(const boost::system::error_code& ec, const WsTarget& t, bool connected) {
  std::string where = t.host + ":" + t.port;
  if (ec == asio::error::connection_refused) return ec.message() + " (nothing listens on " + where + ")";
  if (connected && (ec == asio::error::eof || ec == beast::http::error::end_of_stream))
    return "the server at " + where + " accepted a connection and closed it before the WebSocket handshake";
  return ec.message() + " (" + where + ")";
}

}  // namespace sbx::sdk
