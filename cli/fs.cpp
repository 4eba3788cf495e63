// sandboxer ls, rm, mkdir, mv: a box's files by URL:PATH, through the fs ops (fs.list, fs.stat,
// fs.remove, fs.mkdir, fs.rename), which reach the branch's /workspace and /tmp only, as cp does.
// Names are the agent's to choose: ls shows each through printable() (printer.hpp), so that none
// writes a terminal's escape sequences.
#include <cstdio>
#include <iostream>

#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

namespace {

// One line of ls: type, size (files only) and name; a directory's name ends in '/'.
void print_entry(const json::object& e, const std::string& name) {
  std::string type = text_field(e, "type");
  std::string size = "-";
  if (auto* n = e.if_contains("size"); n && n->is_number() && type == "file")
    size = human_bytes(n->to_number<double>());
  std::string link;
  if (type == "symlink" && e.contains("target")) link = " -> " + printable(text_field(e, "target"));
  std::printf("%-7s %10s  %s%s%s\n", type.empty() ? "?" : type.c_str(), size.c_str(), printable(name).c_str(),
              type == "dir" ? "/" : "", link.c_str());
}

// URL:PATH of a command that works on one path of a box; UsageError for a local path.
RemotePath remote_arg(const Args& a, const std::string& arg, bool path_optional = false) {
  auto r = split_remote(arg, path_optional);
  if (!r) a.fail(arg + ": expected URL:PATH, e.g. ws://127.0.0.1:7000:/workspace/file");
  return *r;
}

// ls of what is not a directory: the entry itself, as ls(1) shows a file.
int list_one(Session& s, const std::string& path, bool as_json) {
  auto r = s.call({{"op", "fs.stat"}, {"path", path}});
  if (!r) return s.fail(r.error());
  json::object e = *r;
  e.erase("id");
  e.erase("ok");
  if (as_json) {
    std::cout << json_line(json::array{e}) << "\n";
    return kExitOk;
  }
  print_entry(e, path);
  return kExitOk;
}

}  // namespace

int cmd_ls(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer ls URL[:PATH] [--json] (PATH: /workspace if none)",
                                         .flags = {"--json"},
                                         .max_positionals = 1}));
  a.expect_positionals(1);
  auto where = remote_arg(a, a.positionals()[0], true);
  std::string path = where.path.empty() ? "/workspace" : where.path;
  Session s("ls", where.url, a);
  auto r = s.list(path);
  if (!r) return s.fail(r.error());
  if (!reply_ok(*r)) {
    auto e = reply_error(*r);
    if (e.code == "not_a_directory") return list_one(s, path, a.has("--json"));
    return s.fail(e);
  }
  json::array entries = sorted_entries(r->at("entries").as_array());
  if (a.has("--json")) {
    std::cout << json_line(entries) << "\n";
    return kExitOk;
  }
  for (auto& v : entries) print_entry(v.as_object(), entry_name(v.as_object()));
  return kExitOk;
}

int cmd_rm(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer rm URL:PATH [-r]", .flags = {"-r"}}));
  a.expect_positionals(1);
  auto where = remote_arg(a, a.positionals()[0]);
  Session s("rm", where.url, a);
  auto r = s.call({{"op", "fs.remove"}, {"path", where.path}, {"recursive", a.has("-r")}});
  if (r) return kExitOk;
  if (r.error().code == "not_empty")
    return s.fail({r.error().message + " (-r removes it with what it holds)", "not_empty"});
  return s.fail(r.error());
}

int cmd_mkdir(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer mkdir URL:PATH [-p]", .flags = {"-p"}}));
  a.expect_positionals(1);
  auto where = remote_arg(a, a.positionals()[0]);
  Session s("mkdir", where.url, a);
  // -p: each directory on the way, from the root down (a directory that is there already is
  // fine, with or without -p).
  std::vector<std::string> dirs{where.path};
  if (a.has("-p")) {
    dirs.clear();
    for (size_t slash = where.path.find('/', 1); slash != std::string::npos; slash = where.path.find('/', slash + 1))
      if (where.path[slash - 1] != '/') dirs.push_back(where.path.substr(0, slash));
    if (!where.path.ends_with('/')) dirs.push_back(where.path);
  }
  for (const auto& d : dirs) {
    // The roots themselves (/workspace, /tmp) name no entry of their own to make.
    if (a.has("-p") && (d == "/workspace" || d == "/tmp")) continue;
    auto r = s.call({{"op", "fs.mkdir"}, {"path", d}});
    if (!r && r.error().code == "not_found" && !a.has("-p"))
      return s.fail({r.error().message + " (-p makes the directories on the way)", "not_found"});
    if (!r) return s.fail(r.error());
  }
  return kExitOk;
}

int cmd_mv(const std::vector<std::string>& args) {
  auto a = parse_args(
      args, remote_spec({.usage = "usage: sandboxer mv URL:FROM TO [--replace] (TO: a path in the same box, or URL:TO)",
                         .flags = {"--replace"}}));
  a.expect_positionals(2);
  auto from = remote_arg(a, a.positionals()[0]);
  std::string to = a.positionals()[1];
  if (auto t = split_remote(to)) {
    if (t->url != from.url) a.fail(to + ": another box than " + from.url + " (mv moves within one box; cp copies)");
    to = t->path;
  }
  Session s("mv", from.url, a);
  auto r = s.call({{"op", "fs.rename"}, {"from", from.path}, {"to", to}, {"replace", a.has("--replace")}});
  if (r) return kExitOk;
  return s.fail(r.error());
}

}  // namespace sbx::cli
