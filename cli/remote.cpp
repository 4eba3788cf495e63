// The commands that talk to a box over its WebSocket (sdk/cpp):
//   sandboxer attach URL [--since N] [--branch B] [--json]
//   sandboxer exec URL [-i] [-t] [--proc ID] [--cwd DIR] [--env K=V]... -- CMD...
//   sandboxer cp SRC DST            (either side URL:PATH)
//   sandboxer export URL SNAPSHOT FILE, sandboxer import URL FILE
//   sandboxer stats URL [--json]
// Each takes --token-file FILE; else SANDBOXER_TOKEN; else the token stored for URL.
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <sandboxer/client.hpp>
#include <map>
#include <set>
#include <stdexcept>

#include "archive/archive.hpp"
#include "cli/commands.hpp"
#include "base/encoding.hpp"
#include "os/sys.hpp"
#include "cli/printer.hpp"
#include "cli/tokens.hpp"

namespace sbx::cli {

namespace json = boost::json;
using sdk::Client;
using sdk::Endpoint;

namespace {

// One loop per command, with SIGINT/SIGTERM as loop events.
struct Loop {
  uv_loop_t loop;
  uv_signal_t sigint, sigterm;
  std::function<void()> on_interrupt;
  Loop() {
    uv_loop_init(&loop);
    for (auto* s : {&sigint, &sigterm}) {
      uv_signal_init(&loop, s);
      s->data = this;
      uv_unref(reinterpret_cast<uv_handle_t*>(s));
    }
    auto cb = [](uv_signal_t* s, int) {
      auto* self = static_cast<Loop*>(s->data);
      if (self->on_interrupt) self->on_interrupt();
      else uv_stop(s->loop);
    };
    uv_signal_start(&sigint, cb, SIGINT);
    uv_signal_start(&sigterm, cb, SIGTERM);
  }
  void run() { uv_run(&loop, UV_RUN_DEFAULT); }
  ~Loop() {
    uv_close(reinterpret_cast<uv_handle_t*>(&sigint), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&sigterm), nullptr);
    uv_run(&loop, UV_RUN_NOWAIT);
    uv_loop_close(&loop);
  }
};

Endpoint endpoint(const std::string& url, const std::string& token_file) {
  Endpoint ep{url, find_token(url, token_file)};
  ep.insecure = std::getenv("SANDBOXER_INSECURE") != nullptr;
  sdk::parse_url(url);  // fails early with a clear message
  return ep;
}

std::string error_text(const json::object& r) {
  if (auto* e = r.if_contains("error"); e && e->is_object()) {
    auto& o = e->as_object();
    return std::string(o.at("message").as_string()) + " (" + std::string(o.at("code").as_string()) + ")";
  }
  return json::serialize(r);
}

std::string bytes_of(const json::object& ev) {
  if (auto* d = ev.if_contains("data")) return std::string(d->as_string());
  std::string raw;
  if (auto* b = ev.if_contains("data_b64")) base::base64_decode(b->as_string(), raw);
  return raw;
}

void write_fd(int fd, std::string_view s) { (void)os::write_all(fd, s); }

}  // namespace

int cmd_attach(const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  std::string url;
  uint64_t since = 0;
  std::optional<std::string> branch;
  bool as_json = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--json") as_json = true;
    else if (args[i] == "--since" && i + 1 < args.size()) since = std::stoull(args[++i]);
    else if (args[i] == "--branch" && i + 1 < args.size()) branch = args[++i];
    else if (args[i].starts_with("-")) throw std::invalid_argument("unknown option " + args[i]);
    else if (url.empty()) url = args[i];
    else throw std::invalid_argument("unexpected argument " + args[i]);
  }
  if (url.empty()) throw std::invalid_argument("usage: sandboxer attach URL [--since N] [--branch B] [--json]");
  Loop l;
  EventPrinter printer(as_json);
  int rc = 0;
  sdk::Subscription sub(
      &l.loop, endpoint(url, token_file), since, branch,
      [&](const json::object& ev, std::string_view line) { printer.print(line, ev); },
      [&](int code, const std::string& reason) {
        if (code != 1000 && code != 1001) {
          std::cerr << "sandboxer attach: " << url << ": " << reason << " (" << code << ")\n";
          rc = 1;
        }
        uv_stop(&l.loop);
      });
  l.on_interrupt = [&] { uv_stop(&l.loop); };
  l.run();
  return rc;
}

int cmd_exec(const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  std::string url, proc, cwd;
  bool interactive = false, tty = false;
  json::object env;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "-i") interactive = true;
    else if (a == "-t") tty = true;
    else if (a == "-it" || a == "-ti") interactive = tty = true;
    else if (a == "--proc" && i + 1 < args.size()) proc = args[++i];
    else if (a == "--cwd" && i + 1 < args.size()) cwd = args[++i];
    else if (a == "--env" && i + 1 < args.size()) {
      std::string kv = args[++i];
      auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) throw std::invalid_argument("--env " + kv + ": expected NAME=VALUE");
      env[kv.substr(0, eq)] = kv.substr(eq + 1);
    } else if (a.starts_with("-")) throw std::invalid_argument("unknown option " + a);
    else if (url.empty()) url = a;
    else break;
  }
  json::array argv;
  for (; i < args.size(); ++i) argv.emplace_back(args[i]);
  if (url.empty() || argv.empty()) throw std::invalid_argument("usage: sandboxer exec URL [-it] -- CMD...");
  if (proc.empty()) proc = "exec-" + os::random_hex(4);
  if (tty && !::isatty(0)) tty = false;  // no terminal here: plain pipes

  Loop l;
  Client c(&l.loop, endpoint(url, token_file));
  int rc = 255;
  bool done = false;
  uv_tty_t in_tty;
  uv_pipe_t in_pipe;
  uv_stream_t* in = nullptr;
  uv_signal_t winch;
  bool raw = false;
  std::string buf(64 * 1024, '\0');
  auto finish = [&](int code) {
    if (done) return;
    done = true;
    rc = code;
    if (raw) uv_tty_reset_mode();
    if (in) uv_read_stop(in);
    c.close();
  };
  auto winsize = [](int& cols, int& rows) {
    struct winsize ws {};
    if (::ioctl(0, TIOCGWINSZ, &ws) == 0 && ws.ws_col) {
      cols = ws.ws_col;
      rows = ws.ws_row;
    }
  };
  c.on_close([&](int code, const std::string& reason) {
    if (!done) {
      std::cerr << "sandboxer exec: connection closed before the process ended: " << reason << " (" << code << ")\n";
      done = true;
      if (raw) uv_tty_reset_mode();
    }
    uv_stop(&l.loop);
  });
  c.on_event([&](const json::object& ev, std::string_view) {
    auto* p = ev.if_contains("proc");
    if (!p || p->as_string() != proc) return;
    auto type = ev.at("type").as_string();
    if (type == "proc.output") {
      write_fd(ev.at("stream").as_string() == "stderr" ? 2 : 1, bytes_of(ev));
    } else if (type == "proc.exited") {
      if (auto* s = ev.if_contains("signal")) finish(128 + os::parse_signal(s->as_string()).value_or(0));
      else finish(static_cast<int>(ev.at("code").to_number<int64_t>()));
    }
  });
  c.connect([&](const std::string& err) {
    if (!err.empty()) {
      std::cerr << "sandboxer exec: connect to " << url << ": " << err << "\n";
      uv_stop(&l.loop);
      return;
    }
    json::object req{{"op", "exec"}, {"proc", proc}, {"argv", argv}, {"tty", tty}, {"stdin", interactive}};
    if (!env.empty()) req["env"] = env;
    if (!cwd.empty()) req["cwd"] = cwd;
    if (tty) {
      int cols = 80, rows = 24;
      winsize(cols, rows);
      req["cols"] = cols;
      req["rows"] = rows;
    }
    c.request(req, [&](const json::object& r) {
      if (!r.at("ok").as_bool()) {
        std::cerr << "sandboxer exec: " << error_text(r) << "\n";
        auto code = r.at("error").at("code").as_string();
        return finish(code == "spawn_failed" ? 127 : 126);
      }
      uint64_t from = r.contains("started_seq") ? r.at("started_seq").to_number<uint64_t>() - 1 : 0;
      c.request({{"op", "subscribe"}, {"since", from}});
      if (interactive) {
        if (tty) {
          uv_tty_init(&l.loop, &in_tty, 0, 1);
          uv_tty_set_mode(&in_tty, UV_TTY_MODE_RAW);
          raw = true;
          in = reinterpret_cast<uv_stream_t*>(&in_tty);
          uv_signal_init(&l.loop, &winch);
          winch.data = &c;
          uv_signal_start(
              &winch,
              [](uv_signal_t* s, int) {
                struct winsize ws {};
                if (::ioctl(0, TIOCGWINSZ, &ws) != 0) return;
                auto* cl = static_cast<Client*>(s->data);
                cl->request({{"op", "resize"}, {"proc", std::string(static_cast<const char*>(s->loop->data))},
                             {"cols", ws.ws_col}, {"rows", ws.ws_row}});
              },
              SIGWINCH);
          uv_unref(reinterpret_cast<uv_handle_t*>(&winch));
        } else {
          uv_pipe_init(&l.loop, &in_pipe, 0);
          uv_pipe_open(&in_pipe, 0);
          in = reinterpret_cast<uv_stream_t*>(&in_pipe);
        }
        in->data = &c;
        l.loop.data = proc.data();
        uv_read_start(
            in, [](uv_handle_t* h, size_t, uv_buf_t* b) {
              static char space[64 * 1024];
              (void)h;
              *b = uv_buf_init(space, sizeof space);
            },
            [](uv_stream_t* s, ssize_t n, const uv_buf_t* b) {
              auto* cl = static_cast<Client*>(s->data);
              std::string id = static_cast<const char*>(s->loop->data);
              if (n > 0) {
                cl->request({{"op", "stdin"}, {"proc", id}, {"data_b64", base::base64_encode({b->base, static_cast<size_t>(n)})}});
              } else if (n < 0) {
                uv_read_stop(s);
                cl->request({{"op", "stdin"}, {"proc", id}, {"eof", true}});
              }
            });
      }
    });
  });
  (void)buf;
  l.on_interrupt = [&] {
    // Ctrl-C without a terminal of ours: pass it on as INT to the remote process.
    c.request({{"op", "signal"}, {"proc", proc}, {"signal", "INT"}});
  };
  l.run();
  if (raw) uv_tty_reset_mode();
  if (in) uv_close(reinterpret_cast<uv_handle_t*>(in), nullptr);
  if (tty && interactive) uv_close(reinterpret_cast<uv_handle_t*>(&winch), nullptr);
  uv_run(&l.loop, UV_RUN_NOWAIT);
  return rc;
}

namespace {

struct Remote {
  std::string url, path;
};

// "ws://HOST:PORT:PATH" (or wss://...) -> url and path; nullopt for a local path.
std::optional<Remote> split_remote(const std::string& s) {
  if (!s.starts_with("ws://") && !s.starts_with("wss://")) return std::nullopt;
  size_t after = s.find("://") + 3;
  size_t colon = s.find(':', after);
  if (colon == std::string::npos) throw std::invalid_argument(s + ": expected URL:PATH, e.g. ws://127.0.0.1:7000:/workspace/file");
  size_t end = colon + 1;
  while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
  if (end == colon + 1 || end >= s.size() || s[end] != ':')
    throw std::invalid_argument(s + ": expected URL:PATH, e.g. ws://127.0.0.1:7000:/workspace/file");
  return Remote{s.substr(0, end), s.substr(end + 1)};
}

}  // namespace

namespace {

// One file over the WebSocket. A download: `req`'s reply, then binary frames written to `local`
// (created or truncated). An upload: `local` in 1 MiB binary frames after `req` (its id in their
// headers), the reply after the last. Returns that reply, or an error object when the
// connection or a local file failed first.
json::object transfer(const std::string& url, const std::string& token_file, json::object req,
                      const std::string& local_path, bool upload) {
  Loop l;
  Client c(&l.loop, endpoint(url, token_file));
  auto error = [](const std::string& code, const std::string& msg) {
    return json::object{{"ok", false}, {"error", {{"code", code}, {"message", msg}}}};
  };
  json::object result = error("closed", "the connection closed before the transfer ended");
  bool finished = false;
  auto finish = [&](json::object r) {
    if (finished) return;
    finished = true;
    result = std::move(r);
    c.close();
  };
  c.on_close([&](int code, const std::string& reason) {
    if (!finished) result = error("closed", "the connection closed first: " + reason + " (" + std::to_string(code) + ")");
    uv_stop(&l.loop);
  });
  os::UniqueFd local;
  uint64_t sent = 0, size = 0;
  uint32_t upload_id = 0;
  json::object download_reply;
  constexpr size_t kChunk = 1 << 20;
  if (upload) {
    local.reset(::open(local_path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!local) return error("local", local_path + ": " + os::last_error().message());
    struct stat st {};
    ::fstat(local.get(), &st);
    if (!S_ISREG(st.st_mode)) return error("local", local_path + ": not a regular file");
    size = static_cast<uint64_t>(st.st_size);
    if (req.contains("size")) req["size"] = size;
  }
  // Upload: feed 1 MiB frames while less than 8 MiB waits to be sent.
  std::function<void()> pump = [&] {
    while (upload_id && sent < size && c.pending_bytes() < (8u << 20) && !finished) {
      std::string chunk(static_cast<size_t>(std::min<uint64_t>(kChunk, size - sent)), '\0');
      ssize_t n = ::pread(local.get(), chunk.data(), chunk.size(), static_cast<off_t>(sent));
      if (n <= 0)
        return finish(error("local", "read " + local_path + ": " + (n < 0 ? os::last_error().message() : "file shrank")));
      chunk.resize(static_cast<size_t>(n));
      c.send_binary(upload_id, sent, sent + chunk.size() >= size, chunk);
      sent += chunk.size();
    }
  };
  c.on_drained([&] { pump(); });
  c.on_binary([&](uint32_t, uint64_t off, bool last, std::string_view data) {
    if (::pwrite(local.get(), data.data(), data.size(), static_cast<off_t>(off)) != static_cast<ssize_t>(data.size()))
      return finish(error("local", "write " + local_path + ": " + os::last_error().message()));
    if (last) finish(download_reply);
  });
  c.connect([&](const std::string& err) {
    if (!err.empty()) {
      finished = true;
      result = error("connect", "connect to " + url + ": " + err);
      return uv_stop(&l.loop);
    }
    if (!upload) {
      local.reset(::open(local_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
      if (!local) return finish(error("local", local_path + ": " + os::last_error().message()));
      c.request(std::move(req), [&](const json::object& rep) {
        if (!rep.at("ok").as_bool()) return finish(rep);
        download_reply = rep;
      });
    } else {
      auto id = c.request(std::move(req), [&](const json::object& rep) { finish(rep); });
      upload_id = static_cast<uint32_t>(id);
      if (size == 0) c.send_binary(upload_id, 0, true, {});
      pump();
    }
  });
  l.on_interrupt = [&] { finish(error("interrupted", "interrupted")); };
  l.run();
  return result;
}

}  // namespace

int cmd_cp(const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  if (args.size() != 2) throw std::invalid_argument("usage: sandboxer cp SRC DST (one side URL:PATH)");
  auto src = split_remote(args[0]), dst = split_remote(args[1]);
  if (src.has_value() == dst.has_value())
    throw std::invalid_argument("one of SRC and DST is URL:PATH, the other a local path");
  json::object r = src ? transfer(src->url, token_file, {{"op", "fs.read"}, {"path", src->path}}, args[1], false)
                       : transfer(dst->url, token_file, {{"op", "fs.write"}, {"path", dst->path}}, args[0], true);
  if (r.at("ok").as_bool()) return 0;
  std::string what = src ? "download " + args[0] : "upload to " + args[1];
  std::cerr << "sandboxer cp: " << what << ": " << error_text(r) << "\n";
  return 1;
}

int cmd_export(const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  if (args.size() != 3 || args[0].starts_with("-")) throw std::invalid_argument("usage: sandboxer export URL SNAPSHOT FILE");
  // Into FILE.part, renamed when whole and checked: a failed export leaves no FILE behind.
  std::string part = args[2] + ".part";
  auto r = transfer(args[0], token_file, {{"op", "snapshot.export"}, {"snapshot", args[1]}}, part, false);
  if (!r.at("ok").as_bool()) {
    ::unlink(part.c_str());
    std::cerr << "sandboxer export: " << error_text(r) << "\n";
    return 1;
  }
  // The id is the start of the archive's sha256: check what arrived against it.
  auto sha = archive::sha256_file(part);
  if (!sha || "s-" + sha->substr(0, 16) != args[1]) {
    ::unlink(part.c_str());
    std::cerr << "sandboxer export: " << (sha ? "the archive received does not hash to " + args[1] : sha.error().message)
              << "\n";
    return 1;
  }
  if (::rename(part.c_str(), args[2].c_str()) != 0) {
    std::cerr << "sandboxer export: " << args[2] << ": " << os::last_error().message() << "\n";
    ::unlink(part.c_str());
    return 1;
  }
  std::cerr << "exported " << args[1] << " (" << r.at("size").to_number<uint64_t>() << " bytes) to " << args[2] << "\n";
  return 0;
}

int cmd_import(const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  bool as_json = std::erase(args, std::string("--json")) > 0;
  if (args.size() != 2 || args[0].starts_with("-")) throw std::invalid_argument("usage: sandboxer import URL FILE [--json]");
  auto r = transfer(args[0], token_file, {{"op", "snapshot.import"}, {"size", 0}}, args[1], true);
  if (!r.at("ok").as_bool()) {
    std::cerr << "sandboxer import: " << args[1] << ": " << error_text(r) << "\n";
    return 1;
  }
  if (as_json) std::cout << json::serialize(r) << "\n";
  else if (r.at("existing").as_bool()) std::cerr << "import: the box already had this snapshot\n";
  // For scripts: the snapshot id is the last line of stdout.
  std::cout << json::value_to<std::string>(r.at("snapshot")) << "\n";
  return 0;
}

int cmd_stats(const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  std::string url;
  bool as_json = false;
  for (auto& a : args) {
    if (a == "--json") as_json = true;
    else if (a.starts_with("-")) throw std::invalid_argument("unknown option " + a);
    else if (url.empty()) url = a;
    else throw std::invalid_argument("unexpected argument " + a);
  }
  if (url.empty()) throw std::invalid_argument("usage: sandboxer stats URL [--json]");
  Loop l;
  Client c(&l.loop, endpoint(url, token_file));
  int rc = 1;
  c.on_close([&](int, const std::string&) { uv_stop(&l.loop); });
  c.connect([&](const std::string& err) {
    if (!err.empty()) {
      std::cerr << "sandboxer stats: connect to " << url << ": " << err << "\n";
      return uv_stop(&l.loop);
    }
    c.request({{"op", "stats"}}, [&](const json::object& r) {
      if (!r.at("ok").as_bool()) {
        std::cerr << "sandboxer stats: " << error_text(r) << "\n";
      } else if (as_json) {
        json::object o = r;
        o.erase("id");
        o.erase("ok");
        std::cout << json::serialize(o) << "\n";
        rc = 0;
      } else {
        auto line = [](const std::string& name, const json::object& s) {
          double mib = static_cast<double>(s.at("memory").to_number<uint64_t>()) / (1 << 20);
          std::printf("%-16s cpu %8.2fs  memory %9.1f MiB  pids %4llu", name.c_str(), s.at("cpu_s").to_number<double>(), mib,
                      static_cast<unsigned long long>(s.at("pids").to_number<uint64_t>()));
          if (auto* d = s.if_contains("disk"))
            std::printf("  disk %9.1f MiB", static_cast<double>(d->to_number<uint64_t>()) / (1 << 20));
          std::printf("\n");
        };
        line("box", r.at("box").as_object());
        for (auto& kv : r.at("procs").as_object()) line("proc " + std::string(kv.key()), kv.value().as_object());
        std::fflush(stdout);
        rc = 0;
      }
      c.close();
    });
  });
  l.run();
  return rc;
}

}  // namespace sbx::cli

namespace sbx::cli {

namespace {

// Sends one request and waits for its reply; returns the reply (or an error object).
json::object one_request(const std::string& cmd, const std::string& url, const std::string& token_file,
                         json::object req) {
  Loop l;
  Client c(&l.loop, endpoint(url, token_file));
  json::object result{{"ok", false}, {"error", {{"code", "closed"}, {"message", "the connection closed first"}}}};
  c.on_close([&](int, const std::string&) { uv_stop(&l.loop); });
  c.connect([&](const std::string& err) {
    if (!err.empty()) {
      result["error"] = {{"code", "connect"}, {"message", "connect to " + url + ": " + err}};
      return uv_stop(&l.loop);
    }
    c.request(std::move(req), [&](const json::object& r) {
      result = r;
      c.close();
      uv_stop(&l.loop);
    });
  });
  l.on_interrupt = [&] { uv_stop(&l.loop); };
  l.run();
  (void)cmd;
  return result;
}

// Positional arguments and --name VALUE options of a snapshot command.
struct Args {
  std::vector<std::string> pos;
  std::map<std::string, std::string> opt;
  std::set<std::string> flags;
};
Args parse(std::vector<std::string> args, const std::set<std::string>& with_value, const std::set<std::string>& flags) {
  Args a;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& s = args[i];
    if (with_value.contains(s)) {
      if (i + 1 >= args.size()) throw std::invalid_argument(s + " needs a value");
      a.opt[s] = args[++i];
    } else if (flags.contains(s)) {
      a.flags.insert(s);
    } else if (s.starts_with("-")) {
      throw std::invalid_argument("unknown option " + s);
    } else {
      a.pos.push_back(s);
    }
  }
  return a;
}

int fail(const std::string& cmd, const json::object& r) {
  std::cerr << "sandboxer " << cmd << ": " << error_text(r) << "\n";
  return 1;
}

}  // namespace

int cmd_checkpoint(const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  auto a = parse(args, {"--name", "--branch"}, {"--leave-running", "--stop", "--json"});
  if (a.pos.size() != 1)
    throw std::invalid_argument("usage: sandboxer checkpoint URL [--name N] [--branch B] [--leave-running | --stop] [--json]");
  json::object req{{"op", "checkpoint"}, {"leave_running", !a.flags.contains("--stop")}};
  if (a.opt.contains("--name")) req["name"] = a.opt["--name"];
  if (a.opt.contains("--branch")) req["branch"] = a.opt["--branch"];
  auto r = one_request("checkpoint", a.pos[0], token_file, std::move(req));
  if (!r.at("ok").as_bool()) return fail("checkpoint", r);
  if (a.flags.contains("--json")) std::cout << json::serialize(r) << "\n";
  else if (auto* m = r.if_contains("mode")) std::cerr << "checkpoint: mode " << json::serialize(*m) << "\n";
  // For scripts: the snapshot id is the last line of stdout.
  std::cout << json::value_to<std::string>(r.at("snapshot")) << "\n";
  return 0;
}

int cmd_restore_or_fork(const std::string& cmd, const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  auto a = parse(args, {"--snapshot", "-n", "--host"}, {"--json"});
  std::string url = a.pos.empty() ? "" : a.pos[0];
  std::string snap = cmd == "restore" ? (a.pos.size() == 2 ? a.pos[1] : "") : a.opt["--snapshot"];
  if (url.empty() || snap.empty() || (cmd == "restore" && a.pos.size() != 2) || (cmd == "fork" && a.pos.size() != 1))
    throw std::invalid_argument(cmd == "restore" ? "usage: sandboxer restore URL SNAPSHOT"
                                                 : "usage: sandboxer fork URL --snapshot S -n N [--host docker]");
  if (a.opt.contains("--host")) {
    if (cmd != "fork") throw std::invalid_argument("--host: only fork starts new boxes (restore runs in the box)");
    if (a.opt["--host"] != "docker") throw std::invalid_argument("--host " + a.opt["--host"] + ": not supported here (docker)");
    return fork_on_docker(url, token_file, snap, a.opt.contains("-n") ? std::stoi(a.opt["-n"]) : 1);
  }
  json::object req{{"op", cmd}, {"snapshot", snap}};
  if (cmd == "fork") {
    int n = a.opt.contains("-n") ? std::stoi(a.opt["-n"]) : 1;
    req["n"] = n;
  }
  auto r = one_request(cmd, url, token_file, std::move(req));
  if (a.flags.contains("--json")) std::cout << json::serialize(r) << "\n";
  if (!r.at("ok").as_bool()) {
    // Each copy that failed says why (criu's own first error line).
    if (auto* copies = r.if_contains("copies"); copies && copies->is_array())
      for (auto& c : copies->as_array())
        if (auto* e = c.as_object().if_contains("error"); e && e->is_string())
          std::cerr << "sandboxer " << cmd << ": copy " << json::value_to<std::string>(c.at("branch")) << ": "
                    << e->as_string() << "\n";
    return fail(cmd, r);
  }
  // One line per copy: <branch> <proc>.
  if (!a.flags.contains("--json"))
    if (auto* copies = r.if_contains("copies"))
      for (auto& c : copies->as_array()) {
        auto& o = c.as_object();
        std::cout << json::value_to<std::string>(o.at("branch")) << " "
                  << (o.contains("proc") ? json::value_to<std::string>(o.at("proc")) : std::string("main")) << "\n";
      }
  return 0;
}

int cmd_snapshots(const std::vector<std::string>& args_in) {
  auto args = args_in;
  std::string token_file = take_token_file(args);
  auto a = parse(args, {}, {"--json"});
  if (a.pos.size() != 1) throw std::invalid_argument("usage: sandboxer snapshots URL [--json]");
  auto r = one_request("snapshots", a.pos[0], token_file, {{"op", "snapshot.list"}});
  if (!r.at("ok").as_bool()) return fail("snapshots", r);
  for (auto& s : r.at("snapshots").as_array()) std::cout << json::serialize(s) << "\n";
  return 0;
}

}  // namespace sbx::cli
