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
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
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

/// What a failed connect or handshake says: the socket's error with where (a refused connect says
/// what it means), or that the server closed before the handshake; `connected`: the TCP connection
/// was made.
std::string connect_reason(const boost::system::error_code& ec, const WsTarget& t, bool connected);

/// The reply to request `id` in a text frame (the frame's id is `id`, or null: a request the box
/// could not read), or nullopt for anything else (an event, or no JSON object).
std::optional<boost::json::object> reply_for(std::string_view text, uint32_t id);

/// Whether a reply says {"ok": true}.
bool reply_says_ok(const boost::json::object& reply);

/// A WebSocket client connection to a box, plain (ws://) or TLS (wss://). Its operations are
/// compiled once, for both kinds, in sdk/cpp/src/ws-stream.cpp: Beast's composed operations for the
/// two stream types took ~50 s of compile in every file that used them, and four did. Reads and
/// writes throw boost::system::system_error, as Beast's do with asio::use_awaitable. One read and
/// one write may be pending at a time, as on Beast's stream.
class WsStream {
 public:
  /// A stream to `t`, not yet open; a wss target's TLS context is configure_tls's (which throws
  /// where the system's CAs cannot be read).
  WsStream(asio::io_context& io, WsTarget t);
  ~WsStream();
  WsStream(const WsStream&) = delete;
  WsStream& operator=(const WsStream&) = delete;

  const WsTarget& target() const { return target_; }
  /// Resolves the target, connects (10 s at most), does TLS with SNI for wss, then the WebSocket
  /// handshake with the box's token (Authorization: Bearer) and the subprotocol; `read_max` bounds
  /// a message read. Throws boost::system::system_error, or std::runtime_error naming the HTTP
  /// status of a refused upgrade (a wrong token: 401).
  asio::awaitable<void> open(size_t read_max);
  /// open, with what went wrong as a string (connect_reason, or the refused upgrade's status)
  /// instead of an exception: "" once open.
  asio::awaitable<std::string> open_or_reason(size_t read_max);
  /// One message, binary or text.
  asio::awaitable<void> write(asio::const_buffer data, bool binary);
  /// One message, appended to `buf`; got_text() and got_binary() say which it was.
  asio::awaitable<void> read(beast::flat_buffer& buf);
  bool got_text() const;
  bool got_binary() const;
  /// The box's Close frame, where one came (code 0 and no reason where none did).
  websocket::close_reason reason() const;
  /// Why an open connection ended, from the error its read or write failed with: the box's Close
  /// frame ("REASON (CODE)"), else the error and 1006.
  std::string close_reason(const boost::system::error_code& ec) const;
  /// A clean close (1000), waiting `limit` at most for the box's Close: the socket is cancelled
  /// then. Never throws.
  asio::awaitable<void> close(std::chrono::steady_clock::duration limit);
  /// How many bytes a write masks and sends at a time.
  void write_buffer_bytes(size_t n);
  /// Ends what is pending on the stream: its operations fail (operation_aborted).
  void cancel();
  /// Closes the socket: the box learns at once that the connection is over.
  void close_socket();

 private:
  WsTarget target_;
  std::unique_ptr<asio::ssl::context> ssl_;
  std::unique_ptr<websocket::stream<beast::tcp_stream>> plain_;
  std::unique_ptr<websocket::stream<beast::ssl_stream<beast::tcp_stream>>> tls_;
};

}  // namespace sbx::sdk
