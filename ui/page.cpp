// The page's WebSocket (ui/hub.hpp): sandboxer.v1 requests answered from the events this process
// keeps, or relayed to the box on a connection of the page's own.
#include <algorithm>
#include <boost/json.hpp>
#include <cstdint>
#include <optional>

#include "protocol/protocol.hpp"
#include "ui/hub.hpp"

namespace sbx::ui {

namespace {

namespace json = boost::json;

// What the page may ask of the box: the actions the CLI has, and its files (the page's file
// panel: listing, reading, uploading, a new directory, renaming, deleting). Everything else (auth,
// snapshot.export/import) stays with the CLI's own subcommands.
constexpr std::string_view kRelayed[] = {
    "exec",    "stdin",         "signal",   "resize",    "stats",           "checkpoint", "fork",
    "restore", "snapshot.list", "shutdown", "ping",      "snapshot.delete", "fs.list",    "fs.stat",
    "fs.read", "fs.write",      "fs.mkdir", "fs.remove", "fs.rename"};

// An fs.read relayed for the page names its length, at most this: the CLI holds what the box
// sends until the page has read it.
constexpr uint64_t kMaxPageRead = 4u << 20;

// An fs.write whose content the page sends in binary frames carries at most this, one at a time:
// the CLI holds what the page sends until the box has taken it.
constexpr uint64_t kMaxPageWrite = 16u << 20;

// A request id as a binary frame's header carries it: an integer in [0, 2^32), as fs.read's must be.
std::optional<uint32_t> frame_id(const json::value& id) {
  if (!id.is_int64() || id.as_int64() < 0 || id.as_int64() > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(id.as_int64());
}

constexpr size_t kMaxRange = 2000;

std::string str(const json::object& o, std::string_view key) {
  auto it = o.find(key);
  return it != o.end() && it->value().is_string() ? std::string(it->value().as_string()) : std::string();
}

uint64_t num(const json::object& o, std::string_view key, uint64_t dflt) {
  auto it = o.find(key);
  if (it == o.end()) return dflt;
  if (it->value().is_int64() && it->value().as_int64() >= 0) return static_cast<uint64_t>(it->value().as_int64());
  if (it->value().is_uint64()) return it->value().as_uint64();
  return dflt;
}

Filter filter_of(const json::object& req) {
  Filter f{.branch = str(req, "branch"), .proc = str(req, "proc")};
  if (auto it = req.find("types"); it != req.end() && it->value().is_array())
    for (const auto& t : it->value().as_array())
      if (t.is_string() && !t.as_string().empty()) f.types.emplace_back(t.as_string());
  return f;
}

}  // namespace

PageSession::PageSession(std::shared_ptr<Hub> hub, beast::tcp_stream stream)
    : hub_(std::move(hub)), ws_(std::move(stream)), wake_(hub_->io) {
  hub_->pages.insert(this);
}

PageSession::~PageSession() {
  hub_->pages.erase(this);
  if (link_) link_->close();
}

asio::awaitable<void> PageSession::run(http::request<http::string_body> req) {
  auto self = shared_from_this();
  try {
    ws_.set_option(websocket::stream_base::timeout::suggested(beast::role_type::server));
    ws_.set_option(websocket::stream_base::decorator(
        [](websocket::response_type& res) { res.set(http::field::sec_websocket_protocol, "sandboxer.v1"); }));
    ws_.read_message_max(1u << 20);
    co_await ws_.async_accept(req, asio::use_awaitable);
    asio::co_spawn(
        hub_->io, [self]() { return self->write_loop(); }, asio::detached);
    beast::flat_buffer buf;
    for (;;) {
      co_await ws_.async_read(buf, asio::use_awaitable);
      if (ws_.got_text())
        handle(beast::buffers_to_string(buf.data()));
      else
        from_page_binary(beast::buffers_to_string(buf.data()));
      buf.consume(buf.size());
    }
  } catch (const std::exception&) {
    // The page went away (or sent what the WebSocket layer refuses): only this session ends.
  }
  closed_ = true;
  wake_.cancel();
  if (link_) link_->close();
}

asio::awaitable<void> PageSession::write_loop() {
  auto self = shared_from_this();
  try {
    co_await write_frames(ws_, out_, wake_, closed_, [this] { pump(); });
  } catch (const std::exception&) {
    closed_ = true;
    beast::get_lowest_layer(ws_).cancel();
  }
}

void PageSession::queue(std::string frame, bool binary) {
  if (closed_) return;
  out_.push_back({std::move(frame), binary});
  wake_.cancel();
}

void PageSession::pump() {
  if (!subscribed_ || closed_) return;
  const auto& store = hub_->store;
  bool added = false;
  while (cursor_ < store.size() && out_.size() < kWindow) {
    size_t i = cursor_++;
    if (!sub_branch_.empty() && store.branch(i) != sub_branch_) continue;
    out_.push_back({store.line(i)});
    added = true;
  }
  if (added) wake_.cancel();
}

void PageSession::reply(const std::string& id, json::object fields) {
  std::string body = json::serialize(fields);
  // {"id": ID, "ok": true, ...fields}
  std::string frame = "{\"id\":" + id + ",\"ok\":true";
  if (body.size() > 2)
    frame += "," + body.substr(1);
  else
    frame += "}";
  queue(std::move(frame));
}

void PageSession::fail(const std::string& id, std::string_view code, const std::string& message) {
  json::object err{{"code", code}, {"message", message}};
  json::object o{{"ok", false}, {"error", std::move(err)}};
  std::string body = json::serialize(o);
  queue("{\"id\":" + id + "," + body.substr(1));
}

void PageSession::handle(std::string_view text) {
  boost::system::error_code ec;
  auto v = json::parse(text, ec);
  if (ec || !v.is_object()) return fail("null", "bad_request", "request: not a JSON object");
  const auto& req = v.as_object();
  std::string id = "null";
  if (auto it = req.find("id"); it != req.end() && (it->value().is_int64() || it->value().is_string()))
    id = json::serialize(it->value());
  auto op_it = req.find("op");
  if (op_it == req.end() || !op_it->value().is_string()) return fail(id, "bad_request", "request: no \"op\"");
  std::string op(op_it->value().as_string());
  if (handle_local(op, id, req)) return;
  relay(op, id, req);
}

bool PageSession::handle_local(const std::string& op, const std::string& id, const json::object& req) {
  if (op == "ui.info") {
    reply(id, {{"mode", hub_->live ? "live" : "replay"},
               {"source", hub_->source},
               {"read_only", !hub_->live},
               {"box", hub_->live ? hub_->box_state : std::string("journal")},
               {"ended", hub_->store.ended()},
               {"last_seq", hub_->store.last_seq()},
               {"count", hub_->store.size()}});
  } else if (op == "subscribe") {
    subscribed_ = true;
    sub_branch_ = str(req, "branch");
    cursor_ = hub_->store.first_after(num(req, "since", 0));
    reply(id, {{"last_seq", hub_->store.last_seq()}});
    pump();
  } else if (op == "unsubscribe") {
    subscribed_ = false;
    reply(id, {});
  } else if (op == "auth") {
    // The page is authenticated by the secret in its address; the client's auth frame carries
    // nothing, and the box's token is this process's own business.
  } else if (op == "stats" && !hub_->live) {
    stats_from_journal(id);
  } else if (op == "events.range") {
    events_range(id, req);
  } else if (op == "events.procs") {
    // Every (branch, proc) with an event, in order of first appearance: the page's consoles.
    std::set<std::pair<std::string, std::string>> seen;
    json::array procs;
    const auto& store = hub_->store;
    for (size_t i = 0; i < store.size(); ++i) {
      if (!store.proc(i).empty() && seen.emplace(store.branch(i), store.proc(i)).second)
        procs.push_back(json::object{{"branch", store.branch(i)}, {"proc", store.proc(i)}});
    }
    reply(id, {{"procs", std::move(procs)}});
  } else if (op == "events.find") {
    events_find(id, req);
  } else {
    return false;
  }
  return true;
}

void PageSession::events_range(const std::string& id, const json::object& req) {
  auto idx = hub_->store.matching(filter_of(req));
  uint64_t from = std::min<uint64_t>(num(req, "from", 0), idx.size());
  uint64_t count = std::min<uint64_t>(num(req, "count", 100), kMaxRange);
  uint64_t to = std::min<uint64_t>(from + count, idx.size());
  // The lines go out as they are: each is already one JSON object.
  std::string frame = "{\"id\":" + id + ",\"ok\":true,\"total\":" + std::to_string(idx.size()) +
                      ",\"from\":" + std::to_string(from) + ",\"events\":[";
  for (uint64_t i = from; i < to; ++i) {
    if (i > from) frame += ',';
    frame += hub_->store.line(idx[i]);
  }
  frame += "]}";
  queue(std::move(frame));
}

void PageSession::stats_from_journal(const std::string& id) {
  // What the box said last: its last metrics event, with the seq it came from.
  const auto& store = hub_->store;
  for (size_t i = store.size(); i-- > 0;) {
    if (store.type(i) != "metrics") continue;
    boost::system::error_code ec;
    auto v = json::parse(store.line(i), ec);
    if (ec || !v.is_object()) continue;
    json::object out{{"replayed_seq", store.seq(i)}};
    for (auto key : {"box", "branches", "procs"})
      if (auto* f = v.as_object().if_contains(key)) out[key] = *f;
    return reply(id, std::move(out));
  }
  reply(id, {{"replayed_seq", 0}});
}

void PageSession::events_find(const std::string& id, const json::object& req) {
  auto idx = hub_->store.matching(filter_of(req));
  uint64_t seq = num(req, "seq", 0);
  auto it = std::lower_bound(idx.begin(), idx.end(), seq, [&](size_t i, uint64_t s) { return hub_->store.seq(i) < s; });
  reply(id, {{"index", static_cast<uint64_t>(it - idx.begin())}, {"total", idx.size()}});
}

void PageSession::relay(const std::string& op, const std::string& id, const json::object& req) {
  if (std::find(std::begin(kRelayed), std::end(kRelayed), op) == std::end(kRelayed))
    return fail(id, "bad_request", op + ": not an operation the page may ask for");
  if (!hub_->live)
    return fail(id, "read_only", op + ": refused: this page replays the journal of " + hub_->source + " read-only");
  if (op == "fs.read" && num(req, "length", kMaxPageRead + 1) > kMaxPageRead)
    return fail(id, "bad_request",
                "fs.read: the page reads at most " + std::to_string(kMaxPageRead) + " bytes at a time (field length)");
  // An fs.write with its content in frames: one at a time (an id the box would refuse gets its
  // refusal, and no frame is relayed for it).
  bool framed_write = op == "fs.write" && !req.contains("data") && !req.contains("data_b64");
  if (framed_write && write_)
    return fail(id, "busy",
                "fs.write: the page sends one file at a time (the write with id " + std::to_string(write_->first) +
                    " is under way)");
  if (!link_ || link_->closed()) open_link();
  // An fs.read whose id is not a frame's (the protocol's rule) is refused by the box: no frames.
  if (auto* rid = req.if_contains("id"); op == "fs.read" && rid)
    if (auto n = frame_id(*rid)) reads_[*n] = num(req, "offset", 0);
  if (auto* rid = req.if_contains("id"); framed_write && rid)
    if (auto n = frame_id(*rid)) write_.emplace(*n, 0);
  pending_.insert(id);
  link_->send(json::serialize(req));
}

void PageSession::open_link() {
  std::weak_ptr<PageSession> weak = weak_from_this();
  link_ = std::make_shared<BoxLink>(
      hub_->io, hub_->box,
      [weak](std::string text) {
        if (auto self = weak.lock()) self->from_box_text(std::move(text));
      },
      [weak](std::string why) {
        if (auto self = weak.lock()) self->box_closed(why);
      },
      [weak](std::string bytes) {
        if (auto self = weak.lock()) self->from_box_binary(std::move(bytes));
      });
  link_->start();
}

void PageSession::from_box_text(std::string text) {
  boost::system::error_code ec;
  auto v = json::parse(text, ec);
  if (!ec && v.is_object()) {
    const auto& o = v.as_object();
    if (auto it = o.find("id"); it != o.end()) {
      pending_.erase(json::serialize(it->value()));
      // A read refused, or of nothing, has no frames to wait for.
      bool frames = sdk::reply_says_ok(o) && num(o, "length", 0) > 0;
      if (auto n = frame_id(it->value())) {
        if (!frames) reads_.erase(*n);
        // The write's reply: after its last frame, or a refusal before it.
        if (write_ && write_->first == *n) write_.reset();
      }
    }
  }
  // Replies only: this connection subscribes to nothing, the page's events come from the store.
  queue(hub_->scrub(std::move(text)));
}

// fs.read's content, header and all (u32 id, u64 offset, u8 flags, little-endian): the page's
// client matches it to its request; kept here is where the read has got to.
void PageSession::from_box_binary(std::string bytes) {
  if (auto head = protocol::get_header(bytes)) {
    if (auto r = reads_.find(head->id); r != reads_.end()) {
      if (head->last())
        reads_.erase(r);
      else
        r->second = head->offset + (bytes.size() - protocol::kBinaryHeader);
    }
  }
  queue(std::move(bytes), true);
}

// The content of the fs.write under way, relayed to the box in order and within kMaxPageWrite.
// A frame for no write under way is dropped (its write was refused). One out of order or past the
// bound fails the write; the connection to the box is then closed, which ends the upload the box
// has begun (the file keeps what it received), and every request waiting on it gets the reason.
void PageSession::from_page_binary(std::string bytes) {
  auto head = protocol::get_header(bytes);
  if (!write_ || !head) return;
  uint32_t rid = head->id;
  uint64_t offset = head->offset;
  uint64_t len = bytes.size() - protocol::kBinaryHeader;
  auto [wid, next] = *write_;
  std::string why;
  if (rid != wid)
    why = "a binary frame with id " + std::to_string(rid) + " while the write with id " + std::to_string(wid) +
          " is under way";
  else if (offset != next)
    why = "a frame at byte " + std::to_string(offset) + " where byte " + std::to_string(next) + " was due";
  else if (next + len > kMaxPageWrite)
    why = "the page writes at most " + std::to_string(kMaxPageWrite) + " bytes to a file (use sandboxer cp)";
  if (why.empty()) {
    write_->second = next + len;
    link_->send(std::move(bytes), true);
    return;
  }
  std::string id = std::to_string(wid);
  pending_.erase(id);
  write_.reset();
  fail(id, "bad_request", "fs.write: " + why);
  link_->close();
  box_closed("the connection to the box was closed: the page's fs.write with id " + id + " was refused");
}

// The connection to the box ended: a request not answered gets the reason; a read whose frames
// stopped coming gets a last frame, empty, where they stopped, so the page's client ends the
// transfer and reports it short ("reply says N bytes, frames carried M") instead of waiting.
void PageSession::box_closed(const std::string& why) {
  for (const auto& pid : pending_) {
    fail(pid, "unavailable", why);
    boost::system::error_code ec;
    if (auto n = frame_id(json::parse(pid, ec)); n && !ec) reads_.erase(*n);
  }
  pending_.clear();
  for (const auto& [rid, next] : reads_) {
    std::string header;
    protocol::put_header(header, {.id = rid, .offset = next, .flags = protocol::kFlagLast});
    queue(std::move(header), true);
  }
  reads_.clear();
  write_.reset();
}

asio::awaitable<void> send_frame(websocket::stream<beast::tcp_stream>& ws, const Frame& frame) {
  ws.binary(frame.binary);
  co_await ws.async_write(asio::buffer(frame.bytes), asio::use_awaitable);
}

}  // namespace sbx::ui
