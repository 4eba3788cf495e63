#pragma once
/// sdk/cpp over Boost.Beast: a WebSocket connection to a box on an asio io_context, for the page
/// server of `sandboxer ui` (ui/) and for file transfers (transfer.hpp). libwebsockets' client
/// (client.hpp, on the CLI's libuv loop) parses what it receives a byte at a time and masks what it
/// sends a byte at a time; Beast reads a frame's payload in bulk and masks a word at a time.
#include <openssl/ssl.h>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <boost/json.hpp>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "protocol/protocol.hpp"
#include "sandboxer/client.hpp"

namespace sbx::sdk {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace websocket = beast::websocket;

/// Where a box is, as a Beast client connects to it.
struct WsTarget {
  std::string host, port, path, token;
  bool tls = false, insecure = false;
};

/// The target of an endpoint's ws[s]:// URL (parse_url: throws std::invalid_argument).
WsTarget ws_target(const Endpoint& ep);

/// A client TLS context for `t`: the system's CAs (SSL_CERT_FILE and SSL_CERT_DIR are honoured),
/// the peer's certificate and host name verified unless `t.insecure` (SANDBOXER_INSECURE).
void configure_tls(asio::ssl::context& ctx, const WsTarget& t);

using PlainWs = websocket::stream<beast::tcp_stream>;
using TlsWs = websocket::stream<beast::ssl_stream<beast::tcp_stream>>;

/// What a failed connect or handshake says: the socket's error with where (a refused connect says
/// what it means), or that the server closed before the handshake; `connected`: the TCP connection
/// was made.
std::string connect_reason(const boost::system::error_code& ec, const WsTarget& t, bool connected);

/// The reply to request `id` in a text frame (the frame's id is `id`, or null: a request the box
/// could not read), or nullopt for anything else (an event, or no JSON object).
std::optional<boost::json::object> reply_for(std::string_view text, uint32_t id);

/// Whether a reply says {"ok": true}.
bool reply_says_ok(const boost::json::object& reply);

/// Resolves `t`, connects (10 s at most), does TLS with SNI on a TlsWs, then the WebSocket
/// handshake with the box's token (Authorization: Bearer) and the subprotocol; `read_max` bounds
/// a message read. Throws boost::system::system_error, or std::runtime_error naming the HTTP status
/// of a refused upgrade (a wrong token: 401).
template <class Ws>
asio::awaitable<void> open_websocket(Ws& ws, const WsTarget& t, size_t read_max) {
  auto executor = co_await asio::this_coro::executor;
  asio::ip::tcp::resolver resolver(executor);
  auto results = co_await resolver.async_resolve(t.host, t.port, asio::use_awaitable);
  beast::get_lowest_layer(ws).expires_after(std::chrono::seconds(10));
  co_await beast::get_lowest_layer(ws).async_connect(results, asio::use_awaitable);
  // A request and the small frames after it go out at once: with Nagle's algorithm the second
  // small write waited for the box's delayed ACK of the first, ~40 ms (a small file's upload).
  beast::get_lowest_layer(ws).socket().set_option(asio::ip::tcp::no_delay(true));
  if constexpr (std::is_same_v<Ws, TlsWs>) {
    // SNI, for a box behind a proxy that routes by name.
    SSL_set_tlsext_host_name(ws.next_layer().native_handle(), t.host.c_str());
    co_await ws.next_layer().async_handshake(asio::ssl::stream_base::client, asio::use_awaitable);
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
  boost::system::error_code ec;
  co_await ws.async_handshake(res, t.host + ":" + t.port, t.path, asio::redirect_error(asio::use_awaitable, ec));
  if (ec == websocket::error::upgrade_declined)
    throw std::runtime_error("the box refused the WebSocket upgrade: HTTP " + std::to_string(res.result_int()) + " " +
                             std::string(res.reason()));
  if (ec) throw boost::system::system_error(ec);
}

/// open_websocket, with what went wrong as a string (connect_reason, or the refused upgrade's
/// status) instead of an exception: "" once open.
template <class Ws>
asio::awaitable<std::string> open_websocket_or_reason(Ws& ws, const WsTarget& t, size_t read_max) {
  try {
    co_await open_websocket(ws, t, read_max);
    co_return std::string();
  } catch (const boost::system::system_error& e) {
    co_return connect_reason(e.code(), t, beast::get_lowest_layer(ws).socket().is_open());
  } catch (const std::exception& e) {
    co_return std::string(e.what());
  }
}

/// Runs `body(ws)` on a new stream to `t`, a TlsWs for wss (its context configure_tls's) or a
/// PlainWs; the stream lives in this coroutine until the body's ends, and the body opens it
/// (open_websocket). For a stream that something else must reach meanwhile (to cancel it), hold
/// it in an object instead (cli/relay.cpp's Conn, ui/box-link.cpp). configure_tls's exception
/// (the system's CAs unreadable) comes out of this coroutine.
template <class Body>
auto with_websocket(asio::io_context& io, WsTarget t, Body body) -> decltype(body(std::declval<PlainWs&>())) {
  if (t.tls) {
    asio::ssl::context ssl(asio::ssl::context::tls_client);
    configure_tls(ssl, t);
    TlsWs ws(io, ssl);
    co_return co_await body(ws);
  }
  PlainWs ws(io);
  co_return co_await body(ws);
}

/// Why an open connection ended, from the error its read or write failed with: the box's Close
/// frame ("REASON (CODE)"), else the error and 1006.
template <class Ws>
std::string close_reason(Ws& ws, const boost::system::error_code& ec) {
  if (ec == websocket::error::closed)
    return std::string(ws.reason().reason.c_str()) + " (" + std::to_string(ws.reason().code) + ")";
  return ec.message() + " (1006)";
}

/// A clean close (1000), waiting `limit` at most for the box's Close: the socket is cancelled then.
template <class Ws>
asio::awaitable<void> close_websocket(Ws& ws, std::chrono::steady_clock::duration limit) {
  asio::steady_timer timer(co_await asio::this_coro::executor, limit);
  timer.async_wait([&ws](boost::system::error_code ec) {
    if (!ec) beast::get_lowest_layer(ws).cancel();
  });
  boost::system::error_code ec;
  co_await ws.async_close(websocket::close_code::normal, asio::redirect_error(asio::use_awaitable, ec));
  timer.cancel();
}

}  // namespace sbx::sdk
