// The ops about the connection and the box as a whole: auth, ping, subscribe, unsubscribe, stats,
// shutdown (server-ops.hpp).
#include <cstdint>
#include <deque>

#include "protocol/protocol.hpp"
#include "supervisor/server-ops.hpp"
#include "supervisor/stats.hpp"

namespace sbx::supervisor {

using protocol::RequestError;

void op_auth(OpContext& ctx) {
  // An authenticated client may send auth again: a wrong token is refused, the connection stays.
  auto token = protocol::opt_string(ctx.fields(), "token");
  if (!token || !ctx.token_ok(*token)) throw RequestError("unauthorized", "wrong token");
  ctx.reply(ctx.ok());
}

void op_ping(OpContext& ctx) {
  auto ok = ctx.ok();
  ok["pong"] = true;
  ctx.reply(ok);
}

void op_subscribe(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto since = protocol::opt_int(f, "since", 0, INT64_MAX).value_or(0);
  auto branch = protocol::opt_string(f, "branch");
  if (branch && !ctx.box.has_branch(*branch)) throw RequestError("no_such_branch", "no branch named " + *branch);
  auto ok = ctx.ok();
  ok["last_seq"] = ctx.box.journal().last_seq();
  ctx.reply(ok);
  Client& c = ctx.client;
  c.subscribed = true;
  c.branch = branch;
  c.cursor = static_cast<uint64_t>(since);
  c.live = c.cursor >= ctx.box.journal().last_seq();
  if (!c.live) ctx.wake();  // the replay from disk runs from the writable callback
}

void op_unsubscribe(OpContext& ctx) {
  // Stop at once: the events still queued are dropped (replies and file data stay), so the reply
  // is the next frame the client reads and no event follows it.
  auto& c = ctx.client;
  c.subscribed = false;
  c.live = false;
  std::erase_if(c.q, [&c](const OutFrame& f) {
    if (f.seq) c.q_bytes -= f.size();
    return f.seq != 0;
  });
  ctx.reply(ctx.ok());
}

void op_stats(OpContext& ctx) {
  auto ok = ctx.ok();
  auto st = collect_stats(ctx.box, nullptr);
  for (auto& kv : st) ok[kv.key()] = kv.value();
  ok["last_seq"] = ctx.box.journal().last_seq();
  ctx.reply(ok);
}

void op_shutdown(OpContext& ctx) {
  int64_t grace =
      protocol::opt_duration_ms(ctx.fields(), "grace").value_or(ctx.box.options().profile.resources.grace_ms);
  ctx.reply(ctx.ok());
  ctx.box.stop(grace);
}

}  // namespace sbx::supervisor
