// The ops on processes: exec, stdin, signal, resize (server-ops.hpp).
#include <optional>
#include <string>

#include "base/encoding.hpp"
#include "os/sys.hpp"
#include "protocol/protocol.hpp"
#include "supervisor/server-ops.hpp"

namespace sbx::supervisor {

namespace json = boost::json;
using protocol::RequestError;

namespace {

// exec's `env` (an object of strings) or `env_b64` (the same, each value's bytes in base64), one
// of the two, as KEY=VALUE entries.
std::vector<std::string> exec_env(const json::object& f) {
  const auto* b64 = protocol::b64_twin(f, "env");
  const char* name = b64 ? "env_b64" : "env";
  const json::value* env = b64 ? b64 : f.if_contains("env");
  if (env && env->is_null()) env = nullptr;
  std::vector<std::string> out;
  if (!env) return out;
  if (!env->is_object())
    throw RequestError("bad_request", std::string("field ") + name + ": expected an object of strings");
  for (auto& kv : env->as_object()) {
    std::string key(kv.key());
    if (!kv.value().is_string())
      throw RequestError("bad_request", std::string("field ") + name + "." + key + ": expected a string");
    if (key.empty() || key.find('=') != std::string::npos)
      throw RequestError("bad_request", std::string("field ") + name + ": a name is not empty and has no '='");
    std::string value(kv.value().as_string());
    if (b64 && !base::base64_decode(kv.value().as_string(), value))
      throw RequestError("bad_request", "field env_b64." + key + ": not valid base64");
    if (value.find('\0') != std::string::npos || key.find('\0') != std::string::npos)
      throw RequestError("bad_request", std::string("field ") + name + "." + key + ": contains a NUL byte");
    out.push_back(key + "=" + value);
  }
  return out;
}

// exec's fields as an ExecSpec, each checked with the reason a refusal names.
ExecSpec exec_spec(const json::object& f) {
  ExecSpec spec;
  spec.proc = protocol::need_string(f, "proc");
  if (spec.proc.empty() || spec.proc.size() > 128) throw RequestError("bad_request", "field proc: 1 to 128 characters");
  for (unsigned char ch : spec.proc)
    if (ch < 0x21 || ch == 0x7f) throw RequestError("bad_request", "field proc: no spaces or control characters");
  spec.argv = protocol::need_path_list(f, "argv");
  if (spec.argv.empty()) throw RequestError("bad_request", "field argv: empty");
  for (auto& a : spec.argv)
    if (a.find('\0') != std::string::npos) throw RequestError("bad_request", "field argv: contains a NUL byte");
  spec.env = exec_env(f);
  spec.cwd = protocol::opt_path(f, "cwd").value_or("");
  if (spec.cwd.find('\0') != std::string::npos) throw RequestError("bad_request", "field cwd: contains a NUL byte");
  spec.tty = protocol::opt_bool(f, "tty").value_or(false);
  spec.stdin_open = protocol::opt_bool(f, "stdin").value_or(false);
  spec.cols = static_cast<int>(protocol::opt_int(f, "cols", 1, 10000).value_or(80));
  spec.rows = static_cast<int>(protocol::opt_int(f, "rows", 1, 10000).value_or(24));
  spec.branch = protocol::opt_string(f, "branch").value_or("main");
  return spec;
}

// signal's `signal`: a name ("TERM", "SIGTERM") or a number 1..64.
int signal_number(const json::object& f) {
  auto* s = f.if_contains("signal");
  if (!s) throw RequestError("bad_request", "field signal: missing");
  std::optional<int> sig;
  if (s->is_string())
    sig = os::parse_signal(s->as_string());
  else if (s->is_int64() && s->as_int64() > 0 && s->as_int64() < 65)
    sig = static_cast<int>(s->as_int64());
  else if (s->is_uint64() && s->as_uint64() < 65)
    sig = static_cast<int>(s->as_uint64());
  if (!sig) throw RequestError("bad_request", "field signal: expected a signal name (\"TERM\") or number (1-64)");
  return *sig;
}

}  // namespace

void op_exec(OpContext& ctx) {
  // The reply comes once the process has started (or failed to): the box calls back.
  auto send = ctx.sender();
  json::value id = ctx.req.id;
  ctx.box.exec(exec_spec(ctx.fields()), [send, id](std::optional<OpError> err, json::object st) {
    if (err) {
      auto e = protocol::error_reply(id, err->code, err->message);
      if (!st.empty()) e["state"] = std::move(st);
      return send(e);
    }
    auto reply = protocol::ok_reply(id);
    for (auto& kv : st) reply[kv.key()] = kv.value();
    send(reply);
  });
}

void op_stdin(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto proc = protocol::need_string(f, "proc");
  std::string data;
  if (auto d = protocol::opt_string(f, "data")) data = *d;
  if (auto b = protocol::opt_string(f, "data_b64")) {
    if (!base::base64_decode(*b, data)) throw RequestError("bad_request", "field data_b64: not valid base64");
  }
  bool eof = protocol::opt_bool(f, "eof").value_or(false);
  if (auto e = ctx.box.proc_stdin(proc, protocol::opt_string(f, "branch"), data, eof))
    throw RequestError(e->code, e->message);
  ctx.reply(ctx.ok());
}

void op_signal(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto proc = protocol::need_string(f, "proc");
  int sig = signal_number(f);
  if (auto e = ctx.box.proc_signal(proc, protocol::opt_string(f, "branch"), sig))
    throw RequestError(e->code, e->message);
  ctx.reply(ctx.ok());
}

void op_resize(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto proc = protocol::need_string(f, "proc");
  auto cols = protocol::opt_int(f, "cols", 1, 10000);
  auto rows = protocol::opt_int(f, "rows", 1, 10000);
  if (!cols || !rows) throw RequestError("bad_request", "fields cols and rows: both required");
  if (auto e = ctx.box.proc_resize(proc, protocol::opt_string(f, "branch"), static_cast<int>(*cols),
                                   static_cast<int>(*rows)))
    throw RequestError(e->code, e->message);
  ctx.reply(ctx.ok());
}

}  // namespace sbx::supervisor
