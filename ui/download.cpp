// GET SECRET/snapshot/<id>.tar.zst: a snapshot's archive out of the box, for the page's download
// link. The page server asks the box for it (snapshot.export) on a connection of its own and
// writes each binary frame into the HTTP response as it comes: nothing is held here, and a
// browser that reads slowly holds back the box's connection, not the server's memory.
#include "ui/download.hpp"

#include <boost/json.hpp>
#include <optional>

#include "protocol/protocol.hpp"
#include "sandboxer/beast.hpp"

namespace sbx::ui {

namespace {

namespace json = boost::json;

constexpr uint32_t kExportId = 1;
constexpr size_t kReadMax = (4u << 20) + protocol::kBinaryHeader;  // the box's frames are smaller
constexpr auto kWriteLimit = std::chrono::seconds(30);             // a browser that takes nothing for this long

bool valid_snapshot_id(std::string_view id) {
  if (id.size() != 18 || !id.starts_with("s-")) return false;
  return id.substr(2).find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

// What a refusal says to the browser: the status and one line of text.
struct Refusal {
  http::status status;
  std::string text;
};

template <class Ws>
asio::awaitable<json::object> export_reply(Ws& ws, const std::string& id) {
  json::object req{{"op", "snapshot.export"}, {"snapshot", id}, {"id", kExportId}};
  ws.text(true);
  co_await ws.async_write(asio::buffer(json::serialize(req)), asio::use_awaitable);
  beast::flat_buffer buf;
  for (;;) {
    buf.clear();
    co_await ws.async_read(buf, asio::use_awaitable);
    if (!ws.got_text()) continue;
    boost::system::error_code ec;
    auto v = json::parse(std::string_view(static_cast<const char*>(buf.data().data()), buf.size()), ec);
    if (ec || !v.is_object()) continue;
    auto* rid = v.as_object().if_contains("id");
    if (rid && (rid->is_null() || (rid->is_int64() && rid->as_int64() == kExportId))) co_return v.as_object();
  }
}

std::optional<Refusal> refusal_of(const json::object& reply, uint64_t& size) {
  auto* ok = reply.if_contains("ok");
  if (!ok || !ok->is_bool() || !ok->as_bool()) {
    std::string code, message = json::serialize(reply);
    if (auto* e = reply.if_contains("error"); e && e->is_object()) {
      if (auto* c = e->as_object().if_contains("code"); c && c->is_string()) code = c->as_string();
      if (auto* m = e->as_object().if_contains("message"); m && m->is_string()) message = m->as_string();
    }
    return Refusal{code == "not_found" ? http::status::not_found : http::status::bad_gateway,
                   "snapshot.export: " + message + (code.empty() ? "" : " (" + code + ")")};
  }
  auto* n = reply.if_contains("size");
  if (!n || !n->is_int64() || n->as_int64() <= 0)
    return Refusal{http::status::bad_gateway, "snapshot.export's reply names no size"};
  size = static_cast<uint64_t>(n->as_int64());
  return std::nullopt;
}

// The archive's frames into the response, in order and exactly `size` bytes, or an exception
// (the HTTP connection is then closed: the browser's download fails rather than ends short).
template <class Ws>
asio::awaitable<void> relay_frames(Ws& ws, beast::tcp_stream& out, http::response<http::buffer_body>& res,
                                   http::response_serializer<http::buffer_body>& sr, uint64_t size) {
  beast::flat_buffer buf;
  uint64_t next = 0;
  for (;;) {
    buf.clear();
    co_await ws.async_read(buf, asio::use_awaitable);
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

template <class Ws>
asio::awaitable<std::optional<Refusal>> relay_export(Ws& ws, const Hub& hub, beast::tcp_stream& out,
                                                     http::response<http::buffer_body>& res, const std::string& id) {
  auto why = co_await sdk::open_websocket_or_reason(ws, hub.box, kReadMax);
  if (!why.empty()) co_return Refusal{http::status::bad_gateway, "the box: " + hub.scrub(why)};
  uint64_t size = 0;
  if (auto refused = refusal_of(co_await export_reply(ws, id), size)) co_return refused;
  res.content_length(size);
  http::response_serializer<http::buffer_body> sr{res};
  out.expires_after(kWriteLimit);
  co_await http::async_write_header(out, sr, asio::use_awaitable);
  co_await relay_frames(ws, out, res, sr, size);
  co_await sdk::close_websocket(ws, std::chrono::seconds(2));
  co_return std::nullopt;
}

}  // namespace

std::optional<std::string> snapshot_download(std::string_view rest) {
  constexpr std::string_view prefix = "snapshot/", suffix = ".tar.zst";
  if (!rest.starts_with(prefix) || !rest.ends_with(suffix)) return std::nullopt;
  return std::string(rest.substr(prefix.size(), rest.size() - prefix.size() - suffix.size()));
}

asio::awaitable<void> serve_snapshot(std::shared_ptr<Hub> hub, beast::tcp_stream& out, unsigned version, std::string id,
                                     std::function<void(http::response_header<>&)> headers) {
  std::optional<Refusal> refused;
  if (!hub->live)
    refused = Refusal{http::status::not_found, "read-only: this page replays a journal, which holds no snapshot"};
  else if (!valid_snapshot_id(id))
    refused = Refusal{http::status::bad_request, id + ": not a snapshot id (s- and 16 hex digits)"};
  if (!refused) {
    http::response<http::buffer_body> res{http::status::ok, version};
    headers(res.base());
    res.set(http::field::content_type, "application/zstd");
    res.set(http::field::content_disposition, "attachment; filename=\"" + id + ".tar.zst\"");
    res.keep_alive(false);
    std::optional<asio::ssl::context> ssl;
    try {
      if (hub->box.tls) {
        ssl.emplace(asio::ssl::context::tls_client);
        sdk::configure_tls(*ssl, hub->box);
        sdk::TlsWs ws(hub->io, *ssl);
        refused = co_await relay_export(ws, *hub, out, res, id);
      } else {
        sdk::PlainWs ws(hub->io);
        refused = co_await relay_export(ws, *hub, out, res, id);
      }
    } catch (const std::exception& e) {
      // Before the header: said to the browser; after it, only the connection's end can say it.
      if (res.has_content_length()) throw;
      refused = Refusal{http::status::bad_gateway, "the box: " + hub->scrub(e.what())};
    }
  }
  if (!refused) co_return;
  http::response<http::string_body> res{refused->status, version};
  headers(res.base());
  res.set(http::field::content_type, "text/plain; charset=utf-8");
  res.body() = refused->text + "\n";
  res.keep_alive(false);
  res.prepare_payload();
  out.expires_after(kWriteLimit);
  co_await http::async_write(out, res, asio::use_awaitable);
}

}  // namespace sbx::ui
