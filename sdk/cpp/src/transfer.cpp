#include "sandboxer/transfer.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "protocol/protocol.hpp"
#include "sandboxer/beast.hpp"

namespace sbx::sdk {

namespace {

namespace json = boost::json;

constexpr size_t kChunk = 1 << 20;                   // an upload's frames, as the CLI's client sent them
constexpr size_t kHeader = protocol::kBinaryHeader;  // u32 id, u64 offset, u8 flags (1: last)

uint32_t request_id(json::object& req) {
  if (auto* v = req.if_contains("id"); v && v->is_int64() && v->as_int64() >= 0 && v->as_int64() <= 0xffffffffLL)
    return static_cast<uint32_t>(v->as_int64());
  req["id"] = 1;
  return 1;
}

std::optional<uint64_t> uint_field(const json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  if (v && v->is_int64() && v->as_int64() >= 0) return static_cast<uint64_t>(v->as_int64());
  if (v && v->is_uint64()) return v->as_uint64();
  return std::nullopt;
}

// Transfers in turn on one connection: each one's request, its frames and its reply before the
// next one's request. The first that does not end with an ok reply ends the run.
class Run {
 public:
  Run(asio::io_context& io, std::vector<FileTransfer> ts) : io_(io), ts_(std::move(ts)), tick_(io) {}

  std::vector<base::Result<json::object>>& results() { return results_; }

  asio::awaitable<void> run(WsStream& ws) {
    cancel_ = [&ws] { ws.cancel(); };
    begin(0);
    if (co_await open(ws)) {
      ws.write_buffer_bytes(256 * 1024);  // masked a word at a time, a quarter of a frame per send
      bool usable = true;
      for (size_t i = 0; i < ts_.size() && usable; ++i) {
        begin(i);
        try {
          co_await ws.write(asio::buffer(json::serialize(t_->request)), false);
          if (t_->upload) {
            writing_ = true;
            asio::co_spawn(io_, send_file(ws), [this](std::exception_ptr) { writer_done(); });
          }
          co_await receive(ws);
        } catch (const boost::system::system_error& e) {
          finish(base::fail("the connection closed first: " + ws.close_reason(e.code()), "closed"));
          usable = false;
        }
        if (writing_) co_await wait_for_writer();
        usable = usable && !writing_ && result_ && reply_says_ok(*result_);
        results_.push_back(std::move(result_));
      }
      all_done_ = true;
      if (!writing_) co_await ws.close(std::chrono::seconds(2));
    } else {
      results_.push_back(std::move(result_));
    }
    all_done_ = true;
    // The end, whatever is still pending: Beast's handshake timer outlives a refused upgrade
    // (30 s), and the watcher waits for its tick.
    io_.stop();
  }

  /// Every 100 ms: ends the transfer when the caller says it is interrupted.
  asio::awaitable<void> watch() {
    while (!all_done_) {
      tick_.expires_after(std::chrono::milliseconds(100));
      boost::system::error_code ec;
      co_await tick_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      if (!done_ && t_->interrupted && t_->interrupted()) {
        finish(base::fail("interrupted", "interrupted"));
        if (cancel_) cancel_();
      }
    }
  }

 private:
  // Transfer i is the current one: its id (i + 1 unless its request has one) and a result that
  // says the connection closed until something else does.
  void begin(size_t i) {
    t_ = &ts_[i];
    if (!t_->request.contains("id")) t_->request["id"] = static_cast<int64_t>(i + 1);
    id_ = request_id(t_->request);
    done_ = false;
    result_ = base::fail("the connection closed before the transfer ended", "closed");
  }

  void finish(base::Result<json::object> r) {
    if (done_) return;
    done_ = true;
    result_ = std::move(r);
  }

  void writer_done() {
    writing_ = false;
    writer_end_.cancel();
  }

  // An upload's frame being written when the reply came (an early error, or the last frame's
  // completion not yet run): it ends by itself, as the writer stops after it; where it has not
  // within 2 s (a box no longer reading), the socket is cancelled, and it ends then.
  asio::awaitable<void> wait_for_writer() {
    for (int round = 0; round < 2 && writing_; ++round) {
      if (round == 1 && cancel_) cancel_();
      writer_end_.expires_after(std::chrono::seconds(2));
      boost::system::error_code ec;
      co_await writer_end_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
  }

  asio::awaitable<bool> open(WsStream& ws) {
    auto why = co_await ws.open_or_reason(4 * kChunk);
    if (!why.empty()) finish(base::fail(why, "connect"));
    co_return why.empty();
  }

  // Reads until the transfer's end: a download's reply, then its frames written at their offsets,
  // in order from the request's offset and as many bytes as the reply says (`length`, else
  // `size`); an upload's reply.
  asio::awaitable<void> receive(WsStream& ws) {
    beast::flat_buffer buf;
    json::object reply;
    bool replied = false;
    uint64_t next = uint_field(t_->request, "offset").value_or(0);
    std::optional<uint64_t> end;  // just past the last byte the reply says will come
    while (!done_) {
      buf.clear();
      co_await ws.read(buf);
      auto data = static_cast<const char*>(buf.data().data());
      std::string_view m(data, buf.size());
      if (ws.got_text()) {
        auto rep = reply_for(m, id_);
        if (!rep) continue;  // an event
        auto& o = *rep;
        if (t_->upload || !reply_says_ok(o)) {
          finish(o);
        } else if (t_->fd = t_->open_sink ? t_->open_sink() : -1; t_->fd < 0) {
          finish(base::fail(std::string("open: ") + std::strerror(errno), "local"));
        } else {
          reply = o;  // the file's frames follow
          replied = true;
          if (auto n = uint_field(o, "length") ? uint_field(o, "length") : uint_field(o, "size")) end = next + *n;
        }
        continue;
      }
      auto head = protocol::get_header(m);
      if (t_->upload || !head || head->id != id_) continue;
      uint64_t off = head->offset;
      if (!replied) {
        finish(base::fail("a file frame came before the reply to the request", "protocol"));
        break;
      }
      auto body = m.substr(kHeader);
      bool last = head->last();
      std::string bad;
      if (off != next)
        bad = "a frame at byte " + std::to_string(off) + " where byte " + std::to_string(next) + " was due";
      else if (end && (off + body.size() > *end || (last && off + body.size() != *end)))
        bad = "the frames " + std::string(last ? "end" : "reach") + " at byte " + std::to_string(off + body.size()) +
              " of " + std::to_string(*end) + " the reply named";
      if (!bad.empty()) {
        finish(base::fail(bad, "protocol"));
        break;
      }
      next = off + body.size();
      if (::pwrite(t_->fd, body.data(), body.size(), static_cast<off_t>(off)) != static_cast<ssize_t>(body.size())) {
        finish(base::fail(std::string("write: ") + std::strerror(errno), "local"));
        break;
      }
      if (last) finish(reply);
    }
  }

  // An upload's content: frames of at most kChunk after the request, the last one flagged (an
  // empty file: one empty last frame). Stops once the transfer has ended (an early reply).
  asio::awaitable<void> send_file(WsStream& ws) {
    std::string frame;
    uint64_t sent = 0;
    do {
      size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, t_->size - sent));
      frame.clear();
      protocol::put_header(
          frame, {.id = id_, .offset = sent, .flags = sent + n >= t_->size ? protocol::kFlagLast : uint8_t{0}});
      frame.resize(kHeader + n);
      ssize_t got = n ? ::pread(t_->fd, frame.data() + kHeader, n, static_cast<off_t>(sent)) : 0;
      if (got != static_cast<ssize_t>(n)) {
        finish(base::fail(got < 0 ? std::string("read: ") + std::strerror(errno) : "read: the file shrank", "local"));
        if (cancel_) cancel_();
        co_return;
      }
      co_await ws.write(asio::buffer(frame), true);
      sent += n;
    } while (sent < t_->size && !done_);
  }

  asio::io_context& io_;
  std::vector<FileTransfer> ts_;
  FileTransfer* t_ = nullptr;
  uint32_t id_ = 0;
  asio::steady_timer tick_;
  asio::steady_timer writer_end_{io_};
  std::function<void()> cancel_;
  base::Result<json::object> result_ = base::fail("the connection closed before the transfer ended", "closed");
  std::vector<base::Result<json::object>> results_;
  bool done_ = false;
  bool all_done_ = false;
  bool writing_ = false;
};

// The run on a new stream to `target`, which lives in this coroutine; its TLS context's exception
// (the system's CAs unreadable) comes out of it.
asio::awaitable<void> run_on_new_stream(asio::io_context& io, WsTarget target, Run& run) {
  WsStream ws(io, std::move(target));
  co_await run.run(ws);
}

}  // namespace

std::optional<json::object> reply_for(std::string_view text, uint32_t id) {
  boost::system::error_code ec;
  auto v = json::parse(text, ec);
  if (ec || !v.is_object()) return std::nullopt;
  auto* got = v.as_object().if_contains("id");
  if (!got || !(got->is_null() || (got->is_int64() && got->as_int64() == id))) return std::nullopt;
  return std::move(v.as_object());
}

bool reply_says_ok(const json::object& reply) {
  auto* ok = reply.if_contains("ok");
  return ok && ok->is_bool() && ok->as_bool();
}

std::vector<base::Result<json::object>> transfer_files(std::vector<FileTransfer> ts) {
  if (ts.empty()) return {};
  WsTarget target;
  try {
    target = ws_target(ts.front().box);
  } catch (const std::exception& e) {
    return {base::fail(e.what(), "connect")};
  }
  asio::io_context io;
  Run run(io, std::move(ts));
  // configure_tls's exception (the system's CAs unreadable) ends the run at once, before the
  // watcher's next tick (which waits for a result that would never come), and is thrown to our
  // caller.
  std::exception_ptr failed;
  asio::co_spawn(io, run_on_new_stream(io, target, run), [&failed, &io](std::exception_ptr e) {
    if (!e) return;
    failed = e;
    io.stop();
  });
  asio::co_spawn(io, run.watch(), asio::detached);
  io.run();
  if (failed) std::rethrow_exception(failed);
  return std::move(run.results());
}

base::Result<json::object> transfer_file(FileTransfer t) {
  std::vector<FileTransfer> one;
  one.push_back(std::move(t));
  auto r = transfer_files(std::move(one));
  return r.empty() ? base::fail("the connection closed before the transfer ended", "closed") : std::move(r.front());
}

}  // namespace sbx::sdk
