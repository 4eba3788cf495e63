#pragma once
// The WebSocket API of a box (docs/architecture.md, "The protocol"; tests/protocol/README.md):
// libwebsockets on the supervisor's own libuv loop. Every client has a bounded queue; a live client
// that falls behind it is served from the journal until it has caught up, and only a client that
// takes nothing for stall_s is closed with 4008 and `resume_after=N`; the agent and the other
// clients go on.
// The ops are a table of small functions in ops-*.cpp (server-ops.hpp).
#include <uv.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace sbx::supervisor {

class Box;

struct ServerOptions {
  std::string addr = "127.0.0.1";
  int port = 0;                   // 0: any free port (reported in `server.listening`)
  std::string token;              // required, never empty
  std::string tls_cert, tls_key;  // both or neither
  size_t queue_bytes = 8u << 20;  // per client; past it: served from the journal until caught up
  // The events published while some client is catching up, held once for all of them: a client
  // whose cursor is within them reads them from memory, one further behind reads the journal.
  size_t recent_bytes = 32u << 20;
  int stall_s = 30;         // a client taking nothing for this long while owed frames: 4008
  int auth_timeout_s = 10;  // a client without a token header must authenticate by then
  // Before authentication a client is anyone who can reach the port: it may hold this many
  // connections in all (past it: HTTP 503), and send frames of this many bytes (past it: 1009).
  int max_unauthenticated = 64;
  size_t preauth_frame_bytes = 4096;
};

/// The bytes a WebSocket frame's header needs before its payload (LWS_PRE): the Box opens its
/// journal with this headroom, so the server sends an event from the journal's buffer.
extern const size_t kFrameHeadroom;

/// Splits "ADDR:PORT" ("[::1]:PORT" for IPv6); throws std::invalid_argument.
ServerOptions parse_listen(const std::string& listen);

class Server {
 public:
  /// Listens at once; throws std::runtime_error when it cannot.
  Server(Box& box, uv_loop_t* loop, ServerOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const noexcept;
  /// Lets clients take what is queued for them, closes them (1001), then calls `done` (at most ~2 s).
  void drain(std::function<void()> done);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sbx::supervisor
