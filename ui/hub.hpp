#pragma once
// What the page server's parts share, on its one thread: the events kept (Store), where they come
// from (a box or a journal), the pages connected, and the connections to the box (BoxLink).
// Private to ui/.
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast.hpp>
#include <boost/beast/ssl.hpp>
#include <boost/json.hpp>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "sandboxer/beast.hpp"
#include "ui/store.hpp"

namespace sbx::ui {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace websocket = beast::websocket;
using tcp = asio::ip::tcp;

/// One WebSocket frame to send: text (a JSON frame), or binary (a file's content relayed from the
/// box as it sent it: its header, then the bytes).
struct Frame {
  std::string bytes;
  bool binary = false;
};

/// One frame out, to the box (box-link.cpp) or to a page (page.cpp). A write that fails throws.
asio::awaitable<void> send_frame(sdk::WsStream& ws, const Frame& frame);
asio::awaitable<void> send_frame(websocket::stream<beast::tcp_stream>& ws, const Frame& frame);

/// Writes `out`'s frames to `ws` in order until `closed`: waits on `wake` while `out` is empty
/// (whoever queues a frame or closes cancels it), and runs `after` once each frame is out. A
/// write that fails throws to the caller.
template <class Ws, class After>
asio::awaitable<void> write_frames(Ws& ws, std::deque<Frame>& out, asio::steady_timer& wake, const bool& closed,
                                   After after) {
  while (!closed) {
    if (out.empty()) {
      wake.expires_at(asio::steady_timer::time_point::max());
      boost::system::error_code ec;
      co_await wake.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      continue;
    }
    co_await send_frame(ws, out.front());
    out.pop_front();
    after();
  }
}

/// One WebSocket connection to the box, authenticated with the box's token (never sent anywhere
/// else). Frames are sent in order once it is open; `on_text` gets each text frame, `on_binary`
/// (where given) each binary one, `on_close` once, with why. A wss:// box is verified against the system's CAs
/// (SSL_CERT_FILE and SSL_CERT_DIR are honoured) and its host name, unless `insecure` (SANDBOXER_INSECURE), as the
/// CLI's other commands do.
class BoxLink : public std::enable_shared_from_this<BoxLink> {
 public:
  using TextFn = std::function<void(std::string)>;
  using CloseFn = std::function<void(std::string)>;
  using Target = sdk::WsTarget;
  BoxLink(asio::io_context& io, Target target, TextFn on_text, CloseFn on_close, TextFn on_binary = {});
  void start();
  void send(std::string frame, bool binary = false);
  void close();
  bool closed() const { return closed_; }

 private:
  asio::awaitable<void> run();
  asio::awaitable<void> write_loop();
  void finish(std::string why);
  void cancel();

  asio::io_context& io_;
  TextFn on_text_;
  CloseFn on_close_;
  TextFn on_binary_;
  sdk::WsStream ws_;
  std::deque<Frame> out_;
  asio::steady_timer wake_;
  bool open_ = false, closed_ = false;
};

class PageSession;

/// Shared by the server and every page session (each holds it), so a session the io_context
/// destroys at exit still finds it; it owns no I/O object, which must go before the io_context.
struct Hub {
  explicit Hub(asio::io_context& io) : io(io) {}
  asio::io_context& io;
  Store store;
  bool live = false;
  std::string source;                    ///< the box's URL, or the journal directory
  BoxLink::Target box;                   ///< live: where the box is
  std::string box_state = "connecting";  ///< live: connecting, connected, or why it closed
  std::set<PageSession*> pages;

  /// Every page sends what it has not sent yet.
  void publish();
  /// `text` with the box's token replaced: it must never reach a page.
  std::string scrub(std::string text) const;
};

/// The page's WebSocket: its requests answered from the Store or relayed to the box, and the
/// events it subscribed to, sent at the page's own pace (at most kWindow frames queued).
class PageSession : public std::enable_shared_from_this<PageSession> {
 public:
  PageSession(std::shared_ptr<Hub> hub, beast::tcp_stream stream);
  ~PageSession();
  asio::awaitable<void> run(http::request<http::string_body> req);
  /// Queues the subscribed events the page has not had yet, up to the window.
  void pump();

 private:
  static constexpr size_t kWindow = 256;
  asio::awaitable<void> write_loop();
  void handle(std::string_view text);
  bool handle_local(const std::string& op, const std::string& id, const boost::json::object& req);
  void relay(const std::string& op, const std::string& id, const boost::json::object& req);
  void open_link();
  void from_box_text(std::string text);
  void from_box_binary(std::string bytes);
  void from_page_binary(std::string bytes);
  void box_closed(const std::string& why);
  void events_range(const std::string& id, const boost::json::object& req);
  void events_find(const std::string& id, const boost::json::object& req);
  void stats_from_journal(const std::string& id);
  void queue(std::string frame, bool binary = false);
  void reply(const std::string& id, boost::json::object fields);
  void fail(const std::string& id, std::string_view code, const std::string& message);

  std::shared_ptr<Hub> hub_;
  websocket::stream<beast::tcp_stream> ws_;
  std::deque<Frame> out_;
  asio::steady_timer wake_;
  bool closed_ = false;
  bool subscribed_ = false;
  std::string sub_branch_;
  size_t cursor_ = 0;
  std::shared_ptr<BoxLink> link_;
  std::set<std::string> pending_;  ///< ids (as JSON) of requests relayed and not answered yet
  /// fs.read requests relayed whose last frame has not come: id -> the offset of the next byte.
  std::map<uint32_t, uint64_t> reads_;
  /// The fs.write relayed whose content the page is sending in binary frames: its id, and the
  /// offset of the next byte.
  std::optional<std::pair<uint32_t, uint64_t>> write_;
};

}  // namespace sbx::ui
