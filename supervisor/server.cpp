#include "supervisor/server.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <boost/json.hpp>
#include <map>
#include <memory>
#include <optional>
#include <string_view>

#include "base/encoding.hpp"
#include "loop/uv-handle.hpp"
#include "os/sys.hpp"
#include "protocol/protocol.hpp"
#include "supervisor/box.hpp"
#include "supervisor/libwebsockets.hpp"
#include "supervisor/server-client.hpp"
#include "supervisor/server-ops.hpp"

namespace sbx::supervisor {

namespace json = boost::json;
using protocol::RequestError;

namespace {

auto log() {
  static auto l = spdlog::default_logger()->clone("server");
  return l;
}

// Refill (replay from disk, file reads) when the queue falls below the low mark, up to the high
// one. A refill goes on from where the last one stopped (Journal::ReadPos), so refills can be
// small: what a client catching up holds stays near the high mark.
constexpr size_t kLowWater = 256u << 10;
constexpr size_t kRepliesHigh = 16u << 20;  // queued for a client: its requests wait past it
constexpr size_t kHighWater = 1u << 20;
constexpr size_t kReplayBatch = 512u << 10;
constexpr size_t kReadChunk = 256u << 10;  // fs.read frame size

// The ops (server-ops.hpp), in the order the unknown_op reply lists them.
struct Op {
  std::string_view name;
  OpFn run;
};
constexpr std::array kOps{
    Op{"auth", op_auth},
    Op{"subscribe", op_subscribe},
    Op{"unsubscribe", op_unsubscribe},
    Op{"exec", op_exec},
    Op{"stdin", op_stdin},
    Op{"signal", op_signal},
    Op{"resize", op_resize},
    Op{"fs.read", op_fs_read},
    Op{"fs.write", op_fs_write},
    Op{"fs.list", op_fs_list},
    Op{"fs.stat", op_fs_stat},
    Op{"fs.remove", op_fs_remove},
    Op{"fs.mkdir", op_fs_mkdir},
    Op{"fs.rename", op_fs_rename},
    Op{"fs.symlink", op_fs_symlink},
    Op{"fs.chmod", op_fs_chmod},
    Op{"stats", op_stats},
    Op{"shutdown", op_shutdown},
    Op{"ping", op_ping},
    Op{"checkpoint", op_checkpoint},
    Op{"checkpoint.release", op_checkpoint_release},
    Op{"restore", op_restore},
    Op{"fork", op_fork},
    Op{"snapshot.list", op_snapshot_list},
    Op{"snapshot.export", op_snapshot_export},
    Op{"snapshot.import", op_snapshot_import},
    Op{"snapshot.chunks", op_snapshot_chunks},
    Op{"snapshot.lacks", op_snapshot_lacks},
    Op{"snapshot.delete", op_snapshot_delete},
};

const Op* find_op(std::string_view name) {
  for (const auto& op : kOps)
    if (op.name == name) return &op;
  return nullptr;
}

std::string unknown_op_message(std::string_view name) {
  std::string known;
  for (const auto& op : kOps) known += (known.empty() ? "" : ", ") + std::string(op.name);
  return "unknown op \"" + std::string(name) + "\" (known: " + known + ")";
}

}  // namespace

struct Server::Impl {
  Box& box;
  uv_loop_t* loop;
  ServerOptions opts;
  lws_context* ctx = nullptr;
  lws_protocols protocols[3]{};
  lws_retry_bo_t retry{};
  int port = 0;
  int listener = 0;
  uint64_t next_client = 1;
  // Every connected client, owned here; libwebsockets' per-connection slot holds a non-owning
  // pointer to the same Client (server-client.hpp).
  std::map<uint64_t, std::unique_ptr<Client>> clients;
  int unauthenticated = 0;  // clients that have not authenticated yet (opts.max_unauthenticated)
  bool draining = false;
  std::function<void()> drained;
  uint64_t drain_started_ms = 0;
  loop::UvHandle<uv_timer_t> drain_timer;
  loop::UvHandle<uv_timer_t> stall_timer;  // looks for clients that take nothing (stall_s)
  // Every event published since the earliest cursor of a client catching up (not live), with
  // contiguous seqs, at most opts.recent_bytes; empty while every client is live.
  struct Recent {
    uint64_t seq;
    FrameBuf buf;
    std::optional<std::string> branch;
  };
  std::deque<Recent> recent;
  size_t recent_size = 0;
  ListWindows list_windows;  // fs.list's pages

  Impl(Box& b, uv_loop_t* l, ServerOptions o) : box(b), loop(l), opts(std::move(o)) {}

  static int callback(lws* wsi, lws_callback_reasons reason, void* user, void* in, size_t len);
  int on_callback(lws* wsi, lws_callback_reasons reason, void* user, void* in, size_t len);

  bool token_ok(std::string_view given) const {
    // Constant time in the length of the given token: no early exit on the first difference.
    const std::string& want = opts.token;
    volatile unsigned char diff = given.size() == want.size() ? 0 : 1;
    for (size_t i = 0; i < given.size(); ++i)
      diff =
          static_cast<unsigned char>(diff | (static_cast<unsigned char>(given[i]) ^
                                             static_cast<unsigned char>(want[i % (want.empty() ? 1 : want.size())])));
    return diff == 0 && !want.empty();
  }

  static std::string header(lws* wsi, lws_token_indexes h) {
    int n = ws_lib().lws_hdr_total_length(wsi, h);
    if (n <= 0 || n > 8192) return {};
    std::string s(static_cast<size_t>(n) + 1, '\0');
    if (ws_lib().lws_hdr_copy(wsi, s.data(), n + 1, h) < 0) return {};
    s.resize(static_cast<size_t>(n));
    return s;
  }
  static std::optional<std::string> bearer(lws* wsi) {
    std::string a = header(wsi, WSI_TOKEN_HTTP_AUTHORIZATION);
    if (a.empty()) return std::nullopt;
    if (a.size() > 7 && (a.starts_with("Bearer ") || a.starts_with("bearer "))) return a.substr(7);
    return std::string();  // present but not a bearer token: wrong
  }

  static FrameBuf frame_buf(std::string_view payload) {
    auto buf = std::make_shared<std::string>();
    buf->reserve(LWS_PRE + payload.size());
    buf->assign(LWS_PRE, '\0');
    buf->append(payload);
    return buf;
  }
  // The journal's own buffer when it left the frame's headroom (the Box opens it with kFrameHeadroom), else a copy.
  static FrameBuf frame_of(const journal::Event& e) { return e.headroom == LWS_PRE ? e.buf : frame_buf(e.line); }
  void enqueue(Client& c, std::string_view payload, bool binary, uint64_t seq = 0) {
    if (c.peer_closed) return;
    enqueue(c, frame_buf(payload), binary, seq);
  }
  void enqueue(Client& c, FrameBuf buf, bool binary, uint64_t seq = 0) {
    if (c.peer_closed) return;
    if (c.q.empty()) c.progress_ms = uv_now(loop);  // the stall clock starts with the first owed frame
    OutFrame f;
    f.buf = std::move(buf);
    f.binary = binary;
    f.seq = seq;
    c.q_bytes += f.size();
    c.q.push_back(std::move(f));
    ws_lib().lws_callback_on_writable(c.wsi);
  }
  // Always UTF-8 text: a message naming what the agent chose gets U+FFFD for a byte that is not.
  // Replies are not bounded as events are (they cannot be read again from the journal): past
  // kRepliesHigh queued, the client's requests are not read until it has taken what it owes
  // (a client that sent 1000 large fs.list and read nothing grew the supervisor by 30 MB/s).
  void send(Client& c, const json::object& o) {
    enqueue(c, base::json_text(o), false);
    if (c.q_bytes > kRepliesHigh && !c.rx_full && !c.peer_closed) {
      c.rx_full = true;
      ws_lib().lws_rx_flow_control(c.wsi, 0);
    }
  }

  void close_with(Client& c, int code, std::string reason) {
    if (c.close_code) return;
    c.close_code = code;
    c.close_reason = std::move(reason);
    ws_lib().lws_callback_on_writable(c.wsi);
  }

  void stalled(Client& c) {
    // The journal has everything: drop what is queued and tell the client where to resume.
    log()->info("client {} ({}) took nothing for {} s: closing with 4008 after seq {}", c.id, c.peer, opts.stall_s,
                c.last_written_seq);
    c.q.clear();
    c.q_bytes = 0;
    c.downloads.clear();
    c.subscribed = false;
    close_with(c, protocol::kCloseTooSlow, "resume_after=" + std::to_string(c.last_written_seq));
    // A client that never reads again cannot even take the close frame: give up on it later.
    ws_lib().lws_set_timeout(c.wsi, PENDING_TIMEOUT_USER_OK, 60);
  }

  static std::optional<std::string_view> branch_of(const json::object& ev) {
    auto* b = ev.if_contains("branch");
    if (!b || !b->is_string()) return std::nullopt;
    return std::string_view(b->as_string());
  }
  // Whether a client's subscription (its branch filter) takes an event of `branch`.
  static bool wants(const Client& c, std::optional<std::string_view> branch) {
    return !c.branch || branch == *c.branch;
  }
  static bool wants(const Client& c, const json::object& ev) { return wants(c, branch_of(ev)); }

  void on_event(const journal::Event& e) {
    FrameBuf shared;  // one copy of the event for every client it goes to (OutFrame)
    bool behind = false;
    for (auto& [id, c] : clients) {
      if (!c->subscribed) continue;
      if (!c->live) {
        behind = behind || !c->peer_closed;
        continue;
      }
      if (e.seq <= c->cursor) continue;
      c->cursor = e.seq;
      if (!wants(*c, e.obj) || c->peer_closed) continue;
      if (!shared) shared = frame_of(e);
      enqueue(*c, shared, false, e.seq);
      // Past the bound the client reads `recent` or the journal (pump) from `cursor` on, at its own
      // pace, and goes live again once it has caught up: nothing is queued twice or skipped.
      if (c->q_bytes > opts.queue_bytes) {
        c->live = false;
        behind = true;
      }
    }
    if (!behind) return drop_recent();
    if (!recent.empty() && e.seq != recent.back().seq + 1) drop_recent();  // never a gap
    if (!shared) shared = frame_of(e);
    auto branch = branch_of(e.obj);
    recent_size += shared->size();
    recent.push_back({e.seq, std::move(shared), branch ? std::optional<std::string>(*branch) : std::nullopt});
    while (recent_size > opts.recent_bytes) pop_recent();
  }

  void pop_recent() {
    recent_size -= recent.front().buf->size();
    recent.pop_front();
  }
  void drop_recent() {
    recent.clear();
    recent_size = 0;
  }
  // Lets go of what every client catching up has already taken.
  void trim_recent() {
    uint64_t oldest = UINT64_MAX;
    for (auto& [id, c] : clients)
      if (c->subscribed && !c->live && !c->peer_closed) oldest = std::min(oldest, c->cursor);
    if (oldest == UINT64_MAX) return drop_recent();
    while (!recent.empty() && recent.front().seq <= oldest) pop_recent();
  }

  // Refills a client catching up from `recent` when its cursor is within it; false when not.
  bool refill_from_recent(Client& c) {
    if (recent.empty() || c.cursor + 1 < recent.front().seq || c.cursor >= recent.back().seq) return false;
    size_t i = static_cast<size_t>(c.cursor + 1 - recent.front().seq);  // contiguous seqs
    for (; i < recent.size() && c.q_bytes < kHighWater; ++i) {
      const Recent& r = recent[i];
      c.cursor = r.seq;
      if (wants(c, r.branch)) enqueue(c, r.buf, false, r.seq);
    }
    c.replay_pos = {};
    // Everything published is queued: the listener delivers from here on (one thread).
    if (i == recent.size()) c.live = true;
    return true;
  }

  // Owed frames (queued, a download, or journal still to replay) and nothing taken for stall_s.
  // Taken is what the client's kernel acknowledged: a client on a slow link takes a few KB at a
  // time out of the megabytes the server's kernel holds for it, so no new frame goes to the socket
  // for many seconds while it reads all the while (one at 64 KB/s was closed after 2 s).
  void check_stalls() {
    uint64_t now = uv_now(loop);
    list_windows.expire(now);
    for (auto& [id, c] : clients) {
      bool owed = !c->q.empty() || !c->downloads.empty() || (c->subscribed && !c->live);
      if (!owed || c->close_code || c->peer_closed) continue;
      ws_lib().lws_callback_on_writable(c->wsi);  // in case a read left it waiting (writeable)
      if (auto acked = os::tcp_bytes_acked(ws_lib().lws_get_socket_fd(c->wsi)); acked && *acked != c->acked) {
        c->acked = *acked;
        c->progress_ms = now;
      }
      if (now - c->progress_ms >= static_cast<uint64_t>(opts.stall_s) * 1000) stalled(*c);
    }
  }

  // Refills the queue from the journal on disk and from file reads while it is short.
  void pump(Client& c) {
    if (c.q_bytes >= kLowWater) return;
    while (c.q_bytes < kHighWater && c.close_code != protocol::kCloseTooSlow &&
           c.close_code != protocol::kCloseUnauthorized) {
      if (!c.downloads.empty()) {
        auto& d = c.downloads.front();
        size_t want = static_cast<size_t>(std::min<uint64_t>(d.remaining, kReadChunk));
        std::string frame;
        protocol::BinaryHeader h{d.bin_id, d.offset, 0};
        std::string data(want, '\0');
        size_t got = 0;
        while (got < want) {
          ssize_t n = ::pread(d.fd.get(), data.data() + got, want - got, static_cast<off_t>(d.offset + got));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) break;
          got += static_cast<size_t>(n);
        }
        data.resize(got);
        bool last = got < want || d.remaining - got == 0;
        if (last) h.flags |= protocol::kFlagLast;
        protocol::put_header(frame, h);
        frame.append(data);
        d.offset += got;
        d.remaining -= got;
        enqueue(c, std::move(frame), true);
        if (last) c.downloads.pop_front();
        continue;
      }
      if (c.subscribed && !c.live && refill_from_recent(c)) continue;
      if (c.subscribed && !c.live) {
        if (!replay(c)) break;
        continue;
      }
      break;
    }
    if (!recent.empty()) trim_recent();
  }

  // One batch of a client's replay from the journal on disk; false when the replay failed (the
  // client told, its subscription ended).
  bool replay(Client& c) {
    size_t bytes = 0;
    bool stopped = false;
    const std::string dir = box.journal().dir();
    // The position of the last refill is good while the cursor has not gone back before it
    // (a new subscribe may ask for an earlier since).
    if (c.cursor < c.replay_pos_seq) c.replay_pos = {};
    // Goes on at `seq`, `bytes` further: false when the batch is done.
    auto advance = [&](uint64_t seq, size_t more) {
      c.cursor = seq;
      c.replay_pos_seq = seq;
      bytes += more;
      stopped = bytes >= kReplayBatch || seq >= box.journal().last_seq();
      return !stopped;
    };
    auto r = journal::Journal::read(
        dir, c.cursor,
        [&](uint64_t seq, std::string_view line) {
          bool keep = true;
          if (c.branch) {
            boost::system::error_code ec;
            auto v = json::parse(line, ec);
            keep = !ec && v.is_object() && wants(c, v.as_object());
          }
          if (keep) enqueue(c, line, false, seq);
          return advance(seq, keep ? line.size() : 0);
        },
        &c.replay_pos,
        [&](const journal::Journal::Gap& g) {
          // A segment damaged on disk: the client is told which seqs it will not get, in their
          // place (whatever its branch), and the replay goes on after them. The newest segment's
          // end is the journal's last seq (a later one would be a segment of its own).
          uint64_t last = g.last_or(box.journal().last_seq());
          if (last < g.first) return true;
          log()->error("replay journal for client {}: {}", c.id, journal::Journal::describe(g));
          auto line = journal::Journal::unreadable_event(g, last, box.id());
          enqueue(c, line, false, last);
          return advance(last, line.size());
        });
    if (!r) {
      log()->error("replay journal for client {}: {}", c.id, r.error().message());
      send(c, protocol::error_reply(nullptr, "replay_failed", "read the journal: " + r.error().message()));
      c.subscribed = false;
      return false;
    }
    // Caught up: from here on the listener delivers, with nothing missed in between (one thread).
    if (!stopped || c.cursor >= box.journal().last_seq()) c.live = true;
    return true;
  }

  // True when the client has sent bytes not read yet: they are read (a Close answered, a request
  // served) before more is written, so a Close never meets a half-written frame.
  static bool input_waiting(lws* wsi) {
    char b;
    return ::recv(ws_lib().lws_get_socket_fd(wsi), &b, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
  }

  int writeable(Client& c) {
    if (c.rx_held) {
      // The partly written frame is out (lws calls here only then): read again, and first.
      c.rx_held = false;
      if (!c.rx_full) ws_lib().lws_rx_flow_control(c.wsi, 1);
      // Not asking to write again here: lws serves writing before reading in a turn, so only
      // the read may run next, which asks to write again (LWS_CALLBACK_RECEIVE). What it reads
      // asks to write when it must (a reply, a Close), and new events and the stall timer ask too.
      if (input_waiting(c.wsi)) {
        c.write_after_read = true;
        return 0;
      }
    }
    pump(c);
    while (!c.q.empty() && !ws_lib().lws_send_pipe_choked(c.wsi)) {
      auto& f = c.q.front();
      size_t n = f.size();
      int w = ws_lib().lws_write(c.wsi, reinterpret_cast<unsigned char*>(f.buf->data()) + LWS_PRE, n,
                                 f.binary ? LWS_WRITE_BINARY : LWS_WRITE_TEXT);
      if (w < 0) return -1;
      if (f.seq) c.last_written_seq = f.seq;
      c.progress_ms = uv_now(loop);
      c.q_bytes -= n;
      c.q.pop_front();
      if (c.q_bytes < kLowWater) pump(c);
    }
    if (c.rx_full && c.q_bytes < kRepliesHigh / 2) {
      c.rx_full = false;  // it took what it owed: its requests are read again
      if (!c.rx_held) ws_lib().lws_rx_flow_control(c.wsi, 1);
    }
    if (ws_lib().lws_partial_buffered(c.wsi) && !c.close_code) {
      c.rx_held = true;
      ws_lib().lws_rx_flow_control(c.wsi, 0);
    }
    // Not while lws still holds the tail of a frame (lws_partial_buffered): a close written then
    // goes out first and the hang-up drops that tail, so the client would lose the last events.
    if (c.close_code && c.q.empty() && c.downloads.empty() && !(c.subscribed && !c.live) &&
        !ws_lib().lws_partial_buffered(c.wsi)) {
      // The close frame is written here, so it goes out even when lws would hang up first.
      std::string frame(LWS_PRE, '\0');
      frame.push_back(static_cast<char>((c.close_code >> 8) & 0xff));
      frame.push_back(static_cast<char>(c.close_code & 0xff));
      frame.append(c.close_reason.substr(0, 123));
      ws_lib().lws_write(c.wsi, reinterpret_cast<unsigned char*>(frame.data()) + LWS_PRE, frame.size() - LWS_PRE,
                         static_cast<lws_write_protocol>(4) /* LWS_WRITE_CLOSE, internal in 4.1 */);
      return -1;
    }
    if (!c.q.empty() || !c.downloads.empty() || (c.subscribed && !c.live) || c.close_code)
      ws_lib().lws_callback_on_writable(c.wsi);
    return 0;
  }

  int on_receive(Client& c, const char* data, size_t len) {
    if (c.rx_new) {
      c.rx.clear();
      c.rx_binary = ws_lib().lws_frame_is_binary(c.wsi);
      c.rx_oversize = false;
      c.rx_total = 0;
      c.rx_id = nullptr;
      c.rx_new = false;
    }
    size_t cap = c.rx_binary ? protocol::kMaxBinaryData + protocol::kBinaryHeader : protocol::kMaxTextFrame;
    c.rx_total += len;
    if (!c.authed && c.rx_total > opts.preauth_frame_bytes) {
      // Anyone who reaches the port gets this far: hold none of it, and close at once.
      log()->info("client {} ({}) refused: a frame of over {} bytes before authentication", c.id, c.peer,
                  opts.preauth_frame_bytes);
      c.rx.clear();
      c.rx.shrink_to_fit();
      c.rx_new = true;
      close_with(c, protocol::kCloseTooBig,
                 "a frame before authentication is capped at " + std::to_string(opts.preauth_frame_bytes) +
                     " bytes: authenticate first");
      return 0;
    }
    if (c.rx_total > cap) {
      // What is kept of it (up to the cap) names its id, where it begins with one.
      if (!c.rx_oversize && !c.rx_binary)
        c.rx_id = protocol::leading_id(c.rx.empty() ? std::string_view(data, std::min<size_t>(len, 4096))
                                                    : std::string_view(c.rx).substr(0, 4096));
      c.rx_oversize = true;
      c.rx.clear();
      c.rx.shrink_to_fit();
    } else {
      c.rx.append(data, len);
    }
    if (!ws_lib().lws_is_final_fragment(c.wsi)) return 0;
    c.rx_new = true;
    if (c.rx_oversize) {
      std::string what = c.rx_binary ? "binary" : "text";
      std::string msg = what + " frame of " + std::to_string(c.rx_total) + " bytes exceeds the cap of " +
                        std::to_string(cap) + " bytes";
      if (!c.authed) {
        close_with(c, protocol::kCloseUnauthorized, "authenticate first");
        return 0;
      }
      send(c, protocol::error_reply(c.rx_id, "frame_too_large", msg));
      return 0;
    }
    std::string msg = std::move(c.rx);
    c.rx.clear();
    return on_message(c, msg, c.rx_binary);
  }

  int on_message(Client& c, std::string_view msg, bool binary) {
    if (!c.authed) {
      // Without the header, the first frame must be {"op":"auth","token":...}.
      json::value id;
      try {
        if (binary) throw RequestError("unauthorized", "a binary frame before authentication");
        auto req = protocol::parse_request(msg, &id);
        if (req.op != "auth")
          throw RequestError("unauthorized", "authentication required: send {\"op\":\"auth\",\"token\":...} first");
        auto token = protocol::opt_string(req.fields, "token");
        if (!token || !token_ok(*token)) throw RequestError("unauthorized", "wrong token");
        c.authed = true;
        --unauthenticated;
        ws_lib().lws_set_timeout(c.wsi, NO_PENDING_TIMEOUT, 0);
        send(c, protocol::ok_reply(req.id));
        return 0;
      } catch (const RequestError& e) {
        log()->info("client {} ({}) refused: {}", c.id, c.peer, e.what());
        std::string reason = e.what();
        if (reason.size() > 120) reason.resize(120);
        c.q.clear();
        c.q_bytes = 0;
        close_with(c, protocol::kCloseUnauthorized, reason);
        return 0;
      }
    }
    if (binary) return on_binary(c, msg);
    dispatch(c, msg);
    return 0;
  }

  int on_binary(Client& c, std::string_view msg) {
    auto h = protocol::get_header(msg);
    if (!h) {
      send(c, protocol::error_reply(nullptr, "bad_binary",
                                    "binary frame of " + std::to_string(msg.size()) +
                                        " bytes is shorter than its 13-byte header (u32 id, u64 offset, u8 flags)"));
      return 0;
    }
    auto data = msg.substr(protocol::kBinaryHeader);
    if (c.failed_uploads.contains(h->id)) {
      if (h->last()) c.failed_uploads.erase(h->id);
      return 0;
    }
    auto it = c.uploads.find(h->id);
    if (it == c.uploads.end()) {
      send(c,
           protocol::error_reply(h->id, "unexpected_binary",
                                 "binary frame for request " + std::to_string(h->id) +
                                     ", which is no fs.write or snapshot.import in progress (binary frames carry file "
                                     "content only)"));
      return 0;
    }
    Upload& u = it->second;
    if (!u.archive.path.empty() && h->offset + data.size() > u.expected) {
      // The reply says what the upload announced: read before erase frees it.
      auto rid = u.id;
      auto expected = u.expected;
      if (!h->last()) c.failed_uploads.insert(h->id);
      c.uploads.erase(it);
      send(c, protocol::error_reply(rid, "bad_snapshot",
                                    "snapshot.import: a frame reaches byte " + std::to_string(h->offset + data.size()) +
                                        ", past the " + std::to_string(expected) + " bytes announced in size"));
      return 0;
    }
    size_t done = 0;
    while (done < data.size()) {
      ssize_t n = ::pwrite(u.fd.get(), data.data() + done, data.size() - done, static_cast<off_t>(h->offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        std::string err = std::strerror(errno);
        auto rid = u.id;
        std::string path = u.path;
        if (!h->last()) c.failed_uploads.insert(h->id);
        c.uploads.erase(it);
        send(c, protocol::error_reply(rid, "io_error", "write " + path + ": " + err));
        return 0;
      }
      done += static_cast<size_t>(n);
    }
    u.end = std::max<uint64_t>(u.end, h->offset + data.size());
    if (h->last() && !u.archive.path.empty()) {
      import_uploaded(c, it);
      return 0;
    }
    if (h->last()) {
      if (auto e = u.made.commit()) {
        auto rid = u.id;
        std::string path = u.path;
        c.uploads.erase(it);
        send(c, protocol::error_reply(rid, "io_error", "replace " + path + ": " + *e));
        return 0;
      }
      auto reply = protocol::ok_reply(u.id);
      reply["size"] = u.end;
      base::put_bytes_field(reply, "path", u.path);
      c.uploads.erase(it);
      send(c, reply);
    }
    return 0;
  }

  void import_uploaded(Client& c, std::map<uint32_t, Upload>::iterator it) {
    Upload u = std::move(it->second);
    c.uploads.erase(it);
    u.fd.reset();
    if (u.end != u.expected) {
      send(c, protocol::error_reply(u.id, "bad_snapshot",
                                    "snapshot.import: the upload ended at " + std::to_string(u.end) + " of the " +
                                        std::to_string(u.expected) + " bytes announced in size (truncated?)"));
      return;
    }
    box.snapshot_import(u.archive.release(), later_reply(c, u.id));
  }

  // A reply the Box gives when its work is done ({"ok": ..., ...}, "ok" true unless it says),
  // sent with the request's id if the client is still connected.
  std::function<void(json::object)> later_reply(const Client& c, json::value id) {
    return [this, cid = c.id, id = std::move(id)](json::object body) {
      auto it = clients.find(cid);
      if (it == clients.end()) return;
      send(*it->second, protocol::reply_with_id(id, body));
    };
  }

  // A whole frame sent later, if the client is still connected.
  std::function<void(const json::object&)> later_sender(const Client& c) {
    return [this, cid = c.id](const json::object& frame) {
      auto it = clients.find(cid);
      if (it != clients.end()) send(*it->second, frame);
    };
  }

  void dispatch(Client& c, std::string_view text);

  // Answers an upgrade request with a plain HTTP error (written whole, then the connection ends).
  static int reject_http(lws* wsi, int code, const char* reason, const std::string& text) {
    std::string body = text + "\n";
    std::string resp = std::string(LWS_PRE, '\0') + "HTTP/1.1 " + std::to_string(code) + " " + reason +
                       "\r\nContent-Type: text/plain\r\nContent-Length: " + std::to_string(body.size()) +
                       "\r\nConnection: close\r\n" + (code == 401 ? "WWW-Authenticate: Bearer\r\n" : "") + "\r\n" +
                       body;
    ws_lib().lws_write(wsi, reinterpret_cast<unsigned char*>(resp.data()) + LWS_PRE, resp.size() - LWS_PRE,
                       LWS_WRITE_HTTP);
    return 1;
  }
};

// The one boundary an op runs in (docs/errors.md, section 3): a refusal (RequestError, from the
// parser or the op) is replied with its code and the request's id when it was readable; anything
// else escaping an op is replied as `internal`, and the client, the box and the agent go on.
// Every op needs an authenticated client: on_message lets no other reach here.
void Server::Impl::dispatch(Client& c, std::string_view text) {
  json::value id;
  try {
    auto req = protocol::parse_request(text, &id);
    log()->debug("client {}: {}", c.id, req.op);
    const Op* op = find_op(req.op);
    if (!op) throw RequestError("unknown_op", unknown_op_message(req.op));
    OpContext ctx{*this, box, c, req};
    op->run(ctx);
  } catch (const RequestError& e) {
    send(c, protocol::error_reply(id, e.code, e.what()));
  } catch (const std::exception& e) {
    send(c, protocol::error_reply(id, "internal", e.what()));
  }
}

void OpContext::reply(const json::object& frame) { server.send(client, frame); }

Box::Reply OpContext::later() { return server.later_reply(client, req.id); }

std::function<void(const json::object&)> OpContext::sender() { return server.later_sender(client); }

std::function<void(json::object, os::UniqueFd, uint64_t)> OpContext::later_download(uint32_t bid) {
  return [&server = server, cid = client.id, id = req.id, bid](json::object ok, os::UniqueFd fd, uint64_t size) {
    auto it = server.clients.find(cid);
    if (it == server.clients.end()) return;
    Client& c = *it->second;
    server.send(c, protocol::reply_with_id(id, ok));
    c.downloads.push_back({id, bid, std::move(fd), 0, size});
    ws_lib().lws_callback_on_writable(c.wsi);
  };
}

void OpContext::wake() { ws_lib().lws_callback_on_writable(client.wsi); }

void OpContext::open_transfer() const {
  // A client that opened 10,000 fs.writes and sent no frame held the supervisor's whole
  // RLIMIT_NOFILE: criu, an exec's fds and every file op failed until it went.
  auto open = [](const Client& c) { return c.uploads.size() + c.downloads.size(); };
  if (size_t mine = open(client); mine >= kMaxTransfers)
    throw RequestError("limit", "this connection has " + std::to_string(mine) +
                                    " transfers open, the most it may: " + "finish one (its last frame) first");
  struct rlimit rl {};
  size_t all = 0;
  for (auto& [id, c] : server.clients) all += open(*c);
  size_t cap = ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? rl.rlim_cur / 4 : 4096;
  if (all >= std::max<size_t>(cap, kMaxTransfers))
    throw RequestError("limit", "the box's connections have " + std::to_string(all) +
                                    " transfers open, the most they may (a quarter of its open files' limit)");
}

bool OpContext::token_ok(std::string_view token) const { return server.token_ok(token); }

FsRoots OpContext::roots() const {
  std::string branch = protocol::opt_string(req.fields, "branch").value_or("main");
  if (!box.has_branch(branch)) throw RequestError("no_such_branch", "no branch named " + branch);
  return {box.branch_dir(branch) + "/workspace", box.branch_tmp(branch)};
}

ListPage OpContext::list_page(const std::string& path, size_t limit, const std::string& after) {
  return server.list_windows.page(roots(), path, limit, after, uv_now(server.loop));
}

uint32_t OpContext::binary_id(const char* op) const {
  const auto& id = req.id;
  if ((id.is_int64() && id.as_int64() >= 0 && id.as_int64() <= 0xffffffffLL) ||
      (id.is_uint64() && id.as_uint64() <= 0xffffffffULL))
    return static_cast<uint32_t>(id.to_number<uint64_t>());
  throw RequestError("bad_request", std::string(op) + " needs an integer id in [0, 2^32): binary frames carry it");
}
int Server::Impl::callback(lws* wsi, lws_callback_reasons reason, void* user, void* in, size_t len) {
  auto* ctx = ws_lib().lws_get_context(wsi);
  auto* self = ctx ? static_cast<Impl*>(ws_lib().lws_context_user(ctx)) : nullptr;
  if (!self) return ws_lib().lws_callback_http_dummy(wsi, reason, user, in, len);
  try {
    return self->on_callback(wsi, reason, user, in, len);
  } catch (const std::exception& e) {
    log()->error("websocket callback {}: {}", static_cast<int>(reason), e.what());
    return -1;
  }
}

int Server::Impl::on_callback(lws* wsi, lws_callback_reasons reason, void* user, void* in, size_t len) {
  auto** slot = static_cast<Client**>(user);
  switch (reason) {
    case LWS_CALLBACK_HTTP_CONFIRM_UPGRADE: {
      std::string proto = header(wsi, WSI_TOKEN_PROTOCOL);
      bool has = false;
      size_t pos = 0;
      while (pos <= proto.size()) {
        size_t comma = proto.find(',', pos);
        std::string p = proto.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        while (!p.empty() && p.front() == ' ') p.erase(0, 1);
        while (!p.empty() && p.back() == ' ') p.pop_back();
        has |= p == protocol::kSubprotocol;
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
      if (!has) return reject_http(wsi, 400, "Bad Request", "the WebSocket subprotocol sandboxer.v1 is required");
      auto b = bearer(wsi);
      if (b && !token_ok(*b)) {
        log()->info("refused a connection: wrong token in the Authorization header");
        return reject_http(wsi, 401, "Unauthorized", "wrong token");
      }
      if (!b && unauthenticated >= opts.max_unauthenticated) {
        log()->info("refused a connection: {} unauthenticated connections are open", unauthenticated);
        return reject_http(wsi, 503, "Service Unavailable",
                           "too many unauthenticated connections (" + std::to_string(opts.max_unauthenticated) +
                               "): send the token in the Authorization header, or retry later");
      }
      return 0;
    }
    case LWS_CALLBACK_HTTP:
      // Plain HTTP: nothing is served but the WebSocket.
      if (ws_lib().lws_return_http_status(wsi, 426, "this server speaks WebSocket (subprotocol sandboxer.v1) only"))
        return -1;
      return ws_lib().lws_http_transaction_completed(wsi) ? -1 : 0;
    case LWS_CALLBACK_ESTABLISHED: {
      auto owned = std::make_unique<Client>();
      Client* c = owned.get();
      c->id = next_client++;
      c->wsi = wsi;
      char ip[64] = "";
      ws_lib().lws_get_peer_simple(wsi, ip, sizeof ip);
      c->peer = ip;
      auto b = bearer(wsi);
      c->authed = b && token_ok(*b);
      *slot = c;  // lws's slot: not owning (clients owns it)
      clients[c->id] = std::move(owned);
      if (!c->authed) {
        ++unauthenticated;
        ws_lib().lws_set_timeout(wsi, PENDING_TIMEOUT_USER_OK, opts.auth_timeout_s);
      }
      if (draining) close_with(*c, 1001, "box ended");
      log()->debug("client {} connected from {}", c->id, c->peer);
      return 0;
    }
    case LWS_CALLBACK_RECEIVE:
      if (!slot || !*slot) return -1;
      if ((*slot)->close_code) return 0;  // closing: ignore what it still sends
      // Writing may have waited for this read (writeable): go on with it. Only then: asking on
      // every read costs two epoll_ctl calls and a loop turn a frame (an upload's many frames).
      if (std::exchange((*slot)->write_after_read, false)) ws_lib().lws_callback_on_writable(wsi);
      return on_receive(**slot, static_cast<const char*>(in), len);
    case LWS_CALLBACK_WS_PEER_INITIATED_CLOSE:
      // The client is leaving: stop feeding it, so lws can answer its close at once.
      if (slot && *slot) {
        Client& c = **slot;
        c.subscribed = false;
        c.q.clear();
        c.q_bytes = 0;
        c.downloads.clear();
        c.peer_closed = true;
      }
      return 0;
    case LWS_CALLBACK_SERVER_WRITEABLE:
      if (!slot || !*slot) return -1;
      return writeable(**slot);
    case LWS_CALLBACK_CLOSED: {
      if (!slot || !*slot) return 0;
      Client* c = *slot;
      *slot = nullptr;
      if (!c->authed) --unauthenticated;
      log()->debug("client {} gone", c->id);
      clients.erase(c->id);  // frees it: nothing else owns it
      if (draining && clients.empty() && drained) {
        auto d = std::move(drained);
        drained = nullptr;
        d();
      }
      return 0;
    }
    default:
      return ws_lib().lws_callback_http_dummy(wsi, reason, user, in, len);
  }
}

const size_t kFrameHeadroom = LWS_PRE;

ServerOptions parse_listen(const std::string& listen) {
  ServerOptions o;
  auto colon = listen.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument("--listen " + listen + ": expected ADDR:PORT");
  std::string addr = listen.substr(0, colon), port = listen.substr(colon + 1);
  if (addr.starts_with('[') && addr.ends_with(']')) addr = addr.substr(1, addr.size() - 2);
  int p = -1;
  try {
    size_t used = 0;
    p = std::stoi(port, &used);
    if (used != port.size()) p = -1;
  } catch (const std::exception&) {
  }
  if (p < 0 || p > 65535) throw std::invalid_argument("--listen " + listen + ": port must be 0..65535");
  o.addr = addr.empty() ? "0.0.0.0" : addr;
  o.port = p;
  return o;
}

namespace {
// A TCP socket bound to addr:port as libwebsockets binds one (SO_REUSEADDR), or the bind's errno
// (EINVAL: not a numeric address).
os::Result<os::UniqueFd> bound_socket(const std::string& addr, int port) {
  struct addrinfo hints {};
  struct addrinfo* res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  std::string service = std::to_string(port);
  if (::getaddrinfo(addr == "0.0.0.0" ? nullptr : addr.c_str(), service.c_str(), &hints, &res) != 0 || !res)
    return os::sys_error(EINVAL);
  os::UniqueFd s(::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int one = 1, err = 0;
  if (!s)
    err = errno;
  else if (::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
           ::bind(s.get(), res->ai_addr, res->ai_addrlen) != 0)
    err = errno;
  ::freeaddrinfo(res);
  if (err != 0) return os::sys_error(err);
  return s;
}

// A free TCP port on `addr` (lws cannot report the port it bound for 0 reliably across versions).
int pick_port(const std::string& addr) {
  auto s = bound_socket(addr, 0);
  if (!s) return -1;
  struct sockaddr_storage ss {};
  socklen_t sl = sizeof ss;
  if (::getsockname(s->get(), reinterpret_cast<sockaddr*>(&ss), &sl) != 0) return -1;
  return ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

// The errno of a bind to addr:port now; 0 where it works.
int bind_errno(const std::string& addr, int port) {
  auto s = bound_socket(addr, port);
  return s ? 0 : s.error().value();
}

// Ends a context whose libuv glue closes its handles asynchronously: the loop finishes them.
void destroy_context(lws_context*& ctx, uv_loop_t* loop) {
  if (!ctx) return;
  ws_lib().lws_context_destroy(ctx);
  ctx = nullptr;
  for (int i = 0; i < 50; ++i) uv_run(loop, UV_RUN_NOWAIT);
}

// Why libwebsockets could not listen on addr:port: the bind's errno, else its TLS files.
std::string listen_error(const std::string& addr, int port) {
  std::string where = "listen on " + addr + ":" + std::to_string(port) + ": ";
  if (int err = bind_errno(addr, port); err != 0) return where + std::strerror(err);
  return where + "libwebsockets could not make its server (its log above says why; bad TLS files?)";
}

void lws_log_to_spdlog(int level, const char* line) {
  std::string l = line;
  while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
  if (level & LLL_ERR)
    log()->warn("lws: {}", l);
  else
    log()->info("lws: {}", l);
}
}  // namespace

Server::Server(Box& box, uv_loop_t* loop, ServerOptions opts)
    : impl_(std::make_unique<Impl>(box, loop, std::move(opts))) {
  auto& o = impl_->opts;
  if (o.token.empty()) throw std::runtime_error("the server needs a token (--token-file or SANDBOXER_TOKEN)");
  if (o.tls_cert.empty() != o.tls_key.empty()) throw std::runtime_error("--tls-cert and --tls-key go together");
  // libwebsockets reads them by path: a FIFO would hold its open, a directory fail obscurely.
  for (auto [opt, path] : {std::pair{"--tls-cert", &o.tls_cert}, std::pair{"--tls-key", &o.tls_key}}) {
    struct stat st {};
    if (path->empty()) continue;
    if (::stat(path->c_str(), &st) != 0)
      throw std::runtime_error(std::string(opt) + " " + *path + ": " + std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      throw std::runtime_error(std::string(opt) + " " + *path + ": not a regular file (" +
                               os::file_type_name(st.st_mode) + ")");
  }
  if (const auto& lib = libwebsockets(); !lib) throw std::runtime_error(lib.error().message + " (for --listen)");
  int lws_level = LLL_ERR | LLL_WARN;
  if (auto* l = std::getenv("SANDBOXER_LWS_LOG")) lws_level = std::atoi(l);
  ws_lib().lws_set_log_level(lws_level, lws_log_to_spdlog);

  impl_->protocols[0] = {"http", Impl::callback, sizeof(Client*), 0, 0, nullptr, 0};
  impl_->protocols[1] = {protocol::kSubprotocol, Impl::callback, sizeof(Client*), 64 * 1024, 0, nullptr,
                         protocol::kSendBytes};  // one send() per frame (events ~128 KiB, fs.read 256 KiB)
  impl_->protocols[2] = {nullptr, nullptr, 0, 0, 0, nullptr, 0};
  impl_->retry.secs_since_valid_ping = 20;
  impl_->retry.secs_since_valid_hangup = 60;

  int port = o.port;
  if (port == 0) port = pick_port(o.addr);
  if (port <= 0) throw std::runtime_error(listen_error(o.addr, 0));  // not an address of this host

  lws_context_creation_info info{};
  void* loops[] = {loop};
  info.options = LWS_SERVER_OPTION_LIBUV;
  info.foreign_loops = loops;
  info.port = port;
  info.iface = o.addr == "0.0.0.0" ? nullptr : o.addr.c_str();
  info.protocols = impl_->protocols;
  info.user = impl_.get();
  info.retry_and_idle_policy = &impl_->retry;
  info.timeout_secs = 20;
  info.max_http_header_data = 8192;
  info.count_threads = 1;
  info.fd_limit_per_thread = 4096;
  if (!o.tls_cert.empty()) {
    info.options |= LWS_SERVER_OPTION_DO_SSL_GLOBAL_INIT;
    info.ssl_cert_filepath = o.tls_cert.c_str();
    info.ssl_private_key_filepath = o.tls_key.c_str();
  }
  // The vhost (the listening socket) is made on its own: a port another process holds does not
  // fail a context with a default vhost (libwebsockets logs "ERROR on binding" and goes on without
  // it). The box then said it listened, and its clients' tokens went to whoever held the port.
  info.options |= LWS_SERVER_OPTION_EXPLICIT_VHOSTS;
  impl_->ctx = ws_lib().lws_create_context(&info);
  if (!impl_->ctx) throw std::runtime_error(listen_error(o.addr, port));
  lws_vhost* vh = ws_lib().lws_create_vhost(impl_->ctx, &info);
  // A port picked for --listen ADDR:0 that another process took before the bind: another pick.
  for (int again = 0; !vh && o.port == 0 && again < 3 && bind_errno(o.addr, port) == EADDRINUSE; ++again)
    if ((info.port = port = pick_port(o.addr)) > 0) vh = ws_lib().lws_create_vhost(impl_->ctx, &info);
  if (!vh) {
    destroy_context(impl_->ctx, loop);
    throw std::runtime_error(listen_error(o.addr, port));
  }
  int bound = ws_lib().lws_get_vhost_listen_port(vh);
  impl_->port = bound > 0 ? bound : port;
  impl_->stall_timer = loop::make_timer(loop);
  impl_->stall_timer->data = impl_.get();
  uint64_t tick = std::max<uint64_t>(250, static_cast<uint64_t>(o.stall_s) * 250);
  uv_timer_start(
      impl_->stall_timer.get(), [](uv_timer_t* t) { static_cast<Impl*>(t->data)->check_stalls(); }, tick, tick);
  uv_unref(reinterpret_cast<uv_handle_t*>(impl_->stall_timer.get()));
  impl_->listener = box.journal().add_listener([this](const journal::Event& e) { impl_->on_event(e); });
  log()->info("listening on {}:{}{}", o.addr, impl_->port, o.tls_cert.empty() ? "" : " (TLS)");
  box.emit("main",
           {{"type", "server.listening"}, {"addr", o.addr}, {"port", impl_->port}, {"tls", !o.tls_cert.empty()}});
}

Server::~Server() {
  impl_->box.journal().remove_listener(impl_->listener);
  impl_->drain_timer.reset();
  impl_->stall_timer.reset();
  destroy_context(impl_->ctx, impl_->loop);
  // Clients libwebsockets did not close are freed with impl_->clients.
}

int Server::port() const noexcept { return impl_->port; }

void Server::drain(std::function<void()> done) {
  auto& m = *impl_;
  if (m.draining) return;
  m.draining = true;
  if (m.clients.empty()) return done();
  m.drained = std::move(done);
  for (auto& [id, c] : m.clients) {
    c->downloads.clear();
    if (c->subscribed && !c->live) {
      // Let a replaying client finish what is on disk: it is short, or the timer ends it.
    }
    m.close_with(*c, 1001, "box ended");
  }
  // Given up on only when no client has taken anything for 2 s (one that reads goes on getting
  // its events, however busy the machine: a fixed 2 s cut a slow but reading client short), or
  // after 10 s in all.
  m.drain_started_ms = uv_now(m.loop);
  m.drain_timer = loop::make_timer(m.loop);
  m.drain_timer->data = &m;
  uv_timer_start(
      m.drain_timer.get(),
      [](uv_timer_t* t) {
        auto* self = static_cast<Impl*>(t->data);
        uint64_t now = uv_now(self->loop), last = self->drain_started_ms;
        for (auto& [id, c] : self->clients) last = std::max(last, c->progress_ms);
        if (now - last < 2000 && now - self->drain_started_ms < 10000) return;
        uv_timer_stop(t);
        if (self->drained) {
          auto d = std::move(self->drained);
          self->drained = nullptr;
          d();
        }
      },
      250, 250);
}

}  // namespace sbx::supervisor
