// sandboxer fork URL --snapshot S -n N --host docker: one box's checkpoint, continued live in N new
// containers (issue 6).
//
// How it goes, and why this way:
// - The box to fork is found by `docker inspect` of its container (the io.sandboxer.url label
//   `up` put on it): the image by its id (the very image, not a tag that may have moved since),
//   the profile file `up` wrote beside the box (overrides applied), and the user's own volumes
//   (a live copy finds its bind mounts at the same places). The box's own word (the manifest's
//   profile name) would lose the overrides and says nothing of volumes.
// - The archive leaves the box over its WebSocket (snapshot.export), so the fork needs nothing
//   but the URL and token; its id is its own sha256, checked here before any container starts.
// - Each copy is a new container started by the same path as `up`, with the archive bound in
//   read-only and `sandboxer-init --restore` as its command: the box is the restored copy from
//   its first instant (its journal continues the parent's seq; no idle box waits for an upload),
//   and a refusal (another image, another criu, a corrupted archive) ends the container with the
//   reason in its journal and log. The API answers only once the restore is done or failed.
// - Any failure removes every container this command started, and forgets their tokens.

#include <chrono>
#include <future>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "archive/archive.hpp"
#include "cli/commands.hpp"
#include "cli/tokens.hpp"
#include "journal/journal.hpp"
#include "os/files.hpp"
#include "os/sys.hpp"
#include "shims/docker/docker.hpp"

namespace sbx::cli {

namespace dk = sbx::shims::docker;
namespace json = boost::json;

namespace {

// The restore's outcome in a new box's journal: restore.done (mode) or restore.failed (error).
struct Outcome {
  bool done = false, ok = false;
  std::string mode, error;
  double restore_ms = 0;
};

Outcome restore_outcome(const std::string& state_dir) {
  Outcome out;
  (void)journal::Journal::read(state_dir + "/journal", 0, [&](uint64_t, std::string_view line) {
    boost::system::error_code ec;
    auto v = json::parse(line, ec);
    if (ec || !v.is_object()) return true;
    auto& e = v.as_object();
    auto* type = e.if_contains("type");
    if (!type || !type->is_string()) return true;
    if (type->as_string() == "restore.done") {
      out = {true, true, e.contains("mode") ? std::string(e.at("mode").as_string()) : "", "", 0};
      if (auto* t = e.if_contains("timings_ms"); t && t->is_object())
        if (auto* r = t->as_object().if_contains("restore"); r && r->is_number())
          out.restore_ms = r->to_number<double>();
      return false;
    }
    if (type->as_string() == "restore.failed") {
      out = {true, false, "", e.contains("error") ? json::value_to<std::string>(e.at("error")) : "restore failed", 0};
      return false;
    }
    return true;
  });
  return out;
}

}  // namespace

int fork_on_docker(const std::string& url, const std::string& token_file, const std::string& snap, int n) {
  if (!archive::valid_snapshot_id(snap))
    throw std::invalid_argument("--snapshot " + snap + ": not a snapshot id (s- and 16 hex digits)");
  if (n < 1 || n > 16) throw std::invalid_argument("-n must be 1..16 with --host docker (one container each)");
  auto t0 = std::chrono::steady_clock::now();
  auto ms_since = [](auto t) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  };
  dk::BoxSpec from = dk::inspect_box(url);

  std::string work = state_home() + "/docker/.fork-" + os::random_hex(4);
  if (auto r = os::make_dirs(work, 0700); !r) throw std::runtime_error("create " + work + ": " + r.error().message());
  struct RemoveWork {
    std::string dir;
    ~RemoveWork() { os::remove_tree(dir); }
  } remove_work{work};
  std::string archive = work + "/" + snap + ".tar.zst";
  // `sandboxer export` itself: the archive arrives whole and hashing to its id, or not at all.
  std::vector<std::string> export_args = {url, snap, archive};
  if (!token_file.empty()) export_args.insert(export_args.end(), {"--token-file", token_file});
  if (cmd_export(export_args) != 0) throw std::runtime_error("export " + snap + " from " + url + " failed (see above)");
  double export_ms = ms_since(t0);
  std::cerr << "fork: " << snap << " exported from " << from.name << " in " << static_cast<int>(export_ms)
            << " ms; starting " << n << " container(s) of " << from.image.substr(0, 19) << "\n";

  // The copies start side by side: each `up` waits for its own API.
  struct Started {
    std::optional<dk::BoxRecord> box;
    std::string error, log;
  };
  std::vector<std::future<Started>> starting;
  auto ports = dk::free_loopback_ports(n);
  for (int i = 0; i < n; ++i) {
    starting.push_back(std::async(std::launch::async, [&, i] {
      Started s;
      std::ostringstream log;
      dk::UpOptions o;
      o.profile = from.profile_file;
      o.image = from.image;
      o.volumes = from.volumes;
      o.env = from.env;  // a copy that restarts cold gets the original's --env again
      o.restore_archive = archive;
      o.box_root = state_home() + "/docker";
      o.port = ports[static_cast<size_t>(i)];
      o.restore_index = i;
      o.labels = {"io.sandboxer.forked-from=" + from.name, "io.sandboxer.snapshot=" + snap,
                  "io.sandboxer.index=" + std::to_string(i)};
      try {
        s.box = dk::up(o, log);
      } catch (const std::exception& e) {
        s.error = e.what();
      }
      s.log = log.str();
      return s;
    }));
  }
  std::vector<Started> copies;
  for (auto& f : starting) copies.push_back(f.get());
  std::vector<std::string> failures;
  for (auto& c : copies) {
    std::cerr << c.log;
    if (!c.box) {
      failures.push_back(c.error);
      continue;
    }
    try {
      save_token(c.box->url, c.box->token);
    } catch (const std::exception& e) {
      failures.push_back("box " + c.box->name + ": " + e.what());
    }
  }
  // The API answers once the restore is done or failed: its outcome is in the journal by now.
  std::vector<Outcome> outcomes(copies.size());
  for (size_t i = 0; i < copies.size() && failures.empty(); ++i) {
    auto& c = copies[i];
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!(outcomes[i] = restore_outcome(c.box->state_dir)).done && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (!outcomes[i].done)
      failures.push_back("box " + c.box->name + ": no restore.done in its journal");
    else if (!outcomes[i].ok)
      failures.push_back("box " + c.box->name + ": " + outcomes[i].error);
  }
  if (!failures.empty()) {
    for (auto& c : copies) {
      if (!c.box) continue;
      dk::run_docker({"rm", "--force", c.box->name});
      forget_token(c.box->url);
    }
    std::string msg = "fork of " + snap + " into " + std::to_string(n) +
                      " container(s) failed (the containers it "
                      "started are removed):";
    for (auto& f : failures) msg += "\n  " + f;
    throw std::runtime_error(msg);
  }
  for (size_t i = 0; i < copies.size(); ++i)
    std::cerr << "fork: box " << copies[i].box->name << " restored " << snap << " (" << outcomes[i].mode << ", criu "
              << static_cast<int>(outcomes[i].restore_ms) << " ms); journal in " << copies[i].box->state_dir << "\n";
  std::cerr << "fork: " << n << " container(s) in " << static_cast<int>(ms_since(t0)) << " ms\n";
  // For scripts: one line per copy, <branch> <URL>; each copy is branch main of its own box.
  for (auto& c : copies) std::cout << "main " << c.box->url << "\n";
  std::cout.flush();
  return 0;
}

}  // namespace sbx::cli
