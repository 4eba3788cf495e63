// The page server's connections to the box: Boost.Beast's WebSocket client on the server's own
// io_context, so the relay and the page share one thread and need no locks.
#include "ui/hub.hpp"

namespace sbx::ui {

namespace {

// The box answers a Close at once; one that does not within this is cut (the socket cancelled).
constexpr auto kCloseLimit = std::chrono::seconds(2);

}  // namespace

BoxLink::BoxLink(asio::io_context& io, Target target, TextFn on_text, CloseFn on_close, TextFn on_binary)
    : io_(io),
      on_text_(std::move(on_text)),
      on_close_(std::move(on_close)),
      on_binary_(std::move(on_binary)),
      ws_(io, std::move(target)),
      wake_(io) {}

void BoxLink::start() {
  auto self = shared_from_this();
  asio::co_spawn(
      io_, [self]() { return self->run(); }, asio::detached);
}

void BoxLink::cancel() { ws_.cancel(); }

void BoxLink::send(std::string frame, bool binary) {
  if (closed_) return;
  out_.push_back({std::move(frame), binary});
  wake_.cancel();
}

void BoxLink::close() {
  if (closed_) return;
  closed_ = true;
  wake_.cancel();
  cancel();
}

void BoxLink::finish(std::string why) {
  bool was_closed = closed_;
  closed_ = true;
  wake_.cancel();
  // The callbacks may hold the last reference to this link's owner: call them once, last.
  auto on_close = std::move(on_close_);
  on_text_ = nullptr;
  on_binary_ = nullptr;
  if (!was_closed && on_close) on_close(std::move(why));
}

asio::awaitable<void> BoxLink::run() {
  auto self = shared_from_this();
  try {
    co_await ws_.open(4u << 20);
    open_ = true;
    asio::co_spawn(
        io_, [self]() { return self->write_loop(); }, asio::detached);
    beast::flat_buffer buf;
    while (!closed_) {
      co_await ws_.read(buf);
      if (ws_.got_text() && on_text_)
        on_text_(beast::buffers_to_string(buf.data()));
      else if (ws_.got_binary() && on_binary_)
        on_binary_(beast::buffers_to_string(buf.data()));
      buf.consume(buf.size());
    }
    finish("closed");
  } catch (const boost::system::system_error& e) {
    auto reason = ws_.reason();
    std::string why = e.code() == websocket::error::closed && !reason.reason.empty()
                          ? "closed by the box: " + std::string(reason.reason.c_str())
                          : e.code().message();
    if (e.code() == websocket::error::closed && reason.reason.empty())
      why = "closed by the box (" + std::to_string(reason.code) + ")";
    const auto& target = ws_.target();
    finish("connection to " + target.host + ":" + target.port + ": " + why);
  } catch (const std::exception& e) {
    finish(std::string("connection to the box: ") + e.what());
  }
}

asio::awaitable<void> BoxLink::write_loop() {
  auto self = shared_from_this();
  try {
    co_await write_frames(ws_, out_, wake_, closed_, [] {});
    if (open_) co_await ws_.close(kCloseLimit);
  } catch (const std::exception&) {
    // The read loop sees the same failure and reports it.
    cancel();
  }
}

asio::awaitable<void> send_frame(sdk::WsStream& ws, const Frame& frame) {
  co_await ws.write(asio::buffer(frame.bytes), frame.binary);
}

}  // namespace sbx::ui
