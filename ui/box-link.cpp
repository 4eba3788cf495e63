// The page server's connections to the box: Boost.Beast's WebSocket client on the server's own
// io_context, so the relay and the page share one thread and need no locks.
#include "ui/hub.hpp"

namespace sbx::ui {

BoxLink::BoxLink(asio::io_context& io, Target target, TextFn on_text, CloseFn on_close, TextFn on_binary)
    : io_(io),
      target_(std::move(target)),
      on_text_(std::move(on_text)),
      on_close_(std::move(on_close)),
      on_binary_(std::move(on_binary)),
      wake_(io) {
  if (target_.tls) {
    sdk::configure_tls(ssl_, target_);
    tls_ = std::make_unique<websocket::stream<beast::ssl_stream<beast::tcp_stream>>>(io, ssl_);
  } else {
    plain_ = std::make_unique<websocket::stream<beast::tcp_stream>>(io);
  }
}

void BoxLink::start() {
  auto self = shared_from_this();
  if (tls_)
    asio::co_spawn(
        io_, [self]() { return self->run(*self->tls_); }, asio::detached);
  else
    asio::co_spawn(
        io_, [self]() { return self->run(*self->plain_); }, asio::detached);
}

void BoxLink::cancel() {
  if (tls_) beast::get_lowest_layer(*tls_).cancel();
  if (plain_) beast::get_lowest_layer(*plain_).cancel();
}

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

template <class Ws>
asio::awaitable<void> BoxLink::run(Ws& ws) {
  auto self = shared_from_this();
  try {
    co_await sdk::open_websocket(ws, target_, 4u << 20);
    open_ = true;
    asio::co_spawn(
        io_, [self, &ws]() { return self->write_loop(ws); }, asio::detached);
    beast::flat_buffer buf;
    while (!closed_) {
      co_await ws.async_read(buf, asio::use_awaitable);
      if (ws.got_text() && on_text_)
        on_text_(beast::buffers_to_string(buf.data()));
      else if (ws.got_binary() && on_binary_)
        on_binary_(beast::buffers_to_string(buf.data()));
      buf.consume(buf.size());
    }
    finish("closed");
  } catch (const boost::system::system_error& e) {
    std::string why = e.code() == websocket::error::closed && !ws.reason().reason.empty()
                          ? "closed by the box: " + std::string(ws.reason().reason.c_str())
                          : e.code().message();
    if (e.code() == websocket::error::closed && ws.reason().reason.empty())
      why = "closed by the box (" + std::to_string(ws.reason().code) + ")";
    finish("connection to " + target_.host + ":" + target_.port + ": " + why);
  } catch (const std::exception& e) {
    finish(std::string("connection to the box: ") + e.what());
  }
}

template <class Ws>
asio::awaitable<void> BoxLink::write_loop(Ws& ws) {
  auto self = shared_from_this();
  try {
    co_await write_frames(ws, out_, wake_, closed_, [] {});
    if (open_) {
      boost::system::error_code ec;
      co_await ws.async_close(websocket::close_code::normal, asio::redirect_error(asio::use_awaitable, ec));
    }
  } catch (const std::exception&) {
    // The read loop sees the same failure and reports it.
    cancel();
  }
}

}  // namespace sbx::ui
