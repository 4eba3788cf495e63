// sandboxer restore URL SNAPSHOT [--index N] [--json]: a snapshot restored in the box, as a branch
// of its own, or, with --index, as the idle box's own agent (copy N).
// The reply is reported as fork's is (fork.cpp sends its request through restore_in_box too).
#include <iostream>

#include "archive/archive.hpp"
#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

int restore_in_box(const std::string& cmd, const std::string& url, const std::string& token_file, json::object req,
                   bool as_json) {
  Session s(cmd, url, token_file);
  auto r = s.request(std::move(req));
  json::object reply = r ? *r : error_reply(r.error());
  if (as_json) std::cout << json_line(reply) << "\n";
  if (!reply_ok(reply)) {
    // Each copy that failed says why (criu's own first error line).
    if (auto* copies = reply.if_contains("copies"); copies && copies->is_array())
      for (auto& c : copies->as_array())
        if (auto* e = c.as_object().if_contains("error"); e && e->is_string())
          s.report("copy " + json::value_to<std::string>(c.at("branch")) + ": " + std::string(e->as_string()));
    return s.fail(reply);
  }
  // One line per copy: <branch> <proc>.
  if (!as_json)
    if (auto* copies = reply.if_contains("copies"))
      for (auto& c : copies->as_array()) {
        auto& o = c.as_object();
        std::cout << json::value_to<std::string>(o.at("branch")) << " "
                  << (o.contains("proc") ? json::value_to<std::string>(o.at("proc")) : std::string("main")) << "\n";
      }
  return kExitOk;
}

int cmd_restore(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer restore URL SNAPSHOT [--index N]",
                                         .flags = {"--json"},
                                         .options = {"--host", "--index"}}));
  if (a.has("--host")) throw UsageError("--host: only fork starts new boxes (restore runs in the box)");
  a.expect_positionals(2);
  std::string snap = a.positionals()[1];
  if (!archive::valid_snapshot_id(snap)) {  // a name: its id, asked of the box
    Session s("restore", a.positionals()[0], a);
    auto id = snapshot_id(s, snap);
    if (!id) return s.fail(id.error());
    snap = *id;
  }
  json::object req{{"op", "restore"}, {"snapshot", snap}};
  // --index: the box (started --idle) becomes that copy of the snapshot instead of gaining a branch.
  if (a.has("--index")) req["index"] = a.number<int>("--index", 0);
  return restore_in_box("restore", a.positionals()[0], a.value_or("--token-file", ""), std::move(req), a.has("--json"));
}

}  // namespace sbx::cli
