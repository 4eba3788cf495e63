// sandboxer cp SRC DST: one file into or out of a box; one side is URL:PATH
// (ws://127.0.0.1:7000:/workspace/file), the other a local path. fs.read and fs.write move it in
// binary frames (session.hpp).
#include <cctype>
#include <optional>

#include "cli/commands.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace {

struct Remote {
  std::string url, path;
};

// "ws://HOST:PORT:PATH" (or wss://...) -> url and path; nullopt for a local path.
std::optional<Remote> split_remote(const std::string& s) {
  if (!s.starts_with("ws://") && !s.starts_with("wss://")) return std::nullopt;
  const std::string bad = s + ": expected URL:PATH, e.g. ws://127.0.0.1:7000:/workspace/file";
  size_t after = s.find("://") + 3;
  size_t colon = s.find(':', after);
  if (colon == std::string::npos) throw UsageError(bad);
  size_t end = colon + 1;
  while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
  if (end == colon + 1 || end >= s.size() || s[end] != ':') throw UsageError(bad);
  return Remote{s.substr(0, end), s.substr(end + 1)};
}

}  // namespace

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
