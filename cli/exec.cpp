// sandboxer exec URL [-i] [-t] [--proc ID] [--cwd DIR] [--env K=V]... -- CMD...
// Runs CMD in the box (op exec) and streams its output here; exits with its status: its code,
// 128 + the signal that ended it, 127 when it could not start, 126 when the box refused it, 255
// when the connection ended first. -i forwards stdin, its end too; -t asks for a terminal (when
// stdin is one), puts this one in raw mode and passes its size on as it changes.
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <string>

#include "base/encoding.hpp"
#include "cli/commands.hpp"
#include "cli/session.hpp"
#include "os/sys.hpp"
#include "protocol/protocol.hpp"

namespace sbx::cli {

namespace json = boost::json;
using sdk::Client;

namespace {

ArgSpec exec_spec() {
  return remote_spec({.usage = "usage: sandboxer exec URL [-it] -- CMD...",
                      .flags = {"-i", "-t"},
                      .options = {"--proc", "--cwd", "--env"},
                      .max_positionals = 1,
                      .command = CommandStart::after_positionals});
}

struct ExecOptions {
  std::string proc, cwd;
  bool interactive = false, tty = false;
  std::vector<std::pair<std::string, std::string>> env;  // in the order given, the last of a name kept
  std::vector<std::string> argv;
};

ExecOptions exec_options(const Args& a) {
  ExecOptions o;
  o.interactive = a.has("-i");
  o.tty = a.has("-t");
  o.proc = a.value_or("--proc", "");
  o.cwd = a.value_or("--cwd", "");
  for (auto& kv : a.values("--env")) {
    auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) throw UsageError("--env " + kv + ": expected NAME=VALUE");
    std::string name = kv.substr(0, eq);
    if (base::utf8_valid_prefix(name) != name.size())
      throw UsageError("--env " + base::utf8_lossy(name) + ": the name is not UTF-8 (its value may be any bytes)");
    std::erase_if(o.env, [&](const auto& e) { return e.first == name; });
    o.env.emplace_back(name, kv.substr(eq + 1));
  }
  for (auto& word : a.command()) o.argv.emplace_back(word);
  if (a.positionals().empty() || o.argv.empty()) throw UsageError(a.usage());
  if (o.proc.empty()) o.proc = "exec-" + os::random_hex(4);
  if (o.tty && !::isatty(0)) o.tty = false;  // no terminal here: plain pipes
  return o;
}

// This terminal's size, if stdin is one.
bool terminal_size(int& cols, int& rows) {
  struct winsize ws {};
  if (::ioctl(0, TIOCGWINSZ, &ws) != 0 || !ws.ws_col) return false;
  cols = ws.ws_col;
  rows = ws.ws_row;
  return true;
}

json::object exec_request(const ExecOptions& o) {
  json::object req{{"op", "exec"}, {"proc", o.proc}, {"tty", o.tty}, {"stdin", o.interactive}};
  // The command, its environment's values and its directory are bytes: each goes as text where it
  // is UTF-8, else as its bytes in the field's _b64 twin (protocol README).
  protocol::put_list_text_or_b64(req, "argv", o.argv);
  if (!o.env.empty()) {
    bool text = std::all_of(o.env.begin(), o.env.end(),
                            [](const auto& e) { return base::utf8_valid_prefix(e.second) == e.second.size(); });
    json::object env;
    for (auto& [name, value] : o.env) env[name] = text ? value : base::base64_encode(value);
    req[text ? "env" : "env_b64"] = std::move(env);
  }
  if (!o.cwd.empty()) protocol::put_text_or_b64(req, "cwd", o.cwd);
  if (o.tty) {
    int cols = 80, rows = 24;
    terminal_size(cols, rows);
    req["cols"] = cols;
    req["rows"] = rows;
  }
  return req;
}

// Our stdin to the remote process as `stdin` requests (its end as eof), and with a terminal,
// raw mode here and each SIGWINCH as a `resize`.
class StdinForwarder {
 public:
  StdinForwarder(uv_loop_t* loop, Client& c, std::string proc) : loop_(loop), client_(c), proc_(std::move(proc)) {}

  void start(bool tty) {
    if (tty) {
      uv_tty_init(loop_, &tty_, 0, 1);
      uv_tty_set_mode(&tty_, UV_TTY_MODE_RAW);
      raw_ = true;
      in_ = reinterpret_cast<uv_stream_t*>(&tty_);
      uv_signal_init(loop_, &winch_);
      winch_.data = this;
      uv_signal_start(&winch_, on_winch, SIGWINCH);
      uv_unref(reinterpret_cast<uv_handle_t*>(&winch_));
      winching_ = true;
    } else {
      // A regular file or a device (`< file`, `< /dev/null`) cannot be polled: epoll refuses it,
      // and libuv aborted on the read's start. Read by the loop's thread pool instead.
      struct stat st {};
      if (::fstat(0, &st) == 0 && !S_ISFIFO(st.st_mode) && !S_ISSOCK(st.st_mode)) {
        file_.data = this;
        read_file();
        return;
      }
      uv_pipe_init(loop_, &pipe_, 0);
      uv_pipe_open(&pipe_, 0);
      in_ = reinterpret_cast<uv_stream_t*>(&pipe_);
    }
    in_->data = this;
    uv_read_start(in_, on_alloc, on_read);
  }

  /// No more input; the terminal back as it was.
  void stop() {
    if (raw_) uv_tty_reset_mode();
    if (in_) uv_read_stop(in_);
    stopped_ = true;
  }

  /// After the loop has run: the handles closed (the loop runs once more for that; a file read
  /// under way is waited for).
  void close() {
    if (raw_) uv_tty_reset_mode();
    stopped_ = true;
    if (in_) uv_close(reinterpret_cast<uv_handle_t*>(in_), nullptr);
    if (winching_) uv_close(reinterpret_cast<uv_handle_t*>(&winch_), nullptr);
    uv_run(loop_, UV_RUN_NOWAIT);
    while (file_reading_) uv_run(loop_, UV_RUN_ONCE);
  }

 private:
  // One `stdin` request: bytes, or the input's end.
  void send_input(std::string_view data) {
    client_.request({{"op", "stdin"}, {"proc", proc_}, {"data_b64", base::base64_encode(data)}});
  }
  void send_eof() { client_.request({{"op", "stdin"}, {"proc", proc_}, {"eof", true}}); }

  void read_file() {
    uv_buf_t b = uv_buf_init(buf_.data(), static_cast<unsigned>(buf_.size()));
    file_reading_ = uv_fs_read(loop_, &file_, 0, &b, 1, -1, on_file_read) == 0;
    if (!file_reading_) send_eof();
  }

  static void on_file_read(uv_fs_t* r) {
    auto* self = static_cast<StdinForwarder*>(r->data);
    ssize_t n = r->result;
    uv_fs_req_cleanup(r);
    self->file_reading_ = false;
    if (self->stopped_) return;
    if (n > 0) {
      self->send_input({self->buf_.data(), static_cast<size_t>(n)});
      self->read_file();
    } else {
      self->send_eof();
    }
  }

  static void on_alloc(uv_handle_t* h, size_t, uv_buf_t* b) {
    auto* self = static_cast<StdinForwarder*>(h->data);
    *b = uv_buf_init(self->buf_.data(), static_cast<unsigned>(self->buf_.size()));
  }

  static void on_read(uv_stream_t* s, ssize_t n, const uv_buf_t* b) {
    auto* self = static_cast<StdinForwarder*>(s->data);
    if (n > 0) {
      self->send_input({b->base, static_cast<size_t>(n)});
    } else if (n < 0) {
      uv_read_stop(s);
      self->send_eof();
    }
  }

  static void on_winch(uv_signal_t* s, int) {
    auto* self = static_cast<StdinForwarder*>(s->data);
    int cols = 0, rows = 0;
    if (!terminal_size(cols, rows)) return;
    self->client_.request({{"op", "resize"}, {"proc", self->proc_}, {"cols", cols}, {"rows", rows}});
  }

  uv_loop_t* loop_;
  Client& client_;
  std::string proc_;
  std::string buf_ = std::string(64 * 1024, '\0');
  uv_tty_t tty_{};
  uv_pipe_t pipe_{};
  uv_signal_t winch_{};
  uv_stream_t* in_ = nullptr;
  uv_fs_t file_{};  // stdin that is a file or a device, read by the thread pool
  bool raw_ = false, winching_ = false, file_reading_ = false, stopped_ = false;
};

std::string bytes_of(const json::object& ev) {
  if (auto* d = ev.if_contains("data")) return std::string(d->as_string());
  std::string raw;
  if (auto* b = ev.if_contains("data_b64")) base::base64_decode(b->as_string(), raw);
  return raw;
}

}  // namespace

int cmd_exec(const std::vector<std::string>& args) {
  auto a = parse_args(args, exec_spec());
  ExecOptions o = exec_options(a);
  Session s("exec", a.positionals()[0], a);
  if (auto e = not_text(exec_request(o))) {
    s.fail(*e);
    return 126;  // as any exec the box refuses
  }
  Client c(s.loop(), s.endpoint());
  StdinForwarder input(s.loop(), c, o.proc);
  int rc = 255;
  bool done = false;
  auto finish = [&](int code) {
    if (done) return;
    done = true;
    rc = code;
    input.stop();
    c.close();
  };
  c.on_close([&](int code, const std::string& reason) {
    if (!done) {
      s.report("connection closed before the process ended: " + reason + " (" + std::to_string(code) + ")");
      done = true;
      input.stop();
    }
    s.stop();
  });
  c.on_event([&](const json::object& ev, std::string_view) {
    auto* p = ev.if_contains("proc");
    if (!p || p->as_string() != o.proc) return;
    auto type = ev.at("type").as_string();
    if (type == "proc.output") {
      (void)os::write_all(ev.at("stream").as_string() == "stderr" ? 2 : 1, bytes_of(ev));
    } else if (type == "proc.exited") {
      if (auto* sig = ev.if_contains("signal"))
        finish(128 + os::parse_signal(sig->as_string()).value_or(0));
      else
        finish(static_cast<int>(ev.at("code").to_number<int64_t>()));
    }
  });
  c.connect([&](const std::string& err) {
    if (!err.empty()) {
      s.report("connect to " + s.url() + ": " + connect_error(s.url(), err));
      return s.stop();
    }
    c.request(exec_request(o), [&](const json::object& r) {
      if (!reply_ok(r)) {
        auto e = reply_error(r);
        s.fail(e);
        return finish(e.code == "spawn_failed" ? 127 : 126);
      }
      // Its output from its first byte: the events since the one before proc.started.
      uint64_t from = r.contains("started_seq") ? r.at("started_seq").to_number<uint64_t>() - 1 : 0;
      c.request({{"op", "subscribe"}, {"since", from}});
      if (o.interactive) input.start(o.tty);
    });
  });
  // Ctrl-C without a terminal of ours: passed on as INT to the remote process.
  s.on_interrupt([&] { c.request({{"op", "signal"}, {"proc", o.proc}, {"signal", "INT"}}); });
  s.run();
  input.close();
  return rc;
}

}  // namespace sbx::cli
