#include "protocol/channel.hpp"

#include <array>
#include <utility>

#include "base/encoding.hpp"

namespace sbx::protocol {

namespace json = boost::json;

namespace {

constexpr std::array<std::pair<std::string_view, ChannelOp>, 7> kOps{{
    {"whoami", ChannelOp::whoami},
    {"event", ChannelOp::event},
    {"checkpoint", ChannelOp::checkpoint},
    {"fork", ChannelOp::fork},
    {"restore", ChannelOp::restore},
    {"snapshot.list", ChannelOp::snapshot_list},
    {"snapshot.delete", ChannelOp::snapshot_delete},
}};

ChannelOp op_of(std::string_view name) {
  for (auto& [n, op] : kOps)
    if (n == name) return op;
  std::string known;
  for (auto& [n, op] : kOps) known += (known.empty() ? "" : ", ") + std::string(n);
  throw RequestError("unknown_op", "unknown op \"" + std::string(name) + "\" (known: " + known + ")");
}

json::object agent_event(const json::object& f) {
  auto* v = f.if_contains("event");
  if (!v) throw RequestError("bad_request", "field event: missing");
  if (!v->is_object()) throw RequestError("bad_request", "field event: expected an object");
  json::object ev = v->as_object();
  auto* t = ev.if_contains("type");
  std::string type = t && t->is_string() ? std::string(t->as_string()) : "event";
  if (!type.starts_with("agent.")) type = "agent." + type;
  for (const char* k : {"seq", "ts", "box", "branch", "proc"}) ev.erase(k);
  ev["type"] = type;
  return ev;
}

}  // namespace

ChannelRequest parse_channel_request(std::string_view line, json::value* id_out) {
  auto req = parse_request(line, id_out);
  const auto& f = req.fields;
  ChannelRequest r;
  r.id = req.id;
  r.op = op_of(req.op);
  switch (r.op) {
    case ChannelOp::whoami:
    case ChannelOp::snapshot_list:
      break;
    case ChannelOp::event:
      r.event = agent_event(f);
      break;
    case ChannelOp::fork: {
      auto n = opt_int(f, "n", 1, kChannelMaxFork);
      if (!n)
        throw RequestError("bad_request",
                           "field n: missing (fork needs 1.." + std::to_string(kChannelMaxFork) + " copies)");
      r.n = static_cast<int>(*n);
      [[fallthrough]];
    }
    case ChannelOp::checkpoint:
      r.name = opt_string(f, "name").value_or("");
      r.leave_running = opt_bool(f, "leave_running").value_or(true);
      break;
    case ChannelOp::restore:
    case ChannelOp::snapshot_delete:
      // The snapshot is named by `snapshot`: a field `id` is the request's own id.
      r.snapshot = need_string(f, "snapshot");
      break;
  }
  return r;
}

std::string_view channel_op_name(ChannelOp op) {
  for (auto& [n, o] : kOps)
    if (o == op) return n;
  return "?";
}

std::string channel_line(const json::object& reply) { return base::json_text(reply) + "\n"; }

}  // namespace sbx::protocol
