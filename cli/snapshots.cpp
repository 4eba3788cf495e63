// sandboxer snapshots URL [--json]: the box's snapshots, one line each (id, when, branch, mode,
// size, who asked for it, name); with --json, each one's whole manifest, one JSON object a line.
#include <cstdio>
#include <iostream>
#include <string>

#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

namespace {

// A field for the table: "-" where there is none.
std::string text_of(const json::object& o, const char* key) {
  auto text = text_field(o, key);
  return text.empty() ? "-" : text;
}

// The archive's bytes; a snapshot in the chunk store has none of its own: what it holds (images
// and files) then.
std::string size_of(const json::object& m) {
  double bytes = 0;
  if (auto* a = m.if_contains("archive"); a && a->is_object() && a->as_object().contains("bytes"))
    bytes = a->as_object().at("bytes").to_number<double>();
  else if (auto* s = m.if_contains("sizes"); s && s->is_object())
    for (auto& [k, v] : s->as_object())
      if (v.is_number()) bytes += v.to_number<double>();
  return human_bytes(bytes);
}

// Who asked for it (snapshot_origin), "-" where the box does not say.
std::string by_of(const json::object& m) {
  auto by = snapshot_origin(m);
  return by.empty() ? "-" : by;
}

}  // namespace

int cmd_snapshots(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer snapshots URL [--json]", .flags = {"--json"}}));
  a.expect_positionals(1);
  Session s("snapshots", a.positionals()[0], a);
  auto r = s.call({{"op", "snapshot.list"}});
  if (!r) return s.fail(r.error());
  const auto& list = r->at("snapshots").as_array();
  if (a.has("--json")) {
    for (auto& snap : list) std::cout << json_line(snap) << "\n";
    return kExitOk;
  }
  std::printf("%-20s %-20s %-10s %-5s %10s  %-14s %s\n", "SNAPSHOT", "CREATED (UTC)", "BRANCH", "MODE", "SIZE", "BY",
              "NAME");
  for (auto& v : list) {
    if (!v.is_object()) continue;
    const auto& m = v.as_object();
    std::string created = text_of(m, "created");
    if (created.size() >= 19) created = created.substr(0, 10) + " " + created.substr(11, 8);
    // The name is the agent's or a client's choice (a checkpoint over the agent channel names
    // one): its control bytes are shown escaped, never sent to the terminal.
    std::printf("%-20s %-20s %-10s %-5s %10s  %-14s %s\n", printable(text_of(m, "id")).c_str(), created.c_str(),
                printable(text_of(m, "branch")).c_str(), text_of(m, "mode").c_str(), size_of(m).c_str(),
                printable(by_of(m)).c_str(), printable(text_of(m, "name")).c_str());
  }
  return kExitOk;
}

}  // namespace sbx::cli
