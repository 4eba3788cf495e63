#pragma once
// The agent channel (checkpoint/README.md, "The agent channel"): the JSON lines an agent writes to
// its own supervisor on the pipe pair named by SANDBOXER_CHANNEL_FD, and the lines it reads back.
// A request has the WebSocket API's shape, {"id", "op", ...fields}, and is read by the same parser
// and field accessors (protocol.hpp); a reply has the server's shape, {"id", "ok": true, ...} or
// {"id", "ok": false, "error": {"code", "message"}}, built with ok_reply, error_reply and
// reply_with_id. tests/protocol/channel.json holds the vectors both sides are checked against.
// Pure code: the supervisor (box.cpp) and the unit tests use it.
#include <boost/json.hpp>
#include <string>
#include <string_view>

#include "protocol/protocol.hpp"

namespace sbx::protocol {

enum class ChannelOp { whoami, event, checkpoint, fork, restore, snapshot_list, snapshot_delete };

inline constexpr int kChannelMaxFork = 64;  // copies one fork request may ask for

struct ChannelRequest {
  boost::json::value id;  // echoed in the reply; null when absent
  ChannelOp op = ChannelOp::whoami;
  std::string name;           // checkpoint, fork: the snapshot's name ("" for none)
  bool leave_running = true;  // checkpoint, fork: false ends the agent once it is saved
  int n = 0;                  // fork: how many copies, 1..kChannelMaxFork
  std::string snapshot;       // restore, snapshot.delete: the snapshot's id
  // event: the agent's event as the journal takes it: its type under "agent." (an agent cannot
  // forge the supervisor's own events) and none of the fields the journal sets (seq, ts, box,
  // branch, proc).
  boost::json::object event;
};

/// Parses one line (without its newline). Throws RequestError: bad_json, bad_request naming the
/// field, unknown_op; `id_out` is set to the request's id when it was readable.
ChannelRequest parse_channel_request(std::string_view line, boost::json::value* id_out = nullptr);

/// The op's name on the wire ("snapshot.delete").
std::string_view channel_op_name(ChannelOp op);

/// A reply (or the identity line) as written on the channel: the object, then a newline.
std::string channel_line(const boost::json::object& reply);

}  // namespace sbx::protocol
