// sandboxer export URL SNAPSHOT FILE: a snapshot's archive out of the box (snapshot.export),
// into FILE.part, checked against its id (every entry against the manifest that hashes to it)
// and renamed to FILE when whole: a failed export leaves no FILE behind.
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "archive/archive.hpp"
#include "cli/commands.hpp"
#include "cli/session.hpp"
#include "os/sys.hpp"

namespace sbx::cli {

int cmd_export(const std::vector<std::string>& args) {
  auto a = parse_args(args, remote_spec({.usage = "usage: sandboxer export URL SNAPSHOT FILE [--base SNAPSHOT]",
                                         .options = {"--base"}}));
  a.expect_positionals(3);
  const auto& file = a.positionals()[2];
  Session s("export", a.positionals()[0], a);
  auto got = snapshot_id(s, a.positionals()[1]);
  if (!got) return s.fail(got.error());
  const std::string snap = *got;
  auto base = a.value("--base");
  if (base) {
    auto b = snapshot_id(s, *base);
    if (!b) return s.fail(b.error(), "--base");
    base = *b;
  }
  std::string part = file + ".part";
  boost::json::object req{{"op", "snapshot.export"}, {"snapshot", snap}};
  if (base) req["base"] = *base;
  auto r = s.download(req, part);
  if (!r) {
    ::unlink(part.c_str());
    return s.fail(r.error());
  }
  // The id names the content (the hash of its manifest, which lists every entry's sha256; a
  // format-2 archive's own hash): what arrived is checked whole against it. A delta (--base) is
  // checked by the box that imports it, as it extracts the chunks.
  if (!base) {
    auto id = archive::archive_id(part);
    if (!id || *id != snap) {
      ::unlink(part.c_str());
      s.report(id ? "the archive received names snapshot " + *id + ", not " + snap
                  : "the archive received is refused: " + id.error().message);
      return kExitFailed;
    }
  }
  if (::rename(part.c_str(), file.c_str()) != 0) {
    s.report(file + ": " + os::last_error().message());
    ::unlink(part.c_str());
    return kExitFailed;
  }
  std::cerr << "exported " << snap << (base ? " as a delta against " + *base : std::string()) << " ("
            << r->at("size").to_number<uint64_t>() << " bytes) to " << file << "\n";
  return kExitOk;
}

}  // namespace sbx::cli
