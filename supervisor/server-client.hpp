#pragma once
// Internal to the WebSocket server (server.cpp and the ops-*.cpp files): one connected client and
// what it holds: its outgoing queue, its subscription, its uploads and downloads.
//
// Ownership: Server::Impl::clients owns every Client (std::unique_ptr, keyed by Client::id); the
// per-connection slot libwebsockets keeps for a wsi holds a non-owning Client* to the same object,
// cleared when the connection closes (LWS_CALLBACK_CLOSED), just before the map lets it go.
#include <libwebsockets.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "journal/journal.hpp"
#include "os/unique-fd.hpp"
#include "supervisor/fs-ops.hpp"

namespace sbx::supervisor {

// LWS_PRE bytes of headroom (lws writes the frame's header there), then the payload. A live
// event's buffer is shared by every client it is queued for: the header lws writes into the
// headroom is the same for all of them (an unmasked text frame of the same length, no extension),
// and a partly sent frame's rest is copied by lws, so sharing is safe on the one loop thread.
using FrameBuf = std::shared_ptr<std::string>;

struct OutFrame {
  FrameBuf buf;
  bool binary = false;
  uint64_t seq = 0;  // an event's seq, 0 for replies and file data
  size_t size() const { return buf->size() - LWS_PRE; }
};

// A file that is removed when its owner goes, unless released first.
struct TempPath {
  std::string path;
  TempPath() = default;
  explicit TempPath(std::string p) : path(std::move(p)) {}
  TempPath(TempPath&& o) noexcept : path(std::exchange(o.path, {})) {}
  TempPath& operator=(TempPath&& o) noexcept {
    if (this != &o) {
      reset();
      path = std::exchange(o.path, {});
    }
    return *this;
  }
  ~TempPath() { reset(); }
  void reset() {
    if (!path.empty()) ::unlink(path.c_str());
    path.clear();
  }
  std::string release() { return std::exchange(path, {}); }
};

struct Upload {
  os::UniqueFd fd;
  std::string path;
  uint64_t end = 0;
  boost::json::value id;
  // snapshot.import: the archive goes to a temporary file of the snapshot store, then is
  // checked whole and filed under its id.
  TempPath archive;
  uint64_t expected = 0;
  // fs.write: the file, where this upload made it (removed unless the upload ends well).
  MadeFile made;
};

struct Download {
  boost::json::value id;
  uint32_t bin_id;
  os::UniqueFd fd;
  uint64_t offset = 0;
  uint64_t remaining = 0;
};

struct Client {
  uint64_t id = 0;
  lws* wsi = nullptr;  // not owned: libwebsockets' connection, valid until LWS_CALLBACK_CLOSED
  bool authed = false;
  std::string peer;
  // The message being received.
  std::string rx;
  bool rx_new = true, rx_binary = false, rx_oversize = false;
  size_t rx_total = 0;
  boost::json::value rx_id;  // an oversize text frame's leading id (protocol::leading_id), for its error
  // What goes out.
  std::deque<OutFrame> q;
  size_t q_bytes = 0;
  uint64_t last_written_seq = 0;
  // The loop's time (ms) of the last frame handed to the socket, of the last look that found the
  // client's kernel had acknowledged more bytes (`acked`), or of the moment something was queued
  // for an idle client: a client with something to send and no progress for
  // ServerOptions::stall_s is closed with 4008.
  uint64_t progress_ms = 0;
  uint64_t acked = 0;  // os::tcp_bytes_acked at the last look
  // The subscription: replaying from disk until caught up, then live. A live client whose queue
  // passes ServerOptions::queue_bytes goes back to replaying (from `cursor`), so a slow reader
  // costs a bounded queue, never a gap.
  bool subscribed = false, live = false;
  uint64_t cursor = 0;  // the last seq sent (or skipped by the filter)
  // Where the last refill from the journal stopped, and the seq it stopped at: the next refill
  // starts there instead of at the start of the segment.
  journal::Journal::ReadPos replay_pos;
  uint64_t replay_pos_seq = 0;
  std::optional<std::string> branch;
  std::map<uint32_t, Upload> uploads;
  std::set<uint32_t> failed_uploads;
  std::deque<Download> downloads;
  int close_code = 0;
  std::string close_reason;
  bool peer_closed = false;
  // libwebsockets drops the connection without a Close when the peer's Close arrives while part
  // of a frame is still buffered: reading waits while a frame is partly written (server.cpp).
  bool rx_held = false;
  // Its requests are not read while over kRepliesHigh of replies wait for it (server.cpp, send).
  bool rx_full = false;
  // writeable() left writing for the client's waiting input to be read first: the read resumes it.
  bool write_after_read = false;
};

}  // namespace sbx::supervisor
