// Snapshot archives between the browser and the box over HTTP, each on a connection to the box of
// its own, nothing held here: a browser that reads or sends slowly holds back that connection,
// not the server's memory.
// - GET SECRET/snapshot/<id>.tar.zst, the page's download button: the box's snapshot.export, each
//   binary frame written into the HTTP response as it comes.
// - POST SECRET/snapshot/import, the page's import: the request's body, as it arrives, in the
//   binary frames of a snapshot.import, and the box's reply as the response.
#include "ui/snapshot-http.hpp"

#include <boost/json.hpp>
#include <optional>

#include "archive/archive.hpp"
#include "protocol/protocol.hpp"
#include "sandboxer/beast.hpp"

namespace sbx::ui {

namespace {

namespace json = boost::json;

constexpr uint32_t kExportId = 1;          // each connection's one request, an export or an import
constexpr size_t kImportChunk = 1u << 20;  // an import's frames, as the CLI sends them
constexpr size_t kReadMax = (4u << 20) + protocol::kBinaryHeader;  // the box's frames are smaller
constexpr auto kWriteLimit = std::chrono::seconds(30);             // a browser that takes nothing for this long

using HeaderFn = std::function<void(http::response_header<>&)>;

// What a refusal says to the browser: the status and one line of text.
struct Refusal {
  http::status status;
  std::string text;
};

// The reply to the connection's request (its id, or null: a request the box could not read).
asio::awaitable<json::object> read_reply(sdk::WsStream& ws) {
  beast::flat_buffer buf;
  for (;;) {
    buf.clear();
    co_await ws.read(buf);
    if (!ws.got_text()) continue;
    auto rep = sdk::reply_for(std::string_view(static_cast<const char*>(buf.data().data()), buf.size()), kExportId);
    if (rep) co_return std::move(*rep);
  }
}

// A reply that is not ok as what the browser gets: 404 for not_found, else 502, with the box's
// message and code.
Refusal refusal_from(const json::object& reply, const char* op) {
  std::string code, message = json::serialize(reply);
  if (auto* e = reply.if_contains("error"); e && e->is_object()) {
    if (auto* c = e->as_object().if_contains("code"); c && c->is_string()) code = c->as_string();
    if (auto* m = e->as_object().if_contains("message"); m && m->is_string()) message = m->as_string();
  }
  return Refusal{code == "not_found" ? http::status::not_found : http::status::bad_gateway,
                 std::string(op) + ": " + message + (code.empty() ? "" : " (" + code + ")")};
}

std::optional<Refusal> refusal_of(const json::object& reply, uint64_t& size, const char* op) {
  if (!sdk::reply_says_ok(reply)) return refusal_from(reply, op);
  auto* n = reply.if_contains("size");
  if (!n || !n->is_int64() || n->as_int64() <= 0)
    return Refusal{http::status::bad_gateway, "snapshot.export's reply names no size"};
  size = static_cast<uint64_t>(n->as_int64());
  return std::nullopt;
}

// The archive's frames into the response, in order and exactly `size` bytes, or an exception
// (the HTTP connection is then closed: the browser's download fails rather than ends short).
asio::awaitable<void> relay_frames(sdk::WsStream& ws, beast::tcp_stream& out, http::response<http::buffer_body>& res,
                                   http::response_serializer<http::buffer_body>& sr, uint64_t size) {
  beast::flat_buffer buf;
  uint64_t next = 0;
  for (;;) {
    buf.clear();
    co_await ws.read(buf);
    if (ws.got_text()) continue;
    std::string_view m(static_cast<const char*>(buf.data().data()), buf.size());
    auto head = protocol::get_header(m);
    if (!head || head->id != kExportId) continue;
    auto body = m.substr(protocol::kBinaryHeader);
    if (head->offset != next || next + body.size() > size || (head->last() && next + body.size() != size))
      throw std::runtime_error("the box's frames do not follow each other");
    if (!body.empty()) {
      res.body().data = const_cast<char*>(body.data());
      res.body().size = body.size();
      res.body().more = true;
      out.expires_after(kWriteLimit);
      boost::system::error_code ec;
      co_await http::async_write(out, sr, asio::redirect_error(asio::use_awaitable, ec));
      if (ec && ec != http::error::need_buffer) throw boost::system::system_error(ec);
    }
    next += body.size();
    if (head->last()) break;
  }
  res.body().data = nullptr;
  res.body().size = 0;
  res.body().more = false;
  co_await http::async_write(out, sr, asio::use_awaitable);
}

// On a connection of its own, which lives in this coroutine (its TLS context's exception, the
// system's CAs unreadable, comes out of it).
asio::awaitable<std::optional<Refusal>> relay_export(const Hub& hub, beast::tcp_stream& out,
                                                     http::response<http::buffer_body>& res, const std::string& id) {
  sdk::WsStream ws(hub.io, hub.box);
  auto why = co_await ws.open_or_reason(kReadMax);
  if (!why.empty()) co_return Refusal{http::status::bad_gateway, "the box: " + hub.scrub(why)};
  uint64_t size = 0;
  json::object req{{"op", "snapshot.export"}, {"snapshot", id}, {"id", kExportId}};
  co_await ws.write(asio::buffer(json::serialize(req)), false);
  if (auto refused = refusal_of(co_await read_reply(ws), size, "snapshot.export")) co_return refused;
  res.content_length(size);
  http::response_serializer<http::buffer_body> sr{res};
  out.expires_after(kWriteLimit);
  co_await http::async_write_header(out, sr, asio::use_awaitable);
  co_await relay_frames(ws, out, res, sr, size);
  co_await ws.close(std::chrono::seconds(2));
  co_return std::nullopt;
}

// What an import's reader and its upload share: the box's reply, or why its connection ended.
struct ImportRun {
  bool replied = false, reader_done = false;
  json::object reply;
  std::string closed;
};

asio::awaitable<void> read_import_reply(sdk::WsStream& ws, ImportRun& run, asio::steady_timer& wake) {
  try {
    run.reply = co_await read_reply(ws);
    run.replied = true;
  } catch (const boost::system::system_error& e) {
    run.closed = ws.close_reason(e.code());
  }
  run.reader_done = true;
  wake.cancel();
}

// Up to kImportChunk bytes of the request's body into `chunk` (fewer at its end).
asio::awaitable<size_t> read_body(beast::tcp_stream& in, beast::flat_buffer& buf,
                                  http::request_parser<http::buffer_body>& p, std::vector<char>& chunk) {
  size_t n = 0;
  while (n < chunk.size() && !p.is_done()) {
    p.get().body().data = chunk.data() + n;
    p.get().body().size = chunk.size() - n;
    in.expires_after(kWriteLimit);
    boost::system::error_code ec;
    co_await http::async_read(in, buf, p, asio::redirect_error(asio::use_awaitable, ec));
    if (ec && ec != http::error::need_buffer) throw boost::system::system_error(ec);
    n = chunk.size() - p.get().body().size;
  }
  co_return n;
}

// The request's body in the import's frames as it arrives, until its end, the box's reply (an
// early refusal) or the end of the box's connection (its reader says why); the rest of the body
// is then read and dropped, so the browser gets the answer. Throws where the browser's upload
// fails.
asio::awaitable<void> send_body(sdk::WsStream& ws, beast::tcp_stream& in, beast::flat_buffer& buf,
                                http::request_parser<http::buffer_body>& p, const ImportRun& run) {
  std::vector<char> chunk(kImportChunk);
  std::string frame;
  uint64_t off = 0;
  ws.write_buffer_bytes(256 * 1024);  // masked a word at a time, a quarter of a frame per send
  while (!run.replied) {
    size_t n = co_await read_body(in, buf, p, chunk);
    bool last = p.is_done();
    frame.clear();
    protocol::put_header(frame, {.id = kExportId, .offset = off, .flags = last ? protocol::kFlagLast : uint8_t{0}});
    frame.append(chunk.data(), n);
    bool sent = true;
    try {
      co_await ws.write(asio::buffer(frame), true);
    } catch (const boost::system::system_error&) {
      sent = false;  // the box's connection ended: its reader says why
    }
    if (!sent) break;
    off += n;
    if (last) co_return;
  }
  while (!p.is_done()) co_await read_body(in, buf, p, chunk);
}

// On a connection of its own, as relay_export's.
asio::awaitable<std::optional<Refusal>> relay_import(const Hub& hub, beast::tcp_stream& in, beast::flat_buffer& buf,
                                                     http::request_parser<http::buffer_body>& p, json::object& out) {
  sdk::WsStream ws(hub.io, hub.box);
  auto why = co_await ws.open_or_reason(kReadMax);
  if (!why.empty()) co_return Refusal{http::status::bad_gateway, "the box: " + hub.scrub(why)};
  json::object req{{"op", "snapshot.import"}, {"size", *p.content_length()}, {"id", kExportId}};
  co_await ws.write(asio::buffer(json::serialize(req)), false);
  ImportRun run;
  asio::steady_timer wake(hub.io);
  asio::co_spawn(hub.io, read_import_reply(ws, run, wake), asio::detached);
  std::optional<Refusal> failed;
  try {
    co_await send_body(ws, in, buf, p, run);
  } catch (const boost::system::system_error& e) {
    // The browser's upload ended first: the box drops what it received of an upload whose
    // connection closes.
    failed = Refusal{http::status::bad_request, "the upload ended before its length: " + e.code().message()};
    ws.cancel();
  }
  // The reader holds this frame's `run` and `wake`: it ends before the frame does.
  while (!run.reader_done) {
    wake.expires_after(std::chrono::minutes(1));
    boost::system::error_code ec;
    co_await wake.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  if (run.replied) {
    if (!sdk::reply_says_ok(run.reply)) co_return refusal_from(run.reply, "snapshot.import");
    if (failed) co_return failed;
    run.reply.erase("id");
    out = std::move(run.reply);
    co_await ws.close(std::chrono::seconds(2));
    co_return std::nullopt;
  }
  if (failed) co_return failed;
  co_return Refusal{http::status::bad_gateway,
                    "the box's connection closed before its reply: " + hub.scrub(run.closed)};
}

asio::awaitable<void> send_text(beast::tcp_stream& out, unsigned version, const HeaderFn& headers, http::status status,
                                const std::string& text, const char* type = "text/plain; charset=utf-8") {
  http::response<http::string_body> res{status, version};
  headers(res.base());
  res.set(http::field::content_type, type);
  res.body() = text + "\n";
  res.keep_alive(false);
  res.prepare_payload();
  out.expires_after(kWriteLimit);
  co_await http::async_write(out, res, asio::use_awaitable);
}

std::optional<Refusal> refuse_replay(const Hub& hub) {
  if (hub.live) return std::nullopt;
  return Refusal{http::status::not_found, "read-only: this page replays a journal, which holds no snapshot"};
}

}  // namespace

std::optional<std::string> snapshot_download(std::string_view rest) {
  constexpr std::string_view prefix = "snapshot/", suffix = ".tar.zst";
  if (!rest.starts_with(prefix) || !rest.ends_with(suffix)) return std::nullopt;
  return std::string(rest.substr(prefix.size(), rest.size() - prefix.size() - suffix.size()));
}

asio::awaitable<void> serve_snapshot(std::shared_ptr<Hub> hub, beast::tcp_stream& out, unsigned version, std::string id,
                                     HeaderFn headers) {
  std::optional<Refusal> refused = refuse_replay(*hub);
  if (!refused && !archive::valid_snapshot_id(id))
    refused = Refusal{http::status::bad_request, id + ": not a snapshot id (s- and 16 hex digits)"};
  if (!refused) {
    http::response<http::buffer_body> res{http::status::ok, version};
    headers(res.base());
    res.set(http::field::content_type, "application/zstd");
    res.set(http::field::content_disposition, "attachment; filename=\"" + id + ".tar.zst\"");
    res.keep_alive(false);
    try {
      refused = co_await relay_export(*hub, out, res, id);
      if (!refused) co_return;
    } catch (const std::exception& e) {
      // Before the header: said to the browser; after it, only the connection's end can say it.
      if (res.has_content_length()) throw;
      refused = Refusal{http::status::bad_gateway, "the box: " + hub->scrub(e.what())};
    }
  }
  co_await send_text(out, version, headers, refused->status, refused->text);
}

asio::awaitable<void> serve_import(std::shared_ptr<Hub> hub, beast::tcp_stream& in, beast::flat_buffer& buf,
                                   http::request_parser<http::empty_body>& head, HeaderFn headers) {
  unsigned version = head.get().version();
  std::optional<Refusal> refused = refuse_replay(*hub);
  json::object reply;
  if (!refused && (!head.content_length() || *head.content_length() == 0))
    refused = Refusal{http::status::length_required, "an archive's upload names its length (Content-Length)"};
  if (!refused && head.get()[http::field::expect] == "100-continue") {
    // curl waits a second for this before a large body; browsers send no Expect.
    http::response<http::empty_body> go_on{http::status::continue_, version};
    co_await http::async_write(in, go_on, asio::use_awaitable);
  }
  if (!refused) {
    http::request_parser<http::buffer_body> p{std::move(head)};
    p.body_limit(boost::none);  // the archive's length, which the box bounds (its disk)
    try {
      refused = co_await relay_import(*hub, in, buf, p, reply);
    } catch (const std::exception& e) {
      refused = Refusal{http::status::bad_gateway, "the box: " + hub->scrub(e.what())};
    }
  }
  if (refused) co_return co_await send_text(in, version, headers, refused->status, refused->text);
  co_await send_text(in, version, headers, http::status::ok, json::serialize(reply), "application/json");
}

}  // namespace sbx::ui
