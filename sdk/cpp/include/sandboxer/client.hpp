#pragma once
/// sdk/cpp: a client of the sandboxer WebSocket API (subprotocol sandboxer.v1), on a libuv loop
/// the caller runs. Used by the `sandboxer` CLI (attach, exec, cp, stats).
#include <uv.h>

#include <boost/json.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "loop/uv-handle.hpp"

namespace sbx::sdk {

/// Where a box is and how to prove we may talk to it.
struct Endpoint {
  std::string url;        ///< ws://HOST:PORT[/PATH] or wss://...
  std::string token;      ///< bearer token, sent in the Authorization header
  bool insecure = false;  ///< wss: accept a self-signed certificate
};

/// Parses ws://HOST:PORT[/PATH]; throws std::invalid_argument naming what is wrong.
struct ParsedUrl {
  bool tls = false;
  std::string host;
  int port = 0;
  std::string path = "/";
};
ParsedUrl parse_url(const std::string& url);

/// One connection. Callbacks run on the loop's thread.
class Client {
 public:
  using OpenFn = std::function<void(const std::string& error)>;  ///< "" when connected
  using ReplyFn = std::function<void(const boost::json::object& reply)>;
  using EventFn = std::function<void(const boost::json::object& event, std::string_view line)>;
  using BinaryFn = std::function<void(uint32_t id, uint64_t offset, bool last, std::string_view data)>;
  using CloseFn = std::function<void(int code, const std::string& reason)>;

  Client(uv_loop_t* loop, Endpoint ep);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// Connects; `on_open` is called once, with "" or the reason it failed.
  void connect(OpenFn on_open);
  /// Sends a request; assigns its id (returned) unless it has one; `on_reply` gets its reply.
  int64_t request(boost::json::object req, ReplyFn on_reply = {});
  /// Sends one binary frame of file content (header: u32 id, u64 offset, u8 flags).
  void send_binary(uint32_t id, uint64_t offset, bool last, std::string_view data);
  /// Bytes waiting to be sent (for flow control of uploads).
  size_t pending_bytes() const;
  /// Called when everything queued has been handed to the socket.
  void on_drained(std::function<void()> fn);

  void on_event(EventFn fn);
  void on_binary(BinaryFn fn);
  /// Called once when the connection ends: the close code (1006 when there was none) and reason.
  /// Not called by the destructor: a connection the owner ends by destroying its Client is not
  /// news to it (the same for on_open's failure).
  void on_close(CloseFn fn);
  /// Closes with 1000.
  void close();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// subscribe{since} that reconnects by itself: after a 4008 (too slow) or a dropped connection
/// it subscribes again from the last seq it delivered, so `on_event` sees every seq once, in order.
/// A first connection that fails ends it at once: `on_end` gets 1006 and the connect error (4401
/// for a refused token).
class Subscription {
 public:
  using EventFn = Client::EventFn;
  using EndFn = std::function<void(int code, const std::string& reason)>;  ///< the box ended, or a fatal error
  Subscription(uv_loop_t* loop, Endpoint ep, uint64_t since, std::optional<std::string> branch, EventFn on_event,
               EndFn on_end);
  ~Subscription();
  void stop();
  uint64_t last_seq() const noexcept { return last_; }

 private:
  void start();
  uv_loop_t* loop_;
  Endpoint ep_;
  uint64_t last_;
  std::optional<std::string> branch_;
  EventFn on_event_;
  EndFn on_end_;
  std::unique_ptr<Client> client_;
  loop::UvHandle<uv_timer_t> retry_;
  int failures_ = 0;
  bool connected_ = false;  // connected once: only then are failures to reconnect retried
  bool stopped_ = false;
};

}  // namespace sbx::sdk
