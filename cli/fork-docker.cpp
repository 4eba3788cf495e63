// sandboxer fork URL --snapshot S -n N --host docker: one box's checkpoint, continued live in N new
// containers (issues 6 and 17); and sandboxer migrate URL --to docker, the same with one copy, the
// original held stopped meanwhile and ended once the copy runs.
//
// How it goes, and why this way:
// - The box to fork is found by `docker inspect` of its container (the io.sandboxer.url label
//   `up` put on it): the image by its id (the very image, not a tag that may have moved since),
//   the profile file `up` wrote beside the box (overrides applied), and the user's own volumes
//   (a live copy finds its bind mounts at the same places). The box's own word (the manifest's
//   profile name) would lose the overrides and says nothing of volumes. A box that is no
//   container of this dockerd (DOCKER_HOST names another machine's) is forked from what its
//   snapshot's manifest names: the image by its sandboxer image id, the profile document.
// - The snapshot moves over the box API only (issue 17): N containers start idle
//   (`sandboxer-init --idle`) while the source's snapshot.export streams in; the archive is fed to
//   each new box's snapshot.import as it arrives (relay.hpp: read from the source once, checked
//   against its id before any box may import it), and each box is then asked to `restore` it as
//   copy i, so its journal continues the parent's seq. No archive is bound into a container: the
//   same path serves a dockerd on another machine.
// - Any failure removes every container this command started; no token of theirs is kept.

#include <uv.h>

#include <chrono>
#include <future>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "archive/archive.hpp"
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "cli/relay.hpp"
#include "cli/session.hpp"
#include "cli/tokens.hpp"
#include "loop/uv-handle.hpp"
#include "os/sys.hpp"
#include "shims/docker/docker.hpp"

namespace sbx::cli {

namespace dk = sbx::shims::docker;
namespace json = boost::json;

namespace {

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// One new box: a container this command started (its record once `up` returned, or why it did
// not start, and its log), or an idle box some host started and named by its URL.
struct Copy {
  std::optional<dk::BoxRecord> box;
  std::string name;                  // in messages: the container's name, or the box's URL
  std::optional<sdk::Endpoint> api;  // set once the box is up
  std::string error, log;
  std::optional<size_t> target;  // its index in the relay
  json::object restored;         // the restore's copy: mode, timings
  bool restore_ended = false;
};

Copy start_idle_copy(const dk::BoxSpec& from, const std::string& snap, int index, int port, const DockerTarget& to) {
  Copy c;
  std::ostringstream log;
  dk::UpOptions o;
  o.profile = "forked";
  o.profile_text = from.profile_text;
  o.image = from.image;
  o.volumes = from.volumes;
  o.env = from.env;  // a copy that restarts cold gets the original's --env again
  o.idle = true;
  o.publish_address = to.publish_address;
  o.trust_keys = to.trust_keys;  // besides the user's own key
  o.box_root = state_home() + "/docker";
  o.port = port;
  o.labels = {"io.sandboxer.forked-from=" + from.name, "io.sandboxer.snapshot=" + snap,
              "io.sandboxer.index=" + std::to_string(index)};
  try {
    c.box = dk::up(o, log);
    c.name = c.box->name;
    c.api = sdk::Endpoint{c.box->url, c.box->token, false};
  } catch (const std::exception& e) {
    c.error = e.what();
  }
  c.log = log.str();
  return c;
}

// The N containers start side by side while the archive streams in; each joins the relay as soon
// as its API answers. Returns once the archive has gone into every box that started, or failed.
std::vector<Copy> start_and_send(Session& s, Relay& relay, const dk::BoxSpec& from, const std::string& snap, int n,
                                 const DockerTarget& to) {
  std::vector<Copy> copies(static_cast<size_t>(n));
  size_t reported = 0;
  std::mutex mu;
  std::vector<std::pair<size_t, Copy>> ready;  // filled by the starting threads
  auto wake = loop::UvHandle<uv_async_t>::make(s.loop(), uv_async_init, [](uv_async_t* h) {
    if (h->data) (*static_cast<std::function<void()>*>(h->data))();
  });
  if (!wake) throw std::runtime_error(wake.error().message);
  std::function<void()> on_ready = [&] {
    std::vector<std::pair<size_t, Copy>> got;
    {
      std::lock_guard lock(mu);
      got.swap(ready);
    }
    for (auto& [i, c] : got) {
      copies[i] = std::move(c);
      ++reported;
      if (copies[i].api) copies[i].target = relay.add_target(*copies[i].api);
    }
    if (reported == copies.size()) relay.seal();
  };
  (*wake)->data = &on_ready;
  auto ports = dk::free_loopback_ports(n);
  std::vector<std::future<void>> starting;
  for (int i = 0; i < n; ++i)
    starting.push_back(std::async(std::launch::async, [&, i, async = wake->get()] {
      Copy c = start_idle_copy(from, snap, i, ports[static_cast<size_t>(i)], to);
      std::lock_guard lock(mu);
      ready.emplace_back(static_cast<size_t>(i), std::move(c));
      uv_async_send(async);
    }));
  relay.on_done([&] { s.stop(); });
  s.on_interrupt([&] { relay.abort("interrupted"); });
  if (!relay.done()) s.run();
  s.on_interrupt({});                 // the lambda above dies with this frame
  for (auto& f : starting) f.wait();  // an interrupt ends the relay early: every container is known
  (*wake)->data = nullptr;
  on_ready();
  return copies;
}

// restore{snapshot, index: i, from: the source's URL} in every box that has the snapshot, side by side.
void restore_all(Session& s, std::vector<Copy>& copies, const std::string& snap, std::vector<std::string>& failures) {
  std::vector<std::unique_ptr<sdk::Client>> clients;
  size_t pending = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    auto& c = copies[i];
    auto client = std::make_unique<sdk::Client>(s.loop(), *c.api);
    auto* cl = client.get();
    clients.push_back(std::move(client));
    ++pending;
    auto finish = [&, i, cl](std::optional<std::string> err, json::object copy) {
      if (copies[i].restore_ended) return;
      copies[i].restore_ended = true;
      copies[i].restored = std::move(copy);
      if (err) failures.push_back("box " + copies[i].name + ": " + *err);
      cl->close();
      if (--pending == 0) s.stop();
    };
    cl->on_close([finish](int code, const std::string& reason) {
      finish("the connection closed before the restore's reply: " + reason + " (" + std::to_string(code) + ")", {});
    });
    cl->connect([&, cl, finish, i](const std::string& err) {
      if (!err.empty()) return finish("connect: " + err, {});
      json::object req{{"op", "restore"}, {"snapshot", snap}, {"index", i}, {"from", s.url()}};
      cl->request(std::move(req), [finish](const json::object& r) {
        json::object copy;
        if (auto* cs = r.if_contains("copies"); cs && cs->is_array() && !cs->as_array().empty())
          copy = cs->as_array()[0].as_object();
        if (reply_ok(r)) return finish(std::nullopt, copy);
        auto e = reply_error(r);
        std::string why = e.message;
        if (auto* ce = copy.if_contains("error"); ce && ce->is_string()) why += ": " + std::string(ce->as_string());
        if (!e.code.empty()) why += " (" + e.code + ")";
        finish(why, copy);
      });
    });
  }
  s.on_interrupt([&] {
    for (size_t i = 0; i < copies.size(); ++i)
      if (!copies[i].restore_ended) failures.push_back("box " + copies[i].name + ": interrupted");
    s.stop();
  });
  if (pending > 0) s.run();
  s.on_interrupt({});
}

// The box to fork: its container on this dockerd, or, for a box elsewhere (another dockerd,
// any host), what the snapshot's manifest names: the image by its sandboxer image id (found here
// by label) and the profile document. A box elsewhere lends no volumes and no --env.
dk::BoxSpec source_spec(const std::string& url, const std::string& token_file, const std::string& snap) {
  if (auto spec = dk::find_box(url)) return *spec;
  std::string why;
  try {
    Session s("fork", url, token_file);
    auto r = s.call({{"op", "snapshot.list"}});
    if (!r) {
      why = r.error().message;
    } else {
      for (auto& v : r->at("snapshots").as_array()) {
        auto& m = v.as_object();
        if (m.at("id") != json::value(snap)) continue;
        auto* image = m.if_contains("image");
        auto* doc = m.if_contains("profile_doc");
        if (!image || !image->is_string())
          throw std::runtime_error(snap + " names no image (taken in a box outside a sandboxer image)");
        if (!doc || !doc->is_object())
          throw std::runtime_error(snap + " carries no profile (taken by an older sandboxer-init)");
        dk::BoxSpec spec;
        spec.name = url;
        spec.image = dk::image_with_id(std::string(image->as_string()));
        spec.profile_text = json::serialize(*doc);
        return spec;
      }
      why = "it has no snapshot " + snap;
    }
  } catch (const std::exception& e) {
    why = e.what();
  }
  throw std::runtime_error("no box container for " + url +
                           " on this dockerd (see sandboxer ps), and the box itself: " + why);
}

// What the relay did for each copy, then the restore in each: the part of a fork that is the same
// whoever started the boxes. `failures` says what went wrong.
void import_and_restore(Session& s, Relay& relay, std::vector<Copy>& copies, const std::string& from,
                        const std::string& snap, std::vector<std::string>& failures,
                        std::chrono::steady_clock::time_point t0) {
  // Where every target failed first, each says why below.
  if (!relay.source() && relay.source().error().code != kNoTarget)
    failures.push_back("export from " + from + ": " + relay.source().error().message);
  auto imported = relay.targets();
  for (auto& c : copies) {
    std::cerr << c.log;
    if (!c.api)
      failures.push_back(c.error);
    else if (!imported[*c.target] && imported[*c.target].error().code != kSourceFailed)
      failures.push_back("box " + c.name + ": import: " + imported[*c.target].error().message);
  }
  if (!failures.empty()) return;
  std::cerr << snap << " (" << relay.size() << " bytes) in " << copies.size() << " box(es) after "
            << static_cast<int>(ms_since(t0)) << " ms\n";
  restore_all(s, copies, snap, failures);
  if (!failures.empty()) return;
  for (auto& c : copies) {
    double criu_ms = 0;
    if (auto* t = c.restored.if_contains("timings_ms"); t && t->is_object())
      if (auto* r = t->as_object().if_contains("restore"); r && r->is_number()) criu_ms = r->to_number<double>();
    std::string mode = c.restored.contains("mode") ? json::value_to<std::string>(c.restored.at("mode")) : "";
    std::cerr << "box " << c.name << " restored " << snap << " (" << mode << ", criu " << static_cast<int>(criu_ms)
              << " ms)" << (c.box ? "; journal in " + c.box->state_dir : std::string()) << "\n";
  }
}

// N new containers of `from`, each given snapshot `snap` over the API and restored as copy i;
// progress on stderr. On any failure every container started is removed and the reasons are in
// `failures`.
std::vector<Copy> copy_onto_docker(Session& s, const dk::BoxSpec& from, const std::string& snap, int n,
                                   const DockerTarget& to, std::vector<std::string>& failures) {
  auto t0 = std::chrono::steady_clock::now();
  Relay relay(s.loop(), s.endpoint(), snap);
  if (auto r = relay.start(); !r) {
    failures.push_back(r.error().message);
    return {};
  }
  std::cerr << "starting " << n << " idle container(s) of " << from.image.substr(0, 19) << " while " << snap
            << " streams from " << from.name << "\n";
  std::vector<Copy> copies = start_and_send(s, relay, from, snap, n, to);
  import_and_restore(s, relay, copies, from.name, snap, failures, t0);
  if (!failures.empty()) {
    for (auto& c : copies)
      if (c.box) dk::run_docker({"rm", "--force", c.box->name});
    return {};
  }
  for (auto& c : copies) save_token(c.box->url, c.box->token);
  return copies;
}

// Boxes some host started idle (`sandboxer-init --idle`) and named by URL, each given `snap` over
// the API and restored as copy i. They are not this command's: on a failure they are left as they
// are, for whoever started them to remove.
std::vector<Copy> copy_into_boxes(Session& s, const std::vector<sdk::Endpoint>& boxes, const std::string& snap,
                                  std::vector<std::string>& failures) {
  auto t0 = std::chrono::steady_clock::now();
  DeltaPlan plan = plan_delta(s, boxes, snap);
  Relay relay(s.loop(), s.endpoint(), snap, plan);
  if (auto r = relay.start(); !r) {
    failures.push_back(r.error().message);
    return {};
  }
  std::vector<Copy> copies(boxes.size());
  for (size_t i = 0; i < boxes.size(); ++i) {
    copies[i].name = boxes[i].url;
    copies[i].api = boxes[i];
    copies[i].target = relay.add_target(boxes[i]);
  }
  relay.seal();
  std::cerr << "sending " << snap << " from " << s.url() << " into " << boxes.size() << " box(es)"
            << (plan.delta() ? " as" + plan.describe().substr(1) : std::string()) << "\n";
  relay.on_done([&] { s.stop(); });
  s.on_interrupt([&] { relay.abort("interrupted"); });
  if (!relay.done()) s.run();
  s.on_interrupt({});
  import_and_restore(s, relay, copies, s.url(), snap, failures, t0);
  return failures.empty() ? copies : std::vector<Copy>{};
}

// The source's agent is held stopped by its checkpoint (checkpoint{hold_ms}) while `place` starts
// its copy elsewhere; the source is released to end only once the copy runs there, and to
// continue on any failure before that, so the agent is never lost and never runs twice.
using Place = std::function<std::vector<Copy>(Session&, const std::string& snap, std::vector<std::string>& failures)>;

std::optional<Copy> migrate_with(Session& s, const Place& place, const std::string& on_failure) {
  const std::string& url = s.url();
  constexpr int64_t kHoldMs = 300000;  // the longest a move may take before the source goes on
  auto held = s.call({{"op", "checkpoint"}, {"name", "migrate"}, {"hold_ms", kHoldMs}});
  if (!held) {
    s.fail(held.error(), "checkpoint " + url + " (nothing was changed)");
    return std::nullopt;
  }
  std::string snap = json::value_to<std::string>(held->at("snapshot"));
  std::cerr << "migrate: " << url << " checkpointed as " << snap << ", its agent held stopped\n";
  std::vector<std::string> failures;
  std::vector<Copy> copies;
  try {
    copies = place(s, snap, failures);
  } catch (const std::exception& e) {
    failures.push_back(e.what());
  }
  if (!failures.empty()) {
    auto r = s.call({{"op", "checkpoint.release"}, {"end", false}});
    s.report("migrate of " + url + " failed; " +
             (r ? std::string("its agent goes on there") : "releasing its agent failed too: " + r.error().message) +
             " (" + on_failure + "):");
    for (auto& f : failures) std::cerr << "  " << f << "\n";
    return std::nullopt;
  }
  // The copy runs: the original ends, as a checkpoint that stops its agent ends it.
  if (auto r = s.call({{"op", "checkpoint.release"}, {"end", true}}); !r)
    std::cerr << "migrate: ending the original at " << url << ": " << r.error().message
              << " (its agent is still held stopped; end it with sandboxer down)\n";
  return std::move(copies.front());
}

}  // namespace

int fork_on_docker(const std::string& url, const std::string& token_file, const std::string& snap, int n,
                   const DockerTarget& to) {
  if (!archive::valid_snapshot_id(snap))
    throw UsageError("--snapshot " + snap + ": not a snapshot id (s- and 16 hex digits)");
  if (n < 1 || n > 16) throw UsageError("-n must be 1..16 with --host docker (one container each)");
  auto t0 = std::chrono::steady_clock::now();
  dk::BoxSpec from = source_spec(url, token_file, snap);
  Session s("fork", url, token_file);
  std::vector<std::string> failures;
  auto copies = copy_onto_docker(s, from, snap, n, to, failures);
  if (!failures.empty()) {
    s.report("fork of " + snap + " into " + std::to_string(n) +
             " container(s) failed (the containers it started are removed):");
    for (auto& f : failures) std::cerr << "  " << f << "\n";
    return kExitFailed;
  }
  std::cerr << "fork: " << n << " container(s) in " << static_cast<int>(ms_since(t0)) << " ms\n";
  // For scripts: one line per copy, <branch> <URL>; each copy is branch main of its own box.
  for (auto& c : copies) std::cout << "main " << c.box->url << "\n";
  std::cout.flush();
  return kExitOk;
}

int migrate_on_docker(const std::string& url, const std::string& token_file, const DockerTarget& to) {
  auto t0 = std::chrono::steady_clock::now();
  Session s("migrate", url, token_file);
  auto copy = migrate_with(
      s,
      [&](Session& s, const std::string& snap, std::vector<std::string>& failures) {
        dk::BoxSpec from = source_spec(url, token_file, snap);
        return copy_onto_docker(s, from, snap, 1, to, failures);
      },
      "the container started is removed");
  if (!copy) return kExitFailed;
  // A container of this dockerd is removed too, as `down` does (its journal stays).
  if (dk::find_box(url)) try {
      dk::down(url);
      forget_token(url);
    } catch (const std::exception& e) {
      std::cerr << "migrate: removing the original's container: " << e.what() << "\n";
    }
  std::cerr << "migrate: " << url << " moved to box " << copy->name << " in " << static_cast<int>(ms_since(t0))
            << " ms\n";
  std::cout << copy->box->url << std::endl;  // the last line of stdout: the agent's new URL
  return kExitOk;
}

int fork_into_boxes(const std::string& url, const std::string& token_file, const std::string& snap,
                    const std::vector<sdk::Endpoint>& boxes) {
  if (!archive::valid_snapshot_id(snap))
    throw UsageError("--snapshot " + snap + ": not a snapshot id (s- and 16 hex digits)");
  auto t0 = std::chrono::steady_clock::now();
  Session s("fork", url, token_file);
  std::vector<std::string> failures;
  auto copies = copy_into_boxes(s, boxes, snap, failures);
  if (!failures.empty()) {
    s.report("fork of " + snap + " into " + std::to_string(boxes.size()) +
             " box(es) failed (the boxes are left as they are, for their host to remove):");
    for (auto& f : failures) std::cerr << "  " << f << "\n";
    return kExitFailed;
  }
  std::cerr << "fork: " << boxes.size() << " box(es) in " << static_cast<int>(ms_since(t0)) << " ms\n";
  for (auto& c : copies) std::cout << "main " << c.api->url << "\n";
  std::cout.flush();
  return kExitOk;
}

int migrate_into_box(const std::string& url, const std::string& token_file, const sdk::Endpoint& box) {
  auto t0 = std::chrono::steady_clock::now();
  Session s("migrate", url, token_file);
  auto copy = migrate_with(
      s,
      [&](Session& s, const std::string& snap, std::vector<std::string>& failures) {
        return copy_into_boxes(s, {box}, snap, failures);
      },
      "the box at " + box.url + " is left as it is, for its host to remove");
  if (!copy) return kExitFailed;
  // The original's box ends with its agent (exit 0): its host removes it as any box that ended.
  std::cerr << "migrate: " << url << " moved to " << box.url << " in " << static_cast<int>(ms_since(t0)) << " ms\n";
  std::cout << box.url << std::endl;
  return kExitOk;
}

}  // namespace sbx::cli
