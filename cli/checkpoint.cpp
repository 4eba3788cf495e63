// sandboxer checkpoint URL [--name N] [--branch B] [--leave-running | --stop] [--json]
// Checkpoints a live agent (the main branch, or B); the snapshot id is the last line of stdout.
#include <cstdio>
#include <initializer_list>
#include <iostream>
#include <optional>
#include <string_view>
#include <vector>

#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

namespace {

// A number at `path` (keys) of the reply, where there is one.
std::optional<double> number_at(const json::object& o, std::initializer_list<std::string_view> path) {
  const json::value* v = nullptr;
  const json::object* at = &o;
  for (auto key : path) {
    v = at ? at->if_contains(key) : nullptr;
    if (!v) return std::nullopt;
    at = v->if_object();
  }
  return v->is_number() ? std::optional<double>(v->to_number<double>()) : std::nullopt;
}

// For a person, on stderr: "s-... live (54.7 KiB; the agent paused 56.1 ms, 65.7 ms in all)"
// ("the agent ended" with --stop), and the box's note where it has one (a snapshot of the files
// alone: why).
std::string summary(const json::object& r, bool ended) {
  std::string out = text_field(r, "snapshot") + " " + text_field(r, "mode");
  std::vector<std::string> parts;
  char buf[96];
  if (auto size = number_at(r, {"sizes", "compressed"})) parts.push_back(human_bytes(*size));
  if (ended) {
    parts.emplace_back("the agent ended");
  } else if (auto held = number_at(r, {"timings_ms", "freeze"})) {
    std::snprintf(buf, sizeof buf, "the agent paused %.1f ms", *held);
    parts.emplace_back(buf);
  }
  if (auto total = number_at(r, {"timings_ms", "total"})) {
    std::snprintf(buf, sizeof buf, "%.1f ms in all", *total);
    parts.emplace_back(buf);
  }
  for (size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? " (" : i == 1 ? "; " : ", ") + parts[i];
  if (!parts.empty()) out += ")";
  if (auto note = text_field(r, "note"); !note.empty()) out += ": " + note;
  return out;
}

}  // namespace

int cmd_checkpoint(const std::vector<std::string>& args) {
  auto a = parse_args(
      args, remote_spec({.usage = "usage: sandboxer checkpoint URL [--name N] [--branch B] [--leave-running | --stop] "
                                  "[--json]",
                         .flags = {"--leave-running", "--stop", "--json"},
                         .options = {"--name", "--branch"}}));
  a.expect_positionals(1);
  json::object req{{"op", "checkpoint"}, {"leave_running", !a.has("--stop")}};
  if (auto name = a.value("--name")) req["name"] = *name;
  if (auto branch = a.value("--branch")) req["branch"] = *branch;
  Session s("checkpoint", a.positionals()[0], a);
  auto r = s.call(std::move(req));
  if (!r) return s.fail(r.error());
  if (a.has("--json"))
    std::cout << json_line(*r) << "\n";
  else
    s.report(summary(*r, a.has("--stop")));
  // For scripts: the snapshot id is the last line of stdout.
  std::cout << json::value_to<std::string>(r->at("snapshot")) << "\n";
  return kExitOk;
}

}  // namespace sbx::cli
