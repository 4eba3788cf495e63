// sandboxer cp SRC DST: one file into or out of a box; one side is URL:PATH
// (ws://127.0.0.1:7000:/workspace/file), the other a local path. fs.read and fs.write move it in
// binary frames (session.hpp).
#include "cli/commands.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

int cmd_cp(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer cp SRC DST (one side URL:PATH)"}));
  a.expect_positionals(2);
  const auto& from = a.positionals()[0];
  const auto& to = a.positionals()[1];
  auto src = split_remote(from), dst = split_remote(to);
  if (src.has_value() == dst.has_value()) throw UsageError("one of SRC and DST is URL:PATH, the other a local path");
  Session s("cp", src ? src->url : dst->url, a);
  auto r = src ? s.download({{"op", "fs.read"}, {"path", src->path}}, to)
               : s.upload({{"op", "fs.write"}, {"path", dst->path}}, from);
  if (r) return kExitOk;
  return s.fail(r.error(), src ? "download " + from : "upload to " + to);
}

}  // namespace sbx::cli
