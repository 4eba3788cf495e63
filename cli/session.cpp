#include "cli/session.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "archive/archive.hpp"
#include "base/encoding.hpp"
#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/tokens.hpp"
#include "os/sys.hpp"
#include "protocol/protocol.hpp"
#include "sandboxer/transfer.hpp"

namespace sbx::cli {

namespace json = boost::json;
using sdk::Client;

std::optional<std::string> unreachable(const std::string& url) {
  sdk::ParsedUrl u;
  try {
    u = sdk::parse_url(url);
  } catch (const std::exception& e) {
    return e.what();
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int g = ::getaddrinfo(u.host.c_str(), std::to_string(u.port).c_str(), &hints, &res); g != 0 || !res)
    return "no address for " + u.host + ": " + (g ? ::gai_strerror(g) : "none");
  int e = 0;
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    e = errno;
  } else if (::connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    e = errno;
    if (e == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int n = ::poll(&p, 1, 2000);
      socklen_t len = sizeof e;
      if (n == 0)
        e = ETIMEDOUT;
      else if (n < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0)
        e = errno;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  std::string where = u.host + ":" + std::to_string(u.port);
  if (e == ECONNREFUSED) return std::string(std::strerror(e)) + " (nothing listens on " + where + ")";
  if (e != 0) return std::string(std::strerror(e)) + " (" + where + ")";
  return std::nullopt;
}

std::string connect_error(const std::string& url, const std::string& err) {
  if (err.find("closed before established") == std::string::npos) return err;
  if (auto why = unreachable(url)) return *why;
  sdk::ParsedUrl u = sdk::parse_url(url);  // it parsed above
  return "the server at " + u.host + ":" + std::to_string(u.port) +
         " accepted a connection and closed it before the WebSocket handshake";
}

namespace {

sdk::Endpoint resolve(const std::string& url, const std::string& token_file) {
  sdk::Endpoint ep{url, find_token(url, token_file)};
  ep.insecure = std::getenv("SANDBOXER_INSECURE") != nullptr;
  sdk::parse_url(url);  // fails early with a clear message
  return ep;
}

}  // namespace

ArgSpec remote_spec(ArgSpec spec) {
  spec.options.push_back("--token-file");
  return spec;
}

std::string text_field(const json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : std::string();
}

std::string snapshot_origin(const json::object& manifest) {
  auto* o = manifest.if_contains("origin");
  if (!o || !o->is_object()) return {};
  std::string by = text_field(o->as_object(), "by");
  return by == "channel" ? "agent:" + text_field(o->as_object(), "branch") : by;
}

base::Result<std::string> snapshot_id(Session& s, const std::string& given) {
  if (archive::valid_snapshot_id(given)) return given;
  if (given.empty()) return base::fail("\"\" is not a snapshot id (s- and 16 hex digits) or name", "bad_request");
  auto r = s.call({{"op", "snapshot.list"}});
  if (!r)
    return base::fail("list the box's snapshots (to find \"" + given + "\"): " + r.error().message, r.error().code);
  std::vector<json::object> named;
  if (auto* list = r->if_contains("snapshots"); list && list->is_array())
    for (auto& v : list->as_array())
      if (v.is_object() && text_field(v.as_object(), "name") == given) named.push_back(v.as_object());
  if (named.empty())
    return base::fail("\"" + given +
                          "\" is neither a snapshot id (s- and 16 hex digits) nor the name of a snapshot of " +
                          s.url() + " (sandboxer snapshots lists them)",
                      "not_found");
  auto made_by = [](const json::object& o) {
    auto by = snapshot_origin(o);
    return by.starts_with("agent:") ? ", made by the agent of branch " + by.substr(6) : std::string();
  };
  if (named.size() > 1) {
    std::string ids;
    for (auto& o : named)
      ids += (ids.empty() ? " " : ", ") + text_field(o, "id") + " (" + text_field(o, "created") + made_by(o) + ")";
    return base::fail("\"" + given + "\" names " + std::to_string(named.size()) + " snapshots:" + ids + "; give its id",
                      "ambiguous");
  }
  std::string id = text_field(named.front(), "id");
  if (!archive::valid_snapshot_id(id))
    return base::fail("the snapshot named \"" + given + "\" has no id in the box's list", "bad_reply");
  s.report("snapshot \"" + given + "\" is " + id + made_by(named.front()));
  return id;
}

std::string entry_name(const json::object& entry) {
  std::string raw;
  if (auto b64 = text_field(entry, "name_b64"); !b64.empty() && base::base64_decode(b64, raw)) return raw;
  return text_field(entry, "name");
}

json::array sorted_entries(json::array entries) {
  auto key = [](const json::value& v) { return v.is_object() ? entry_name(v.as_object()) : std::string(); };
  std::sort(entries.begin(), entries.end(),
            [&](const json::value& x, const json::value& y) { return key(x) < key(y); });
  return entries;
}

std::optional<RemotePath> split_remote(const std::string& s, bool path_optional) {
  if (!s.starts_with("ws://") && !s.starts_with("wss://")) return std::nullopt;
  const std::string bad = s + ": expected URL:PATH, e.g. ws://127.0.0.1:7000:/workspace/file";
  const std::string no_port = s +
                              ": a box's URL names its port (ws://HOST:PORT, then :PATH), e.g. "
                              "ws://127.0.0.1:7000:/workspace/file";
  size_t after = s.find("://") + 3;
  // An IPv6 host is in brackets, its colons part of it.
  size_t host_end = after < s.size() && s[after] == '[' ? s.find(']', after) : after;
  if (host_end == std::string::npos) throw UsageError(s + ": an IPv6 host without its closing ]");
  size_t colon = s.find(':', host_end);
  if (colon == std::string::npos) throw UsageError(no_port);
  size_t end = colon + 1;
  while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
  if (end == colon + 1) throw UsageError(no_port);
  if (end == s.size() || (end == s.size() - 1 && s[end] == ':')) {
    if (!path_optional) throw UsageError(bad);
    return RemotePath{s.substr(0, end), ""};
  }
  if (s[end] != ':') throw UsageError(bad);
  return RemotePath{s.substr(0, end), s.substr(end + 1)};
}

std::vector<sdk::Endpoint> target_endpoints(const Args& a, bool insecure) {
  auto to = a.values("--to");
  auto tokens = a.values("--to-token-file");
  if (tokens.size() > 1 && tokens.size() != to.size())
    a.fail(std::to_string(tokens.size()) + " --to-token-file for " + std::to_string(to.size()) +
           " --to (give one for all, or one per target in order)");
  std::vector<sdk::Endpoint> out;
  for (size_t i = 0; i < to.size(); ++i) {
    try {
      sdk::parse_url(to[i]);
    } catch (const std::exception& e) {
      a.fail("--to " + to[i] + ": " + e.what());
    }
    std::string tf = tokens.empty() ? "" : tokens[tokens.size() == 1 ? 0 : i];
    out.push_back({to[i], find_token(to[i], tf), insecure});
  }
  return out;
}

std::vector<std::string> readable_keys(const Args& a) {
  auto keys = a.values("--trust-key");
  for (auto& f : keys)
    if (::access(f.c_str(), R_OK) != 0) a.fail("--trust-key " + f + ": " + std::strerror(errno));
  return keys;
}

base::Error reply_error(const json::object& reply) {
  if (auto* e = reply.if_contains("error"); e && e->is_object()) {
    auto& o = e->as_object();
    return base::fail(std::string(o.at("message").as_string()), std::string(o.at("code").as_string()));
  }
  return base::fail(json::serialize(reply), "");
}

json::object error_reply(const base::Error& e) {
  return json::object{{"ok", false}, {"error", {{"code", e.code}, {"message", e.message}}}};
}

bool reply_ok(const json::object& reply) { return reply.at("ok").as_bool(); }

Session::Session(std::string cmd, std::string url, const Args& args)
    : Session(std::move(cmd), std::move(url), args.value_or("--token-file", "")) {}

Session::Session(std::string cmd, std::string url, const std::string& token_file)
    : cmd_(std::move(cmd)), endpoint_(resolve(url, token_file)) {
  uv_loop_init(&loop_);
  for (auto* s : {&sigint_, &sigterm_}) {
    uv_signal_init(&loop_, s);
    s->data = this;
    // The signals alone keep no loop running.
    uv_unref(reinterpret_cast<uv_handle_t*>(s));
  }
  auto cb = [](uv_signal_t* s, int) {
    auto* self = static_cast<Session*>(s->data);
    if (self->on_interrupt_)
      self->on_interrupt_();
    else
      uv_stop(s->loop);
  };
  uv_signal_start(&sigint_, cb, SIGINT);
  uv_signal_start(&sigterm_, cb, SIGTERM);
}

Session::~Session() {
  uv_close(reinterpret_cast<uv_handle_t*>(&sigint_), nullptr);
  uv_close(reinterpret_cast<uv_handle_t*>(&sigterm_), nullptr);
  uv_run(&loop_, UV_RUN_NOWAIT);
  uv_loop_close(&loop_);
}

int Session::stream_closed(int code, const std::string& reason) {
  stop();
  if (code == 1000 || code == 1001) return kExitOk;
  report(url() + ": " + connect_error(url(), reason) + " (" + std::to_string(code) + ")");
  return kExitFailed;
}

void Session::report(std::string_view what) const {
  // A message may name what the agent named (a file): nothing in it acts on the terminal.
  std::cerr << "sandboxer " << cmd_ << ": " << printable(what, false) << "\n";
}

namespace {
std::optional<base::Error> not_text_in(const json::value& v, const std::string& where) {
  if (v.is_string()) {
    std::string_view text = v.as_string();
    if (base::utf8_valid_prefix(text) == text.size()) return std::nullopt;
    return base::fail(where + " \"" + printable(text) + "\" is not UTF-8, and the API's JSON carries UTF-8 text only",
                      "not_utf8");
  }
  if (v.is_array()) {
    const auto& a = v.as_array();
    for (size_t i = 0; i < a.size(); ++i)
      if (auto e = not_text_in(a[i], where + "[" + std::to_string(i) + "]")) return e;
  }
  if (v.is_object())
    for (const auto& kv : v.as_object())
      if (auto e = not_text_in(kv.value(), where.empty() ? std::string(kv.key()) : where + "." + std::string(kv.key())))
        return e;
  return std::nullopt;
}
}  // namespace

std::optional<base::Error> not_text(const json::object& req) { return not_text_in(req, ""); }

void name_by_bytes(json::object& req) {
  for (std::string_view key : {"path", "from", "to", "target"}) {
    auto* v = req.if_contains(key);
    if (!v || !v->is_string() || base::utf8_valid_prefix(v->as_string()) == v->as_string().size()) continue;
    std::string bytes(v->as_string());
    req.erase(key);
    protocol::put_text_or_b64(req, key, bytes);
  }
}

std::string in_cli_words(std::string message) {
  // The fs ops' hints name fields and ops; here they name the commands that do the same.
  static const std::pair<std::string_view, std::string_view> kHints[] = {
      {"(use fs.list)", "(cp copies one file; `sandboxer ls` lists a directory)"},
      {"copy it with fs.read and fs.write", "copy it out with `sandboxer cp` and back in"},
      {"set replace to replace it", "--replace replaces it"},
  };
  for (const auto& [api, cli] : kHints)
    if (auto at = message.find(api); at != std::string::npos) message.replace(at, api.size(), cli);
  return message;
}

int Session::fail(const base::Error& e, std::string_view what) const {
  std::string text = what.empty() ? "" : std::string(what) + ": ";
  text += in_cli_words(e.message);
  if (!e.code.empty()) text += " (" + e.code + ")";
  report(text);
  return kExitFailed;
}

base::Result<json::object> Session::request_to(const sdk::Endpoint& box, json::object req) {
  name_by_bytes(req);
  if (auto e = not_text(req)) return *e;
  // Both outlive the client.
  base::Result<json::object> result = base::fail("the connection closed first", "closed");
  bool settled = false;  // result is the reply, or the connect's error
  Client c(&loop_, box);
  c.on_close([&](int code, const std::string& reason) {
    // A close with a reason before the reply says why (the client's own 1007 for a message that
    // is not JSON, the box's 4401 or 1001).
    if (!settled && !reason.empty())
      result = base::fail("the connection closed first: " + reason + " (" + std::to_string(code) + ")", "closed");
    settled = true;
    stop();
  });
  c.connect([&](const std::string& err) {
    if (!err.empty()) {
      settled = true;
      result = base::fail("connect to " + box.url + ": " + connect_error(box.url, err), "connect");
      return stop();
    }
    c.request(std::move(req), [&](const json::object& r) {
      settled = true;
      result = r;
      c.close();
      stop();
    });
  });
  auto interrupt = std::exchange(on_interrupt_, [this] { stop(); });
  run();
  on_interrupt_ = std::move(interrupt);
  return result;
}

base::Result<json::object> Session::call_to(const sdk::Endpoint& box, json::object req) {
  auto r = request_to(box, std::move(req));
  if (r && !reply_ok(*r)) return reply_error(*r);
  return r;
}

base::Result<json::object> Session::list(const std::string& path) {
  json::array all;
  std::optional<std::string> after;
  for (;;) {
    json::object req{{"op", "fs.list"}, {"path", path}, {"limit", kListPage}};
    if (after) protocol::put_text_or_b64(req, "after", *after);
    auto r = request(std::move(req));
    if (!r || !reply_ok(*r)) return r;
    auto& page = r->at("entries").as_array();
    auto* more = r->if_contains("more");
    bool again = more && more->is_bool() && more->as_bool() && !page.empty();
    for (auto& e : page) all.push_back(e);
    if (!again) {
      (*r)["entries"] = std::move(all);
      r->erase("more");
      return r;
    }
    // The next page starts past this one's last name: one that does not move on is the box's fault.
    std::string last = entry_name(page.back().as_object());
    if (after && last <= *after) throw std::invalid_argument("fs.list pages that do not go on past " + last);
    after = std::move(last);
  }
}

base::Result<json::object> Session::download(json::object req, const std::string& local_path) {
  return transfer(std::move(req), local_path, false);
}

base::Result<json::object> Session::upload(json::object req, const std::string& local_path) {
  return transfer(std::move(req), local_path, true);
}

// A download: `req`'s reply, then binary frames written to the local file. An upload: the
// local file in 1 MiB binary frames after `req` (its id in their headers), the reply after the
// last. Over sdk/cpp's transfer_file (Boost.Beast), not the Client the other commands use:
// libwebsockets' client took a download at ~130 MiB/s here. SIGINT and SIGTERM still arrive on
// the loop, run between the transfer's steps.
base::Result<json::object> Session::transfer(json::object req, const std::string& local_path, bool upload) {
  std::vector<LocalTransfer> one;
  one.push_back({std::move(req), local_path, upload});
  auto r = transfer_batch(std::move(one));
  return std::move(r.front());
}

std::vector<base::Result<json::object>> Session::transfer_batch(std::vector<LocalTransfer> batch) {
  auto local_error = [](const std::string& msg) { return base::fail(msg, "local"); };
  std::vector<os::UniqueFd> fds(batch.size());
  std::vector<sdk::FileTransfer> ts;
  std::optional<base::Error> unopened;  // an upload's file that could not be opened: the batch ends before it
  bool interrupted = false;
  for (size_t i = 0; i < batch.size() && !unopened; ++i) {
    auto& b = batch[i];
    name_by_bytes(b.req);
    if (auto e = not_text(b.req)) {
      unopened = *e;
      break;
    }
    sdk::FileTransfer t{.box = endpoint_, .request = std::move(b.req), .upload = b.upload};
    if (b.upload) {
      // O_NONBLOCK: a FIFO at the path does not hold the open; it is refused below.
      fds[i].reset(b.fd >= 0 ? ::fcntl(b.fd, F_DUPFD_CLOEXEC, 0)
                             : ::open(b.local_path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
      struct stat st {};
      if (!fds[i] || ::fstat(fds[i].get(), &st) != 0) {
        unopened = local_error(b.local_path + ": " + os::last_error().message());
        break;
      }
      if (!S_ISREG(st.st_mode)) {
        unopened = local_error(b.local_path + ": not a regular file");
        break;
      }
      t.fd = fds[i].get();
      t.size = static_cast<uint64_t>(st.st_size);
      if (t.request.contains("size")) t.request["size"] = t.size;
    } else {
      int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (b.fresh ? O_EXCL | O_NOFOLLOW : O_TRUNC);
      t.open_sink = [&fds, i, flags, path = b.local_path, fd = b.fd] {
        if (fd >= 0 && ::ftruncate(fd, 0) == 0)
          fds[i].reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
        else if (fd < 0)
          fds[i].reset(::open(path.c_str(), flags, 0644));
        return fds[i].get();
      };
    }
    t.interrupted = [&] {
      uv_run(&loop_, UV_RUN_NOWAIT);
      return interrupted;
    };
    ts.push_back(std::move(t));
  }
  std::vector<base::Result<json::object>> out;
  if (!ts.empty()) {
    auto interrupt = std::exchange(on_interrupt_, [&] { interrupted = true; });
    // Referenced while the transfer runs: a loop with nothing alive returns from a UV_RUN_NOWAIT
    // without polling, and the signals would wait in its pipe.
    for (auto* h : {&sigint_, &sigterm_}) uv_ref(reinterpret_cast<uv_handle_t*>(h));
    out = sdk::transfer_files(std::move(ts));
    for (auto* h : {&sigint_, &sigterm_}) uv_unref(reinterpret_cast<uv_handle_t*>(h));
    on_interrupt_ = std::move(interrupt);
  }
  for (size_t i = 0; i < out.size(); ++i) out[i] = transfer_result(std::move(out[i]), batch[i].local_path);
  if (unopened && out.size() == ts.size() && (out.empty() || out.back())) out.push_back(*unopened);
  return out;
}

base::Result<json::object> Session::transfer_result(base::Result<json::object> r, const std::string& local_path) {
  if (!r) {
    auto e = r.error();
    if (e.code == "connect") e.message = "connect to " + url() + ": " + e.message;
    if (auto colon = e.message.find(": "); e.code == "local" && colon != std::string::npos) {
      // "open: R" -> "PATH: R" (as the upload's open says it), "write: R" -> "write PATH: R".
      std::string verb = e.message.substr(0, colon);
      e.message = (verb == "open" ? "" : verb + " ") + local_path + ": " + e.message.substr(colon + 2);
    }
    return e;
  }
  if (!reply_ok(*r)) return reply_error(*r);
  return r;
}

}  // namespace sbx::cli
