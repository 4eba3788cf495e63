#include "cli/relay.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <sandboxer/beast.hpp>
#include <thread>

#include "archive/archive.hpp"
#include "base/encoding.hpp"
#include "cli/session.hpp"
#include "cli/tokens.hpp"
#include "loop/uv-handle.hpp"
#include "os/sys.hpp"
#include "protocol/protocol.hpp"

namespace sbx::cli {

namespace json = boost::json;
namespace asio = sdk::asio;
namespace beast = sdk::beast;

namespace {

constexpr size_t kChunk = 1 << 20;  // bytes per binary frame to a target
constexpr size_t kReadMax = 4 * kChunk + protocol::kBinaryHeader;
constexpr uint32_t kRequestId = 1;  // one request per connection: the export's, or an import's
constexpr auto kCloseLimit = std::chrono::seconds(2);
constexpr const char* kPending = "pending";

// One WebSocket connection to a box over Beast, plain or TLS; `cancel` ends what is pending on it.
struct Conn {
  sdk::WsTarget where;
  std::unique_ptr<sdk::WsStream> ws;
  void cancel() {
    if (ws) ws->cancel();
  }
  /// The socket, at its coroutine's end: the box learns at once that the connection is over.
  void close() {
    if (ws) ws->close_socket();
  }
};

struct Target {
  explicit Target(asio::io_context& io) : wake(io), writer_end(io) {}
  sdk::Endpoint ep;
  Conn conn;
  asio::steady_timer wake;        // cancelled when there is more to send, or the target is finished
  asio::steady_timer writer_end;  // cancelled when its writer ends
  bool writing = false, finished = false;
  uint64_t sent = 0;
  base::Result<json::object> result = base::fail("not started", kPending);
};

// Sleeps until `timer` is cancelled (or a minute has passed: the caller looks again either way).
asio::awaitable<void> wait_on(asio::steady_timer& timer) {
  timer.expires_after(std::chrono::minutes(1));
  boost::system::error_code ec;
  co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
}

}  // namespace

// Everything below but the constructor, start(), add_target(), seal() and abort() (which post to
// it) and the wake-up callback runs on the relay's own thread, which runs `io`: Beast reads a
// frame's payload in bulk, where libwebsockets' client (sdk/cpp's Client, on the CLI's libuv loop)
// parsed a byte at a time (beast.hpp). The outcome reaches the CLI's loop through `wake`.
struct Relay::Impl {
  asio::io_context io;  // first: destroyed after every connection
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread thread;
  Relay* self = nullptr;
  loop::UvHandle<uv_async_t> wake;
  sdk::Endpoint source_ep;
  std::string snapshot, spool_path;
  DeltaPlan plan;
  os::UniqueFd spool;
  Conn source;
  uint64_t size = 0, received = 0;
  int live = 0;  // connections whose coroutine has not ended
  bool have_reply = false, complete = false, source_finished = false, sealed = false, notified = false;
  json::object export_reply;
  base::Result<json::object> source_result = base::fail("not started", kPending);
  std::vector<std::unique_ptr<Target>> targets;
  size_t added = 0;  // targets added, counted on the CLI's side

  // The outcome, copied under the lock when it is complete; read on the CLI's side after done.
  std::mutex mu;
  bool done = false;
  base::Result<json::object> final_source = base::fail("not started", kPending);
  std::vector<base::Result<json::object>> final_targets;
  uint64_t final_size = 0;

  ~Impl() {
    work.reset();
    io.stop();
    if (thread.joinable()) thread.join();
    if (spool) ::unlink(spool_path.c_str());
  }

  template <class Body>
  void spawn(Conn& c, Body body);
  asio::awaitable<void> run_source(sdk::WsStream& ws);
  void on_source_text(std::string_view text);
  void on_source_frame(std::string_view frame);
  void fail_source(const std::string& why, const std::string& code);
  void add(sdk::Endpoint ep);
  asio::awaitable<void> run_target(Target& t, sdk::WsStream& ws);
  asio::awaitable<void> read_reply(Target& t, sdk::WsStream& ws);
  asio::awaitable<void> write_archive(Target& t, sdk::WsStream& ws);
  void wake_targets();
  void finish(Target& t, base::Result<json::object> r, bool cut);
  void check_done();
};

// Opens `c` (TLS for wss) and runs `body(ws)` on it; its end is counted in `live`.
template <class Body>
void Relay::Impl::spawn(Conn& c, Body body) {
  auto ended = [this, &c](std::exception_ptr) {
    c.close();
    --live;
    check_done();
  };
  c.ws = std::make_unique<sdk::WsStream>(io, c.where);  // throws where the system's CAs cannot be read
  ++live;
  asio::co_spawn(io, body(*c.ws), ended);
}

asio::awaitable<void> Relay::Impl::run_source(sdk::WsStream& ws) {
  if (auto why = co_await ws.open_or_reason(kReadMax); !why.empty()) {
    fail_source("connect to " + source_ep.url + ": " + why, "connect");
    co_return;
  }
  try {
    json::object req{{"op", "snapshot.export"}, {"snapshot", snapshot}, {"id", kRequestId}};
    if (!plan.base.empty()) req["base"] = plan.base;
    if (!plan.lacks.empty()) req["lacks"] = base::base64_encode(plan.lacks);
    co_await ws.write(asio::buffer(json::serialize(req)), false);
    beast::flat_buffer buf;
    while (!source_finished) {
      buf.clear();
      co_await ws.read(buf);
      std::string_view m(static_cast<const char*>(buf.data().data()), buf.size());
      if (ws.got_text())
        on_source_text(m);
      else
        on_source_frame(m);
    }
  } catch (const boost::system::system_error& e) {
    fail_source("the connection to " + source_ep.url + " closed after " + std::to_string(received) + " of " +
                    (have_reply ? std::to_string(size) : std::string("?")) + " bytes: " + ws.close_reason(e.code()),
                "closed");
  }
  co_await ws.close(kCloseLimit);
}

void Relay::Impl::on_source_text(std::string_view text) {
  auto rep = sdk::reply_for(text, kRequestId);
  if (!rep || have_reply || source_finished) return;
  if (!sdk::reply_says_ok(*rep)) {
    auto e = reply_error(*rep);
    return fail_source(e.message, e.code);
  }
  auto* n = rep->if_contains("size");
  if (!n || !n->is_number() || n->to_number<int64_t>() <= 0)
    return fail_source("snapshot.export's reply names no size", "bad_reply");
  size = n->to_number<uint64_t>();
  export_reply = std::move(*rep);
  have_reply = true;
  wake_targets();
}

void Relay::Impl::fail_source(const std::string& why, const std::string& code) {
  if (source_finished) return;
  source_finished = true;
  source_result = base::fail(why, code);
  source.cancel();
  // No target gets the frame that would end its upload: each box drops what it received.
  for (auto& t : targets)
    if (!t->finished) finish(*t, base::fail("the archive did not arrive whole: " + why, kSourceFailed), true);
  check_done();
}

void Relay::Impl::on_source_frame(std::string_view frame) {
  auto head = protocol::get_header(frame);
  if (source_finished || (head && head->id != kRequestId)) return;
  if (!head) return fail_source("a binary frame of " + std::to_string(frame.size()) + " bytes", "bad_frame");
  if (!have_reply) return fail_source("archive bytes before snapshot.export's reply", "bad_reply");
  auto data = frame.substr(protocol::kBinaryHeader);
  if (head->offset != received)
    return fail_source(
        "a frame at byte " + std::to_string(head->offset) + " where byte " + std::to_string(received) + " was due",
        "bad_frame");
  if (received + data.size() > size)
    return fail_source(
        "a frame reaches byte " + std::to_string(received + data.size()) + " of an archive of " + std::to_string(size),
        "bad_frame");
  if (auto w = os::write_all(spool.get(), data); !w)  // in order: offset == received
    return fail_source("write " + spool_path + ": " + w.error().message(), "local");
  received += data.size();
  if (head->last()) {
    if (received != size)
      return fail_source("the export ended at byte " + std::to_string(received) + " of " + std::to_string(size),
                         "bad_frame");
    // Nothing is imported that does not name its id: the hash of its manifest, which each target
    // checks every entry against as it imports (a format-2 archive's own hash). A delta is no
    // archive: each target checks the manifest its chunks begin with.
    if (!plan.delta()) {
      auto manifest = archive::read_manifest(spool_path);
      if (!manifest) return fail_source("the archive received is refused: " + manifest.error().message, "bad_snapshot");
      // Only a format-2 archive is hashed whole, once it is here: a format-3 one needs no pass.
      auto named = archive::named_by_manifest(manifest->format_version)
                       ? base::Result<std::string>(manifest->manifest_sha256)
                       : archive::sha256_file(spool_path);
      if (!named) return fail_source("read " + spool_path + ": " + named.error().message, "local");
      if (archive::snapshot_id_of(*named) != snapshot)
        return fail_source(
            "the archive received names snapshot " + archive::snapshot_id_of(*named) + ", not " + snapshot,
            "bad_snapshot");
    }
    complete = true;
    source_finished = true;
    source_result = export_reply;
  }
  wake_targets();
  check_done();
}

void Relay::Impl::add(sdk::Endpoint ep) {
  auto owned = std::make_unique<Target>(io);
  Target& t = *owned;
  targets.push_back(std::move(owned));
  t.ep = std::move(ep);
  if (source_finished && !complete)
    return finish(t, base::fail("the archive did not arrive whole: " + source_result.error().message, kSourceFailed),
                  false);
  try {
    t.conn.where = sdk::ws_target(t.ep);
    spawn(t.conn, [this, &t](sdk::WsStream& ws) { return run_target(t, ws); });
  } catch (const std::exception& e) {
    finish(t, base::fail("connect to " + t.ep.url + ": " + e.what(), "connect"), false);
  }
}

// A target: its connection, snapshot.import once the export's reply names the size, the archive
// as it arrives (write_archive), and the import's reply (read_reply).
asio::awaitable<void> Relay::Impl::run_target(Target& t, sdk::WsStream& ws) {
  if (auto why = co_await ws.open_or_reason(kReadMax); !why.empty()) {
    finish(t, base::fail("connect to " + t.ep.url + ": " + why, "connect"), false);
    co_return;
  }
  while (!have_reply && !t.finished) co_await wait_on(t.wake);
  if (!t.finished) {
    try {
      json::object req{{"op", "snapshot.import"}, {"size", size}, {"id", kRequestId}};
      co_await ws.write(asio::buffer(json::serialize(req)), false);
      t.writing = true;
      asio::co_spawn(io, write_archive(t, ws), [&t](std::exception_ptr) {
        t.writing = false;
        t.writer_end.cancel();
      });
      co_await read_reply(t, ws);
    } catch (const boost::system::system_error& e) {
      finish(t, base::fail("the connection to " + t.ep.url + " closed first: " + ws.close_reason(e.code()), "closed"),
             false);
    }
  }
  // A frame being written when the reply came ends by itself (the writer stops after it); where it
  // has not within the limit (a box no longer reading), the socket is cancelled.
  for (int round = 0; round < 2 && t.writing; ++round) {
    if (round == 1) t.conn.cancel();
    t.writer_end.expires_after(kCloseLimit);
    boost::system::error_code ec;
    co_await t.writer_end.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  if (!t.writing) co_await ws.close(kCloseLimit);
}

asio::awaitable<void> Relay::Impl::read_reply(Target& t, sdk::WsStream& ws) {
  beast::flat_buffer buf;
  while (!t.finished) {
    buf.clear();
    co_await ws.read(buf);
    if (!ws.got_text()) continue;
    auto rep = sdk::reply_for(std::string_view(static_cast<const char*>(buf.data().data()), buf.size()), kRequestId);
    if (!rep) continue;
    if (sdk::reply_says_ok(*rep))
      finish(t, std::move(*rep), false);
    else
      finish(t, reply_error(*rep), false);
  }
}

// What has arrived of the archive, in frames of at most kChunk from the spool, as fast as the
// target takes them; the frame that ends the upload only once the archive is whole and hashes to
// its id. Stops once the target is finished.
asio::awaitable<void> Relay::Impl::write_archive(Target& t, sdk::WsStream& ws) {
  std::string frame;
  ws.write_buffer_bytes(256 * 1024);  // masked a word at a time, a quarter of a frame per send
  while (!t.finished) {
    if (t.sent == received && !(complete && t.sent == size)) {
      co_await wait_on(t.wake);
      continue;
    }
    auto n = static_cast<size_t>(std::min<uint64_t>(kChunk, received - t.sent));
    bool last = complete && t.sent + n == size;
    frame.clear();
    protocol::put_header(frame, {.id = kRequestId, .offset = t.sent, .flags = last ? protocol::kFlagLast : uint8_t{0}});
    frame.resize(protocol::kBinaryHeader + n);
    ssize_t got = n ? ::pread(spool.get(), frame.data() + protocol::kBinaryHeader, n, static_cast<off_t>(t.sent)) : 0;
    if (got != static_cast<ssize_t>(n)) {
      auto why = got < 0 ? os::last_error().message() : std::string("the file shrank");
      co_return finish(t, base::fail("read " + spool_path + ": " + why, "local"), true);
    }
    co_await ws.write(asio::buffer(frame), true);
    t.sent += n;
    if (last) co_return;
  }
}

void Relay::Impl::wake_targets() {
  for (auto& t : targets) t->wake.cancel();
}

// `cut`: end its connection now (the reader and writer waiting on it end); a reply read, or a
// connection that failed, ends it by itself.
void Relay::Impl::finish(Target& t, base::Result<json::object> r, bool cut) {
  if (t.finished) return;
  t.finished = true;
  t.result = std::move(r);
  t.wake.cancel();
  if (cut) t.conn.cancel();
  check_done();
}

void Relay::Impl::check_done() {
  if (!sealed || notified) return;
  bool targets_done = std::all_of(targets.begin(), targets.end(), [](auto& t) { return t->finished; });
  if (!targets_done) return;
  // Every target has failed: the rest of the archive has nowhere to go.
  if (!source_finished) return fail_source("no target left to send it to", kNoTarget);
  if (live > 0) return;  // each connection closes first, 2 s at most
  notified = true;
  {
    std::lock_guard lock(mu);
    final_source = source_result;
    for (auto& t : targets) final_targets.push_back(t->result);
    final_size = size;
  }
  uv_async_send(wake.get());
}

Relay::Relay(uv_loop_t* loop, sdk::Endpoint source, std::string snapshot, DeltaPlan plan)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.self = this;
  m.source_ep = std::move(source);
  m.snapshot = std::move(snapshot);
  m.plan = std::move(plan);
  auto wake = loop::UvHandle<uv_async_t>::make(loop, uv_async_init, [](uv_async_t* h) {
    auto& m = *static_cast<Impl*>(h->data);
    {
      std::lock_guard lock(m.mu);
      m.done = true;
    }
    uv_unref(reinterpret_cast<uv_handle_t*>(h));
    if (m.self->on_done_) m.self->on_done_();
  });
  if (!wake) throw std::runtime_error(wake.error().message);
  m.wake = std::move(*wake);
  m.wake->data = &m;
}

Relay::~Relay() = default;

base::Result<void> Relay::start() {
  auto& m = *impl_;
  std::string home;
  try {
    home = state_home();
    m.source.where = sdk::ws_target(m.source_ep);
  } catch (const std::exception& e) {
    return base::fail(e.what(), "local");
  }
  if (auto r = os::make_dirs(home, 0700); !r) return base::fail("create " + home + ": " + r.error().message(), "local");
  m.spool_path = home + "/.spool-" + os::random_hex(4) + "-" + m.snapshot + (m.plan.delta() ? ".delta" : ".tar.zst");
  m.spool.reset(::open(m.spool_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!m.spool) return base::fail(m.spool_path + ": " + os::last_error().message(), "local");
  m.work.emplace(m.io.get_executor());
  asio::post(m.io, [&m] {
    try {
      m.spawn(m.source, [&m](auto& ws) { return m.run_source(ws); });
    } catch (const std::exception& e) {
      m.fail_source("connect to " + m.source_ep.url + ": " + e.what(), "connect");
    }
  });
  m.thread = std::thread([&m] { m.io.run(); });
  return {};
}

size_t Relay::add_target(sdk::Endpoint ep) {
  auto& m = *impl_;
  asio::post(m.io, [&m, ep = std::move(ep)]() mutable { m.add(std::move(ep)); });
  return m.added++;
}

void Relay::seal() {
  auto& m = *impl_;
  asio::post(m.io, [&m] {
    m.sealed = true;
    m.check_done();
  });
}

void Relay::abort(const std::string& why) {
  auto& m = *impl_;
  asio::post(m.io, [&m, why] {
    // The source first: its failure is the one told (targets that had all of it say so too).
    m.fail_source(why, "interrupted");
    for (auto& t : m.targets)
      if (!t->finished) m.finish(*t, base::fail(why, "interrupted"), true);
    m.sealed = true;
    m.check_done();
  });
}

bool Relay::done() const {
  std::lock_guard lock(impl_->mu);
  return impl_->done;
}

const base::Result<json::object>& Relay::source() const { return impl_->final_source; }

std::vector<base::Result<json::object>> Relay::targets() const { return impl_->final_targets; }

uint64_t Relay::size() const { return impl_->final_size; }

namespace {
// Snapshot id -> its entry in a box's snapshot.list; nullopt when the list fails.
using Listing = std::map<std::string, json::object>;
std::optional<Listing> snapshots_of(Session& s, const sdk::Endpoint& box) {
  auto r = s.call_to(box, {{"op", "snapshot.list"}});
  if (!r) return std::nullopt;
  Listing out;
  auto* list = r->if_contains("snapshots");
  if (!list || !list->is_array()) return std::nullopt;
  for (auto& v : list->as_array()) {
    auto* m = v.if_object();
    auto* id = m ? m->if_contains("id") : nullptr;
    if (id && id->is_string()) out[std::string(id->as_string())] = *m;
  }
  return out;
}

std::string str_of(const json::object& o, const char* key) {
  auto* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : std::string();
}

// The newest snapshot of the source (`mine`, its listing) other than `snap` that every target
// has, "" when there is none or a list fails.
std::string common_base(Session& s, Listing mine, const std::vector<sdk::Endpoint>& targets, const std::string& snap) {
  mine.erase(snap);
  for (auto& t : targets) {
    auto theirs = snapshots_of(s, t);
    if (!theirs) return {};
    std::erase_if(mine, [&](auto& kv) { return !theirs->contains(kv.first); });
  }
  // The newest shares the most with `snap`, as a rule: a box's snapshots follow one agent.
  auto best = std::max_element(mine.begin(), mine.end(), [](auto& a, auto& b) {
    return str_of(a.second, "created") < str_of(b.second, "created");
  });
  return best == mine.end() ? std::string() : best->first;
}

// One page of snapshot.chunks (from the source) and each target's snapshot.lacks for it, ORed into
// `bits` (sized from the first page's "chunks"). The next page's from, 0 at the end, or why not.
base::Result<uint64_t> negotiate_page(Session& s, const std::vector<sdk::Endpoint>& targets, const std::string& snap,
                                      uint64_t from, std::string& bits, uint64_t& total) {
  auto page = s.call({{"op", "snapshot.chunks"}, {"snapshot", snap}, {"from", from}});
  if (!page) return page.error();
  auto num = [](const json::object& o, const char* k) -> std::optional<uint64_t> {
    auto* v = o.if_contains(k);
    boost::system::error_code ec;
    uint64_t n = v ? v->to_number<uint64_t>(ec) : 0;
    return v && !ec ? std::optional<uint64_t>(n) : std::nullopt;
  };
  auto n = num(*page, "chunks"), count = num(*page, "count"), at = num(*page, "from");
  auto* hashes = page->if_contains("hashes");
  if (!n || !count || at != from || !hashes || !hashes->is_string() || from + *count > *n || (*count == 0 && *n > from))
    return base::fail("snapshot.chunks answered " + json::serialize(*page), "bad_reply");
  if (bits.empty()) {
    total = *n;
    bits.assign((total + 7) / 8, '\0');
  } else if (*n != total) {
    return base::fail("snapshot.chunks changed its count", "bad_reply");
  }
  for (auto& t : targets) {
    auto r = s.call_to(t, {{"op", "snapshot.lacks"}, {"hashes", hashes->as_string()}});
    if (!r) return r.error();
    std::string got;
    auto* l = r->if_contains("lacks");
    if (!l || !l->is_string() || !base::base64_decode(l->as_string(), got) || got.size() != (*count + 7) / 8)
      return base::fail(t.url + ": snapshot.lacks answered " + json::serialize(*r), "bad_reply");
    for (uint64_t i = 0; i < *count; ++i)
      if ((static_cast<unsigned char>(got[i / 8]) >> (i % 8)) & 1)
        bits[(from + i) / 8] = static_cast<char>(bits[(from + i) / 8] | (1 << ((from + i) % 8)));
  }
  auto* next = page->if_contains("next");
  auto nx = next && !next->is_null() ? num(*page, "next") : std::optional<uint64_t>(0);
  if (!nx || (*nx != 0 && *nx != from + *count)) return base::fail("snapshot.chunks answered a bad next", "bad_reply");
  return *nx;
}
}  // namespace

std::string DeltaPlan::describe() const {
  if (!base.empty()) return ", a delta against " + base;
  if (!lacks.empty())
    return ", a delta of the " + std::to_string(lacking) + " of " + std::to_string(chunks) + " chunks the targets lack";
  return {};
}

DeltaPlan plan_delta(Session& s, const std::vector<sdk::Endpoint>& targets, const std::string& snap) {
  if (targets.empty()) return {};
  auto mine = snapshots_of(s, s.endpoint());
  if (!mine) return {};
  // Kept in the source's chunk store (its listing's archive.stored), the snapshot's archive would
  // be compressed anew from the chunks, while a delta of them all is their files as they are.
  bool chunked = false;
  if (auto it = mine->find(snap); it != mine->end())
    if (auto* a = it->second.if_contains("archive"); a && a->is_object())
      chunked = str_of(a->as_object(), "stored") == "chunks";
  // A box with no snapshot has no chunk: nothing to ask it, unless the snapshot is kept as chunks.
  if (!chunked)
    for (auto& t : targets)
      if (auto l = snapshots_of(s, t); !l || l->empty()) return {};
  std::string bits;
  uint64_t total = 0;
  for (uint64_t from = 0;;) {
    auto next = negotiate_page(s, targets, snap, from, bits, total);
    if (!next) {
      // A box from before snapshot.lacks: a delta against a snapshot they all have, if any. (Any
      // other failure shows where it matters: the export, or that target's import.)
      return {.base = common_base(s, std::move(*mine), targets, snap)};
    }
    if (*next == 0) break;
    from = *next;
  }
  uint64_t lacking = 0;
  for (char c : bits) lacking += static_cast<uint64_t>(__builtin_popcount(static_cast<unsigned char>(c)));
  if (lacking == total && !chunked) return {};  // they have none of it: the archive itself
  return {.lacks = std::move(bits), .chunks = total, .lacking = lacking};
}

}  // namespace sbx::cli
