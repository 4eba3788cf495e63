#include "sandboxer/client.hpp"

#include <libwebsockets.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <stdexcept>

#include "protocol/protocol.hpp"

namespace sbx::sdk {

namespace json = boost::json;

namespace {

// libwebsockets' last error line (its log at LLL_ERR, not printed): a failed TLS handshake's
// reason is only there ("SSL error: unable to get local issuer certificate ..."), while the
// connection error it reports says "connect SSL err 1: error:00000001:lib(0)::reason(1)".
thread_local std::string last_lws_error;

void keep_lws_error(int, const char* line) {
  std::string_view l(line);
  while (!l.empty() && (l.back() == '\n' || l.back() == ' ')) l.remove_suffix(1);
  last_lws_error = l;
}

// A TLS failure's reason, from the log line lws wrote for it (a certificate that did not verify
// is named so), else the reason lws gave.
std::string tls_reason(std::string reason) {
  constexpr std::string_view kSsl = "SSL error: ";
  if (reason.find("SSL") == std::string::npos) return reason;
  auto at = last_lws_error.find(kSsl);
  if (at == std::string::npos) return reason;
  std::string why = last_lws_error.substr(at + kSsl.size());
  auto paren = why.find(" (preverify_ok=0");  // the peer's certificate failed verification
  if (paren == std::string::npos) return "TLS: " + why;
  why.resize(paren);
  return "TLS: the box's certificate did not verify: " + why;
}

}  // namespace

ParsedUrl parse_url(const std::string& url) {
  ParsedUrl u;
  std::string rest;
  if (url.starts_with("ws://"))
    rest = url.substr(5);
  else if (url.starts_with("wss://")) {
    u.tls = true;
    rest = url.substr(6);
  } else {
    throw std::invalid_argument(url + ": expected ws://HOST:PORT or wss://HOST:PORT");
  }
  auto slash = rest.find('/');
  std::string hostport = rest.substr(0, slash);
  if (slash != std::string::npos) u.path = rest.substr(slash);
  size_t colon;
  if (hostport.starts_with('[')) {
    auto close = hostport.find(']');
    if (close == std::string::npos) throw std::invalid_argument(url + ": unclosed [ in the host");
    u.host = hostport.substr(1, close - 1);
    colon = hostport.find(':', close);
  } else {
    colon = hostport.rfind(':');
    u.host = hostport.substr(0, colon);
  }
  if (colon == std::string::npos) {
    u.port = u.tls ? 443 : 80;
  } else {
    try {
      size_t used = 0;
      u.port = std::stoi(hostport.substr(colon + 1), &used);
      if (used != hostport.size() - colon - 1) u.port = -1;
    } catch (const std::exception&) {
      u.port = -1;
    }
  }
  if (u.host.empty()) throw std::invalid_argument(url + ": no host");
  if (u.port <= 0 || u.port > 65535) throw std::invalid_argument(url + ": bad port");
  return u;
}

struct Client::Impl {
  uv_loop_t* loop;
  Endpoint ep;
  ParsedUrl url;
  lws_context* ctx = nullptr;
  lws* wsi = nullptr;
  lws_protocols protocols[2]{};
  OpenFn on_open;
  EventFn on_event;
  BinaryFn on_binary;
  CloseFn on_close;
  std::function<void()> on_drained;
  std::map<int64_t, ReplyFn> waiting;
  int64_t next_id = 1;
  std::deque<std::pair<std::string, bool>> q;  // LWS_PRE + payload, binary?
  size_t q_bytes = 0;
  std::string rx;
  bool rx_new = true, rx_binary = false;
  bool opened = false, closing = false, closed = false;
  bool destroying = false;  // ~Client: what lws reports then is not news to the owner
  int close_code = 1006;
  std::string close_reason;

  void enqueue(std::string payload, bool binary) {
    std::string buf(LWS_PRE, '\0');
    buf += payload;
    q_bytes += payload.size();
    q.emplace_back(std::move(buf), binary);
    if (wsi) lws_callback_on_writable(wsi);
  }

  void finish_close() {
    if (closed) return;
    closed = true;
    wsi = nullptr;
    // The owner is destroying this client: it closed the connection itself, and its callbacks
    // may refer to what is already gone (`sandboxer attach` said "(1006)" after a Ctrl-C).
    if (destroying) return;
    if (!opened) {
      if (on_open) {
        auto f = std::move(on_open);
        on_open = nullptr;
        f(close_reason.empty() ? "connection failed" : close_reason);
      }
      return;
    }
    if (on_close) on_close(close_code, close_reason);
  }

  // False for a text frame that is not a JSON object (RFC 8259 text is UTF-8: a frame that is
  // not, or that does not parse, is the box's bug or a hostile peer): the caller ends the
  // connection with 1007 rather than leave a request waiting for a reply it can never read.
  bool on_message(std::string_view m, bool binary) {
    if (binary) {
      auto head = protocol::get_header(m);
      if (head && on_binary) on_binary(head->id, head->offset, head->last(), m.substr(protocol::kBinaryHeader));
      return true;
    }
    boost::system::error_code ec;
    auto v = json::parse(m, ec);
    if (ec || !v.is_object()) {
      close_reason = "the box sent a text frame that is not a JSON object" + (ec ? " (" + ec.message() + ")" : "");
      return false;
    }
    auto& o = v.as_object();
    if (o.contains("seq") && !o.contains("id")) {
      if (on_event) on_event(o, m);
      return true;
    }
    auto* id = o.if_contains("id");
    if (id && id->is_int64()) {
      auto it = waiting.find(id->as_int64());
      if (it != waiting.end()) {
        auto fn = std::move(it->second);
        waiting.erase(it);
        if (fn) fn(o);
        return true;
      }
    }
    // An error without a request we know of (e.g. id null): give it to whoever waits longest.
    if (!waiting.empty() && o.contains("ok") && !o.at("ok").as_bool() && (!id || id->is_null())) {
      auto it = waiting.begin();
      auto fn = std::move(it->second);
      waiting.erase(it);
      if (fn) fn(o);
    }
    return true;
  }

  int callback(lws* w, lws_callback_reasons reason, void* in, size_t len) {
    switch (reason) {
      case LWS_CALLBACK_CLIENT_APPEND_HANDSHAKE_HEADER: {
        auto** p = static_cast<unsigned char**>(in);
        unsigned char* end = *p + len;
        std::string v = "Bearer " + ep.token;
        if (lws_add_http_header_by_token(w, WSI_TOKEN_HTTP_AUTHORIZATION,
                                         reinterpret_cast<const unsigned char*>(v.data()), static_cast<int>(v.size()),
                                         p, end))
          return -1;
        return 0;
      }
      case LWS_CALLBACK_CLIENT_ESTABLISHED:
        opened = true;
        if (on_open) {
          auto f = std::move(on_open);
          on_open = nullptr;
          f("");
        }
        if (!q.empty()) lws_callback_on_writable(w);
        return 0;
      case LWS_CALLBACK_CLIENT_CONNECTION_ERROR:
        // lws counts the terminating NUL in some reasons' len: the reason ends at the first NUL.
        close_reason = tls_reason(
            in ? std::string(static_cast<const char*>(in), strnlen(static_cast<const char*>(in), len ? len : SIZE_MAX))
               : "connection failed");
        finish_close();
        return 0;
      case LWS_CALLBACK_CLOSED_CLIENT_HTTP:
        // Closed or reset by the server before its reply to the upgrade: lws 4.1 reports no
        // connection error then, and the client waited for ever.
        if (destroying) return 0;
        if (!opened && close_reason.empty())
          close_reason = "the server closed the connection before the WebSocket handshake";
        finish_close();
        return 0;
      case LWS_CALLBACK_CLIENT_RECEIVE: {
        if (rx_new) {
          rx.clear();
          rx_binary = lws_frame_is_binary(w);
          rx_new = false;
        }
        rx.append(static_cast<const char*>(in), len);
        if (!lws_is_final_fragment(w)) return 0;
        rx_new = true;
        std::string m = std::move(rx);
        rx.clear();
        if (on_message(m, rx_binary)) return 0;
        close_code = LWS_CLOSE_STATUS_INVALID_PAYLOAD;
        lws_close_reason(w, LWS_CLOSE_STATUS_INVALID_PAYLOAD, nullptr, 0);
        return -1;
      }
      case LWS_CALLBACK_CLIENT_WRITEABLE:
        while (!q.empty() && !lws_send_pipe_choked(w)) {
          auto& [buf, binary] = q.front();
          size_t n = buf.size() - LWS_PRE;
          if (lws_write(w, reinterpret_cast<unsigned char*>(buf.data()) + LWS_PRE, n,
                        binary ? LWS_WRITE_BINARY : LWS_WRITE_TEXT) < 0)
            return -1;
          q_bytes -= n;
          q.pop_front();
        }
        if (!q.empty()) {
          lws_callback_on_writable(w);
        } else {
          if (closing) {
            lws_close_reason(w, LWS_CLOSE_STATUS_NORMAL, nullptr, 0);
            return -1;
          }
          if (on_drained) on_drained();
        }
        return 0;
      case LWS_CALLBACK_WS_PEER_INITIATED_CLOSE:
        if (len >= 2) {
          auto* b = static_cast<const unsigned char*>(in);
          close_code = (b[0] << 8) | b[1];
          close_reason.assign(reinterpret_cast<const char*>(b) + 2, len - 2);
        }
        return 0;
      case LWS_CALLBACK_CLIENT_CLOSED:
        finish_close();
        return 0;
      case LWS_CALLBACK_WSI_DESTROY:  // the last word on a connection, whatever came before it
        if (!destroying) finish_close();
        return 0;
      default:
        return 0;
    }
  }

  static int cb(lws* w, lws_callback_reasons reason, void* user, void* in, size_t len) {
    auto* self = static_cast<Impl*>(user);
    if (!self) return 0;
    try {
      return self->callback(w, reason, in, len);
    } catch (const std::exception& e) {
      // An owner's callback (on_event, a reply's) threw on what the box sent: the connection ends
      // saying so, where it once ended with no reason at all.
      if (self->close_reason.empty())
        self->close_reason = std::string("a message from the box could not be handled: ") + e.what();
      self->close_code = 1007;
      return -1;
    }
  }
};

Client::Client(uv_loop_t* loop, Endpoint ep) : impl_(std::make_unique<Impl>()) {
  impl_->loop = loop;
  impl_->ep = std::move(ep);
  impl_->url = parse_url(impl_->ep.url);
}

Client::~Client() {
  impl_->destroying = true;
  if (impl_->ctx) {
    lws_context_destroy(impl_->ctx);
    for (int i = 0; i < 20; ++i) uv_run(impl_->loop, UV_RUN_NOWAIT);
  }
}

void Client::connect(OpenFn on_open) {
  auto& m = *impl_;
  m.on_open = std::move(on_open);
  last_lws_error.clear();
  lws_set_log_level(LLL_ERR, keep_lws_error);
  // One send() per frame (fs.write's binary frames reach 1 MiB): protocol::kSendBytes.
  m.protocols[0] = {protocol::kSubprotocol, Impl::cb, 0, 64 * 1024, 0, nullptr, protocol::kSendBytes};
  m.protocols[1] = {nullptr, nullptr, 0, 0, 0, nullptr, 0};
  lws_context_creation_info info{};
  void* loops[] = {m.loop};
  info.options = LWS_SERVER_OPTION_LIBUV | (m.url.tls ? LWS_SERVER_OPTION_DO_SSL_GLOBAL_INIT : 0);
  info.foreign_loops = loops;
  info.port = CONTEXT_PORT_NO_LISTEN;
  info.protocols = m.protocols;
  info.timeout_secs = 15;
  m.ctx = lws_create_context(&info);
  if (!m.ctx) {
    auto f = std::move(m.on_open);
    m.on_open = nullptr;
    return f("create the libwebsockets context");
  }
  lws_client_connect_info ci{};
  ci.context = m.ctx;
  ci.address = m.url.host.c_str();
  ci.port = m.url.port;
  ci.path = m.url.path.c_str();
  ci.host = m.url.host.c_str();
  ci.origin = m.url.host.c_str();
  ci.protocol = protocol::kSubprotocol;
  ci.userdata = &m;
  ci.pwsi = &m.wsi;
  if (m.url.tls)
    ci.ssl_connection =
        LCCSCF_USE_SSL | (m.ep.insecure ? (LCCSCF_ALLOW_SELFSIGNED | LCCSCF_SKIP_SERVER_CERT_HOSTNAME_CHECK) : 0);
  if (!lws_client_connect_via_info(&ci)) {
    m.close_reason = "connect to " + m.ep.url + " failed";
    m.finish_close();
  }
}

int64_t Client::request(json::object req, ReplyFn on_reply) {
  auto& m = *impl_;
  int64_t id;
  if (auto* v = req.if_contains("id"); v && v->is_int64()) {
    id = v->as_int64();
  } else {
    id = m.next_id++;
    req["id"] = id;
  }
  if (on_reply) m.waiting[id] = std::move(on_reply);
  m.enqueue(json::serialize(req), false);
  return id;
}

void Client::send_binary(uint32_t id, uint64_t offset, bool last, std::string_view data) {
  std::string f;
  f.reserve(protocol::kBinaryHeader + data.size());
  protocol::put_header(f, {.id = id, .offset = offset, .flags = last ? protocol::kFlagLast : uint8_t{0}});
  f.append(data);
  impl_->enqueue(std::move(f), true);
}

size_t Client::pending_bytes() const { return impl_->q_bytes; }
void Client::on_drained(std::function<void()> fn) { impl_->on_drained = std::move(fn); }
void Client::on_event(EventFn fn) { impl_->on_event = std::move(fn); }
void Client::on_binary(BinaryFn fn) { impl_->on_binary = std::move(fn); }
void Client::on_close(CloseFn fn) { impl_->on_close = std::move(fn); }

void Client::close() {
  auto& m = *impl_;
  if (m.closed || m.closing) return;
  m.closing = true;
  if (m.wsi) lws_callback_on_writable(m.wsi);
}

// ---- Subscription ----

Subscription::Subscription(uv_loop_t* loop, Endpoint ep, uint64_t since, std::optional<std::string> branch,
                           EventFn on_event, EndFn on_end)
    : loop_(loop),
      ep_(std::move(ep)),
      last_(since),
      branch_(std::move(branch)),
      on_event_(std::move(on_event)),
      on_end_(std::move(on_end)) {
  retry_ = loop::make_timer(loop_);
  retry_->data = this;
  start();
}

Subscription::~Subscription() {
  stopped_ = true;
  retry_.reset();
  client_.reset();
}

void Subscription::stop() {
  stopped_ = true;
  if (client_) client_->close();
}

void Subscription::start() {
  client_ = std::make_unique<Client>(loop_, ep_);
  client_->on_event([this](const json::object& ev, std::string_view line) {
    auto* s = ev.if_contains("seq");
    if (!s || !s->is_number()) return;
    uint64_t seq = s->to_number<uint64_t>();
    if (seq <= last_) return;  // never twice
    last_ = seq;
    failures_ = 0;
    on_event_(ev, line);
  });
  auto again = [this](uint64_t delay_ms) {
    // A new connection from a timer: the old one is torn down outside its own callbacks.
    uv_timer_start(
        retry_.get(),
        [](uv_timer_t* t) {
          auto* self = static_cast<Subscription*>(t->data);
          if (!self || self->stopped_) return;
          self->client_.reset();
          self->start();
        },
        delay_ms, 0);
  };
  client_->on_close([this, again](int code, const std::string& reason) {
    if (stopped_) return on_end_(code, reason);
    if (code == protocol::kCloseTooSlow || code == 1006 || code == 1011) {
      // Too slow (the journal has everything) or dropped: resume from the last seq we delivered.
      if (++failures_ > 20) return on_end_(code, reason);
      return again(code == protocol::kCloseTooSlow ? 0 : 200u * static_cast<unsigned>(failures_));
    }
    on_end_(code, reason);
  });
  client_->connect([this, again](const std::string& err) {
    if (!err.empty()) {
      if (err.find("401") != std::string::npos || err.find("unauthorized") != std::string::npos)
        return on_end_(protocol::kCloseUnauthorized, "the box refused the token: " + err);
      if (err.find("not 101") != std::string::npos) return on_end_(protocol::kCloseUnauthorized, err);
      // A box never reached is not waited for (a wrong URL, a box not up yet): it ends at once,
      // as a dropped connection that does not come back does after its retries.
      if (!connected_ || ++failures_ > 20) return on_end_(1006, err);
      return again(200u * static_cast<unsigned>(failures_));
    }
    connected_ = true;
    json::object req{{"op", "subscribe"}, {"since", last_}};
    if (branch_) req["branch"] = *branch_;
    client_->request(req, [this](const json::object& r) {
      if (!r.at("ok").as_bool()) {
        auto& e = r.at("error").as_object();
        on_end_(4000, std::string(e.at("message").as_string()));
      }
    });
  });
}

}  // namespace sbx::sdk
