// sandboxer stats URL [--json]
// The box's cpu, memory, pids and disk, and each process's, from one `stats` request.
#include <cstdio>
#include <iostream>

#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"

namespace sbx::cli {

namespace json = boost::json;

namespace {

void print_line(const std::string& name, const json::object& s) {
  double mib = static_cast<double>(s.at("memory").to_number<uint64_t>()) / (1 << 20);
  std::printf("%-16s cpu %8.2fs  memory %9.1f MiB  pids %4llu", sbx::cli::printable(name).c_str(),
              s.at("cpu_s").to_number<double>(), mib,
              static_cast<unsigned long long>(s.at("pids").to_number<uint64_t>()));
  if (auto* d = s.if_contains("disk"))
    std::printf("  disk %9.1f MiB", static_cast<double>(d->to_number<uint64_t>()) / (1 << 20));
  std::printf("\n");
}

}  // namespace

int cmd_stats(const std::vector<std::string>& args) {
  auto a = parse_args(
      args, remote_spec({.usage = "usage: sandboxer stats URL [--json]", .flags = {"--json"}, .max_positionals = 1}));
  a.expect_positionals(1);
  Session s("stats", a.positionals()[0], a);
  auto r = s.request({{"op", "stats"}});
  if (!r) {
    // A connection that failed says why, as does a close with a reason (the client's 1007 for a
    // reply it cannot read); one that closed before the reply without a word ends quietly.
    if (r.error().code == "connect")
      s.report(r.error().message);
    else if (r.error().message != "the connection closed first")
      return s.fail(r.error());
    return kExitFailed;
  }
  if (!reply_ok(*r)) return s.fail(*r);
  if (a.has("--json")) {
    json::object o = *r;
    o.erase("id");
    o.erase("ok");
    std::cout << json_line(o) << "\n";
    return kExitOk;
  }
  print_line("box", r->at("box").as_object());
  for (auto& kv : r->at("procs").as_object()) print_line("proc " + std::string(kv.key()), kv.value().as_object());
  std::fflush(stdout);
  return kExitOk;
}

}  // namespace sbx::cli
