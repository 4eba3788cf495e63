#include "checkpoint/checkpointer.hpp"

#include <dirent.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "supervisor/box.hpp"
#include "archive/archive.hpp"
#include "checkpoint/criu.hpp"
#include "sandbox/launcher.hpp"
#include "sandbox/ns-init.hpp"
#include "os/pidfd.hpp"
#include "os/sys.hpp"
#include "sandbox/policy.hpp"
#include "base/encoding.hpp"
#include "os/files.hpp"

namespace sbx::checkpoint {

using supervisor::Box;
using supervisor::Branch;
namespace json = boost::json;

namespace {

auto log() {
  static auto l = spdlog::default_logger()->clone("criu");
  return l;
}

double now_ms() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

double round_ms(double v) { return static_cast<double>(static_cast<int64_t>(v * 10 + 0.5)) / 10; }

json::object error_reply(const std::string& code, const std::string& msg) {
  return {{"ok", false}, {"error", {{"code", code}, {"message", msg}}}};
}

// The one-letter state of a process from /proc/PID/stat ('T' stopped), or 0 when it is gone.
char proc_state(pid_t pid) {
  auto text = os::read_file("/proc/" + std::to_string(pid) + "/stat");
  if (!text) return 0;
  auto close = text->rfind(')');
  return close != std::string::npos && close + 2 < text->size() ? (*text)[close + 2] : 0;
}

// Every process of a branch's tree goes through pidfds (os/pidfd.hpp): the root's own (held since
// the branch started) and one per descendant, so a pid reused after its process died is never
// signalled, even when the root itself has been reaped meanwhile.

// Stops every process of the tree (SIGSTOP, forced even on a namespace's PID 1) and waits until
// each is stopped, scanning again for children forked meanwhile. False when that took too long.
bool stop_tree(pid_t root, int root_fd) {
  for (int round = 0; round < 200; ++round) {
    bool all = true;
    auto stop = [&](pid_t p, int fd) {
      char st = proc_state(p);
      if (st == 0 || st == 'T' || st == 't' || st == 'Z' || !os::pidfd_alive(fd)) return;
      all = false;
      (void)os::pidfd_signal(fd, SIGSTOP);
    };
    stop(root, root_fd);
    for (auto& m : os::tree_pidfds(root, root_fd)) stop(m.pid, m.fd.get());
    if (all) return true;
    ::usleep(2000);
  }
  return false;
}

void continue_tree(pid_t root, int root_fd) {
  (void)os::pidfd_signal(root_fd, SIGCONT);
  for (auto& m : os::tree_pidfds(root, root_fd)) (void)os::pidfd_signal(m.fd.get(), SIGCONT);
}

void kill_tree(pid_t root, int root_fd) {
  auto members = os::tree_pidfds(root, root_fd);
  (void)os::pidfd_signal(root_fd, SIGKILL);
  for (auto& m : members) (void)os::pidfd_signal(m.fd.get(), SIGKILL);
}

const char* const kPipeRoles[] = {"requests", "reports", "stdin", "stdout", "stderr", "channel_requests",
                                  "channel_replies"};

std::string kernel_release() {
  struct utsname u {};
  ::uname(&u);
  return u.release;
}

// The paths masked in a branch's view (launcher.cpp), each a mount point criu restores.
json::array mask_list(const std::vector<std::string>& masks) {
  json::array out;
  for (auto& m : masks) {
    struct stat st {};
    if (::stat(m.c_str(), &st) != 0) continue;
    out.push_back({{"path", m}, {"dir", S_ISDIR(st.st_mode)}});
  }
  return out;
}

// Whether the branch's /tmp, as its ns-init sees it, is an overlay (the host's /tmp under the
// branch's tmp-upper): the last mount at /tmp in /proc/PID/mountinfo.
bool tmp_is_overlay(pid_t pid) {
  auto text = os::read_file("/proc/" + std::to_string(pid) + "/mountinfo");
  if (!text) return false;
  bool overlay = false;
  size_t pos = 0;
  while (pos < text->size()) {
    size_t end = text->find('\n', pos);
    if (end == std::string::npos) end = text->size();
    std::string_view line(text->data() + pos, end - pos);
    pos = end + 1;
    // "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS ... - FSTYPE SOURCE SUPER"
    size_t f = 0;
    for (int i = 0; i < 4 && f != std::string_view::npos; ++i) f = line.find(' ', f + 1);
    if (f == std::string_view::npos || line.substr(f + 1, 5) != "/tmp ") continue;
    auto dash = line.find(" - ");
    overlay = dash != std::string_view::npos && line.substr(dash + 3, 8) == "overlay ";
  }
  return overlay;
}

}  // namespace

struct Checkpointer::CheckpointOp {
  std::string branch, name;
  bool leave_running = true;
  Reply done;
  bool live = false;
  std::string note;  // why files only
  std::string work;  // snapshots/.work-X: payload/{criu,fs}, logs
  std::string by;    // the branch whose agent channel asked, or "" (the operator)
  pid_t ns_init_pid = -1;  // the branch's ns-init (the root of its tree), in the supervisor's pid namespace
  os::UniqueFd tree_fd;    // a pidfd of ns_init_pid: the tree is stopped, continued, killed through it
  pid_t criu = -1;       // criu dumping it, until the reaper collects it
  bool stopped = false;  // the tree is stopped by us and not continued yet
  double t0 = 0, t_stopped = 0, t_dumped = 0, t_snapped = 0, t_resumed = 0, t_compressed = 0;
  json::object manifest;
  uint64_t fs_bytes = 0, image_bytes = 0;
  std::string error;
  std::optional<archive::ArchiveInfo> info;
  std::string id;
};

struct Checkpointer::RestoreOp {
  std::string snapshot;
  int n = 1;
  bool fork = false;
  Reply done;
  json::object manifest;
  std::string forced_name;  // --restore: the copy is "main"
  int first_index = 0;      // --restore-index: the copy's index among copies in boxes of their own
  bool live = false;        // criu restores it (a live snapshot a trusted key signed)
  std::string note;         // why a live snapshot is restored cold
  double t0 = 0;
  bool counted = false;  // its copies count in copies_starting_ until each is done
  int pending = 0;
  json::array results;
  std::vector<std::unique_ptr<sandbox::BranchPipes>> pipes;
};

Checkpointer::Checkpointer(Box& box)
    : box_(box), snap_dir_(box.opts_.state_dir + "/snapshots"), criu_(find_criu()), image_id_(archive::read_image_id()) {
  (void)os::make_dirs(snap_dir_, 0700);
  policy_.trusted = box.opts_.trust_keys;
  if (box.opts_.signing_key) policy_.trusted.push_back(box.opts_.signing_key->public_key());
  policy_.allow_unsigned = box.opts_.allow_unsigned;
  policy_.max_bytes = box.opts_.max_archive_bytes;
}

Checkpointer::~Checkpointer() = default;

bool Checkpointer::live_possible(std::string* why_not) const {
  if (!criu_ || !box_.caps_.criu) {
    if (why_not) *why_not = "criu was not found on PATH";
    return false;
  }
  int major = 0, minor = 0;
  std::sscanf(box_.caps_.criu->c_str(), "%d.%d", &major, &minor);
  if (major < 4 || (major == 4 && minor < 2)) {
    if (why_not) *why_not = "criu " + *box_.caps_.criu + " is too old: sockets need criu >= 4.2";
    return false;
  }
  return true;
}

void Checkpointer::offload(std::function<void()> work, std::function<void()> after) {
  struct Work {
    uv_work_t req;
    std::function<void()> work, after;
  };
  auto* w = new Work{{}, std::move(work), std::move(after)};
  w->req.data = w;
  uv_queue_work(
      box_.loop_, &w->req,
      [](uv_work_t* r) {
        try {
          static_cast<Work*>(r->data)->work();
        } catch (const std::exception& e) {
          log()->error("background step: {}", e.what());
        }
      },
      [](uv_work_t* r, int) {
        auto* w = static_cast<Work*>(r->data);
        try {
          w->after();
        } catch (const std::exception& e) {
          log()->error("after a background step: {}", e.what());
        }
        delete w;
      });
}

void Checkpointer::op_done() {
  --ops_;
  box_.maybe_finish();
}

json::object Checkpointer::identity(const Box& box, const Branch& b) {
  json::object o{{"box", box.id_}, {"branch", b.name}, {"mode", b.mode}, {"index", b.index}};
  o["parent"] = b.parent.empty() ? json::value(nullptr) : json::value(b.parent);
  o["snapshot"] = b.snapshot.empty() ? json::value(nullptr) : json::value(b.snapshot);
  return o;
}

void Checkpointer::write_branch_json(const Box& box, const Branch& b, const std::string& dir) {
  // The branch's /run is the agent's to write: run/sandboxer is reached from the branch's dir
  // without following a symlink, and branch.json replaces whatever is at its place.
  auto top = os::open_dir(dir);
  auto d = top ? os::make_dirs_at(top->get(), "run/sandboxer", 0755) : os::Result<os::UniqueFd>(top.error());
  if (!d) {
    log()->warn("create {}/run/sandboxer: {}", dir, d.error().message());
    return;
  }
  if (auto r = os::write_file_atomic_at(d->get(), "branch.json", json::serialize(identity(box, b)) + "\n"); !r)
    log()->warn("write {}/run/sandboxer/branch.json: {}", dir, r.error().message());
}

// ---- bounds and the agent channel's reach ----

void Checkpointer::continue_op(CheckpointOp& op) {
  if (!op.stopped) return;
  op.stopped = false;
  continue_tree(op.ns_init_pid, op.tree_fd.get());
}

void Checkpointer::on_shutdown() {
  // A tree stopped for a dump cannot act on the shutdown's TERM: criu goes (it is our child, not
  // yet reaped, so its pid is still its own), and the tree continues now, not at the dump's end.
  for (auto& op : dumping_) {
    if (op->criu > 0) ::kill(op->criu, SIGKILL);
    continue_op(*op);
  }
}

size_t Checkpointer::stored_snapshots() const {
  size_t n = 0;
  DIR* d = ::opendir(snap_dir_.c_str());
  if (!d) return 0;
  while (auto* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    if (name.size() > 5 && name.ends_with(".json") && archive::valid_snapshot_id(name.substr(0, name.size() - 5))) ++n;
  }
  ::closedir(d);
  return n;
}

json::object Checkpointer::limit_refusal(const std::string& branch, const char* limit, int64_t value, int64_t ceiling,
                                         const std::string& msg) {
  auto it = box_.branches_.find(branch);
  box_.emit(branch, {{"type", "limit.hit"},
                     {"limit", limit},
                     {"value", value},
                     {"ceiling", ceiling},
                     {"proc", it != box_.branches_.end() ? json::value(it->second->main_proc) : json::value(nullptr)}});
  return error_reply("limit", msg);
}

std::optional<json::object> Checkpointer::snapshots_refusal(const std::string& branch) {
  int64_t ceiling = box_.opts_.profile.resources.snapshots;
  auto value = static_cast<int64_t>(stored_snapshots()) + checkpoints_ + 1;
  if (value <= ceiling) return std::nullopt;
  return limit_refusal(branch, "snapshots", value, ceiling,
                       "resources.snapshots: this box keeps at most " + std::to_string(ceiling) + " snapshots (" +
                           std::to_string(value - 1) + " kept or being taken); delete one first");
}

int64_t Checkpointer::live_copies() const {
  int64_t n = copies_starting_;
  for (auto& [name, b] : box_.branches_)
    if (name != "main" && !b->ns_init_reaped) ++n;
  return n;
}

std::optional<json::object> Checkpointer::copies_refusal(const std::string& branch, int n) {
  int64_t ceiling = box_.opts_.profile.resources.copies;
  int64_t value = live_copies() + n;
  if (value <= ceiling) return std::nullopt;
  return limit_refusal(branch, "copies", value, ceiling,
                       "resources.copies: at most " + std::to_string(ceiling) + " copies may run at once in this box (" +
                           std::to_string(value - n) + " running or starting, " + std::to_string(n) + " asked for)");
}

std::optional<json::object> Checkpointer::channel_refusal(const Branch& b, const std::string& id, bool to_delete) const {
  if (!archive::valid_snapshot_id(id)) return std::nullopt;  // the operation itself says what is wrong
  auto text = os::read_file(snap_dir_ + "/" + id + ".json");
  if (!text) return std::nullopt;  // no such snapshot: the operation says so
  boost::system::error_code ec;
  auto v = json::parse(*text, ec);
  const json::object* origin = nullptr;
  if (!ec && v.is_object())
    if (auto* o = v.as_object().if_contains("origin"); o && o->is_object()) origin = &o->as_object();
  auto field = [&](const char* k) {
    auto* v = origin ? origin->if_contains(k) : nullptr;
    return v && v->is_string() ? std::string(v->as_string()) : std::string();
  };
  bool own = field("by") == "channel" && field("branch") == b.name;
  if (own) return std::nullopt;
  // The snapshot a copy was made from is its own past: it may make more copies of it, not delete it.
  if (!to_delete && id == b.snapshot) return std::nullopt;
  std::string whose = field("by") != "channel" ? std::string("the operator's") : "branch " + field("branch") + "'s";
  return error_reply("forbidden", "snapshot " + id + " is " + whose + ": the agent channel of branch " + b.name +
                                      " may " + (to_delete ? "delete" : "restore or fork") +
                                      " only the snapshots it took itself" +
                                      (to_delete ? "" : " and the one it was restored from"));
}

json::array Checkpointer::list_for(const Branch& b) const {
  json::array out;
  for (auto& v : list())
    if (!channel_refusal(b, std::string(v.as_object().at("id").as_string()), false)) out.push_back(v);
  return out;
}

// ---- checkpoint ----

void Checkpointer::checkpoint(const std::string& branch, const std::string& name, bool leave_running, Reply done,
                              const std::string& by) {
  auto it = box_.branches_.find(branch);
  if (it == box_.branches_.end()) return done(error_reply("not_found", "no branch \"" + branch + "\""));
  Branch& b = *it->second;
  auto pit = box_.procs_.find(Box::proc_key(b.name, b.main_proc));
  if (b.ns_init_reaped || pit == box_.procs_.end() || pit->second->status_known)
    return done(error_reply("not_running", "branch \"" + branch + "\" is not running"));
  if (b.busy) return done(error_reply("busy", "a checkpoint of branch \"" + branch + "\" is already under way"));
  if (auto refusal = snapshots_refusal(branch)) return done(std::move(*refusal));
  auto op = std::make_shared<CheckpointOp>();
  op->branch = branch;
  op->name = name;
  op->by = by;
  op->leave_running = leave_running;
  op->done = std::move(done);
  std::string why;
  if (!live_possible(&why)) {
    op->note = "filesystem only: " + why;
  } else if (!b.launched.namespaced) {
    op->note = "filesystem only: the branch has no pid and mount namespace of its own (" + b.launched.why_not + ")";
  } else {
    op->live = true;
  }
  // A files-only snapshot restores cold, and a cold copy gets the profile's Landlock again.
  if (b.landlocked && op->live)
    return op->done(error_reply("landlocked", "branch \"" + branch +
                                                  "\" is confined by Landlock, which criu does not restore: its copies "
                                                  "would run without that confinement"));
  op->tree_fd.reset(b.pidfd ? ::fcntl(b.pidfd.get(), F_DUPFD_CLOEXEC, 3) : -1);
  if (!op->tree_fd) return op->done(error_reply("not_running", "branch \"" + branch + "\" has no pidfd of its tree"));
  op->work = snap_dir_ + "/.work-" + os::random_hex(4);
  for (const char* d : {"", "/payload/criu", "/payload/fs", "/logs"})
    if (auto r = os::make_dirs(op->work + d, 0700); !r)
      return op->done(error_reply("io", "create " + op->work + d + ": " + r.error().message()));
  ++ops_;
  ++checkpoints_;
  b.busy = true;
  op->ns_init_pid = b.launched.pid;
  op->t0 = now_ms();
  dumping_.push_back(op);

  json::object pipes;
  for (size_t i = 0; i < 7; ++i) pipes[kPipeRoles[i]] = b.launched.pipe_inodes[i];
  json::array argv;
  for (auto& a : b.argv) argv.emplace_back(a);
  op->manifest = {{"format", archive::kFormatName},
                  {"format_version", archive::kFormatVersion},
                  {"created", base::rfc3339_now()},
                  {"box", box_.id_},
                  {"branch", branch},
                  {"name", name},
                  {"parent", b.snapshot.empty() ? json::value(nullptr) : json::value(b.snapshot)},
                  {"profile", box_.opts_.profile.name},
                  {"image", image_id_ ? json::value(*image_id_) : json::value(nullptr)},
                  {"mode", op->live ? "live" : "fs"},
                  {"criu", op->live ? json::value(*box_.caps_.criu) : json::value(nullptr)},
                  {"kernel", kernel_release()},
                  {"agent", {{"argv", argv}, {"cwd", b.cwd}}},
                  {"pipes", pipes},
                  {"masks", mask_list(box_.branch_masks())},
                  {"network", box_.network_manifest()},
                  {"channel_request", b.chan_inflight >= 0 ? json::value(b.chan_inflight) : json::value(nullptr)}};
  if (!op->live) op->manifest["note"] = op->note;

  op->stopped = true;  // from here until continue_op(), on every path
  if (!op->live) {
    // Files only, but still at one instant: the tree is stopped while its layer is copied.
    (void)stop_tree(op->ns_init_pid, op->tree_fd.get());
    op->t_stopped = op->t_dumped = now_ms();
    snapshot_layer(op);
    return;
  }
  // Memory and files at one instant: the tree is stopped first and stays stopped through the
  // dump (criu leaves tasks as it found them with --leave-running) and the copy of its layer.
  // criu's own --leave-stopped is not used: it leaves TCP sockets in repair mode, so a resumed
  // original would lose its live connections.
  if (!stop_tree(op->ns_init_pid, op->tree_fd.get())) {
    continue_op(*op);
    b.busy = false;
    checkpoint_failed(op, "busy", "could not stop every process of branch \"" + branch + "\" within 0.4 s");
    return;
  }
  op->t_stopped = now_ms();
  CriuRun run;
  run.args = {"dump",
              "--tree", std::to_string(op->ns_init_pid),
              "--images-dir", op->work + "/payload/criu",
              "--work-dir", op->work + "/logs",
              "--log-file", "dump.log",
              "--external", "mnt[]",
              "--external", "mnt[/workspace]:workspace",
              "--external", "mnt[/tmp]:tmp",
              "--external", "mnt[/run]:run",
              "--external", "mnt[/etc/machine-id]:machine-id",
              "--manage-cgroups=ignore",
              // Live TCP connections are dumped; the network is not locked: the tree is stopped,
              // criu's iptables lock would sit in the host's tables (the tree shares the host's
              // network namespace), and no restored copy keeps the connections (--tcp-close).
              "--tcp-established",
              "--network-lock", "skip",
              "--file-locks",
              "--leave-running"};
  run.output = op->work + "/logs/dump.out";
  auto pid = spawn_criu(*criu_, run);
  if (!pid) {
    continue_op(*op);
    b.busy = false;
    checkpoint_failed(op, "criu", "start criu: " + pid.error().message());
    return;
  }
  log()->info("dump branch {} (ns-init {}): criu {}", branch, op->ns_init_pid, *pid);
  op->criu = *pid;
  box_.reaper_.watch(*pid, [this, op](pid_t, int st) {
    op->criu = -1;
    op->t_dumped = now_ms();
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::string why = WIFSIGNALED(st) ? std::string("criu was killed by SIG") + os::signal_name(WTERMSIG(st))
                                        : criu_error_from_log(op->work + "/logs/dump.log");
      continue_op(*op);
      checkpoint_failed(op, "criu", "criu dump failed: " + why);
      return;
    }
    if (box_.shutting_down_) {
      continue_op(*op);
      return checkpoint_failed(op, "shutting_down", "the box is shutting down");
    }
    snapshot_layer(op);
  });
}

void Checkpointer::checkpoint_failed(std::shared_ptr<CheckpointOp> op, const std::string& code, const std::string& msg) {
  log()->error("checkpoint branch {}: {}", op->branch, msg);
  continue_op(*op);  // whatever failed, the agent goes on
  --checkpoints_;
  std::erase(dumping_, op);
  if (auto it = box_.branches_.find(op->branch); it != box_.branches_.end()) it->second->busy = false;
  box_.emit(op->branch, {{"type", "checkpoint.failed"}, {"name", op->name}, {"error", {{"code", code}, {"message", msg}}}});
  os::remove_tree(op->work);
  op->done(error_reply(code, msg));
  op_done();
}

void Checkpointer::snapshot_layer(std::shared_ptr<CheckpointOp> op) {
  std::string src = box_.opts_.state_dir + "/branches/" + op->branch;
  // The agent's /tmp is one of two directories: the upper layer of its /tmp overlay
  // (launcher.cpp), or, where there is no overlay (a live copy, a host without overlay), tmp/
  // itself. Exactly that one is its /tmp in the snapshot: two sources never go into one place.
  bool overlay = tmp_is_overlay(op->ns_init_pid);
  offload(
      [op, src, overlay] {
        for (const char* d : sandbox::kLayerDirs) {
          std::string from = std::string(d) == "tmp" && overlay ? "tmp-upper" : d;
          struct stat st {};
          if (::lstat((src + "/" + from).c_str(), &st) != 0) continue;
          // Overlay whiteouts (devices) are left out of the copy.
          auto r = os::copy_tree(src + "/" + from, op->work + "/payload/fs/" + d, op->error);
          if (!r) return;
          op->fs_bytes += *r;
        }
        op->image_bytes = os::tree_bytes(op->work + "/payload/criu");
      },
      [this, op] {
        op->t_snapped = now_ms();
        auto it = box_.branches_.find(op->branch);
        if (it != box_.branches_.end()) {
          Branch& b = *it->second;
          if (!op->leave_running && op->error.empty()) {
            b.ended_by = "checkpoint";
            // A namespaced ns-init is PID 1 of the branch's pid namespace: killing it ends the
            // whole tree. A flat one is not: every process of the tree goes.
            if (b.launched.namespaced) (void)os::pidfd_signal(op->tree_fd.get(), SIGKILL);
            else kill_tree(op->ns_init_pid, op->tree_fd.get());
          }
        }
        continue_op(*op);
        op->t_resumed = now_ms();
        if (!op->error.empty()) return checkpoint_failed(op, "io", "snapshot the writable layer: " + op->error);
        compress(op);
      });
}

void Checkpointer::compress(std::shared_ptr<CheckpointOp> op) {
  op->manifest["last_seq"] = box_.journal_->last_seq();
  op->manifest["sizes"] = {{"images", op->image_bytes}, {"fs", op->fs_bytes}};
  json::object timings{{"dump", round_ms(op->t_dumped - op->t_stopped)},
                       {"snapshot", round_ms(op->t_snapped - op->t_dumped)},
                       {"stop", round_ms(op->t_stopped - op->t0)},
                       {"freeze", round_ms(op->t_resumed - op->t0)}};
  op->manifest["timings_ms"] = timings;
  std::string tmp = op->work + "/archive.tar.zst";
  offload(
      [op, tmp, key = box_.opts_.signing_key] {
        op->info = write_archive(op->work + "/payload", op->manifest, tmp, 3, key.get(), op->error);
      },
      [this, op, tmp] {
        op->t_compressed = now_ms();
        if (!op->info) return checkpoint_failed(op, "io", "write the archive: " + op->error);
        op->id = "s-" + op->info->sha256.substr(0, 16);
        std::string base = snap_dir_ + "/" + op->id;
        json::object index = op->manifest;
        index["id"] = op->id;
        index["archive"] = {{"path", base + ".tar.zst"},
                            {"sha256", op->info->sha256},
                            {"bytes", op->info->compressed_bytes},
                            {"raw_bytes", op->info->raw_bytes}};
        json::object timings = op->manifest["timings_ms"].as_object();
        timings["compress"] = round_ms(op->t_compressed - op->t_resumed);
        timings["total"] = round_ms(op->t_compressed - op->t0);
        index["timings_ms"] = timings;
        // Who asked: the agent channel of a branch reaches only its own snapshots (channel_refusal).
        index["origin"] = op->by.empty() ? json::object{{"by", "operator"}} : json::object{{"by", "channel"}, {"branch", op->by}};
        if (::rename(tmp.c_str(), (base + ".tar.zst").c_str()) != 0)
          return checkpoint_failed(op, "io", "store the archive: " + std::string(std::strerror(errno)));
        --checkpoints_;
        std::erase(dumping_, op);
        // The payload stays extracted beside the archive: forks of it need no decompression.
        os::remove_tree(base + ".d");
        if (::rename((op->work + "/payload").c_str(), (base + ".d").c_str()) == 0) {
          json::object m = op->manifest;
          m["verified"] = box_.opts_.signing_key
                              ? json::object{{"trusted", true}, {"key", box_.opts_.signing_key->public_key().fingerprint()}}
                              : json::object{{"trusted", false}, {"why", "this box signs nothing (no signing key)"}};
          (void)os::write_file_atomic(base + ".d/manifest.json", json::serialize(m) + "\n");
          (void)os::write_file_atomic(base + ".d/.complete", "");
        }
        (void)os::write_file_atomic(base + ".json", json::serialize(index) + "\n");
        os::remove_tree(op->work);
        if (auto it = box_.branches_.find(op->branch); it != box_.branches_.end()) it->second->busy = false;
        json::object ev{{"type", "checkpoint.created"},
                        {"snapshot", op->id},
                        {"name", op->name},
                        {"parent", op->manifest["parent"]},
                        {"mode", op->live ? "live" : "fs"},
                        {"leave_running", op->leave_running},
                        {"sizes",
                         {{"raw", op->info->raw_bytes},
                          {"compressed", op->info->compressed_bytes},
                          {"images", op->image_bytes},
                          {"fs", op->fs_bytes}}},
                        {"timings_ms", timings},
                        {"archive", base + ".tar.zst"}};
        if (!op->live) ev["note"] = op->note;
        box_.emit(op->branch, ev);
        log()->info("checkpoint {} of branch {}: {} bytes in {} ms", op->id, op->branch, op->info->compressed_bytes,
                    timings["total"].to_number<double>());
        json::object r{{"ok", true}, {"snapshot", op->id}, {"mode", op->live ? "live" : "fs"}, {"sizes", ev["sizes"]},
                       {"timings_ms", timings}};
        if (!op->live) r["note"] = op->note;
        op->done(std::move(r));
        op_done();
      });
}

// ---- restore and fork ----

namespace {

// The manifest of an extracted snapshot dir (base.d), when it is complete.
std::optional<json::object> complete_manifest(const std::string& d) {
  struct stat st {};
  if (::stat((d + "/.complete").c_str(), &st) != 0) return std::nullopt;
  auto text = os::read_file(d + "/manifest.json");
  boost::system::error_code ec;
  json::value v = text ? json::parse(*text, ec) : json::value();
  if (!text || ec || !v.is_object()) return std::nullopt;
  return v.as_object();
}

// Extracts and checks base.tar.zst into a directory of its own, then moves it to base.d unless
// another extraction of the same archive got there first (then that one is the result). Fills
// `result`, else `err` and `code`.
void extract_snapshot(const std::string& base, const std::string& id, const archive::ImportPolicy& policy,
                      std::optional<json::object>& result, std::string& err, std::string& code) {
  // The id is the archive's content hash: check it before reading anything out of it.
  auto sha = archive::sha256_file(base + ".tar.zst", err);
  if (!sha) return;
  if (sha->substr(0, 16) != id.substr(2)) {
    err = "the archive of " + id + " is corrupted: its sha256 is " + *sha;
    return;
  }
  std::string tmp = base + ".d.tmp-" + os::random_hex(6);  // created by mkdir: one per extraction
  bool untrusted = false;
  auto x = archive::extract_archive(base + ".tar.zst", tmp, policy, err, &untrusted);
  if (!x) {
    if (untrusted) code = "untrusted";
    return;
  }
  json::object m = std::move(x->manifest);
  m["verified"] = x->trusted ? json::object{{"trusted", true}, {"key", x->signer}}
                             : json::object{{"trusted", false}, {"why", x->why_untrusted}};
  auto w = os::write_file_atomic(tmp + "/manifest.json", json::serialize(m) + "\n");
  if (w) w = os::write_file_atomic(tmp + "/.complete", "");
  if (!w) {
    err = "store the extracted snapshot: " + w.error().message();
    os::remove_tree(tmp);
    return;
  }
  std::string dst = base + ".d";
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dst.c_str(), RENAME_NOREPLACE) == 0) {
      result = std::move(m);
      return;
    }
    if (errno != EEXIST && errno != ENOTEMPTY) break;
    if (auto other = complete_manifest(dst)) {  // a concurrent extraction finished first
      os::remove_tree(tmp);
      result = std::move(*other);
      return;
    }
    os::remove_tree(dst);  // a leftover of an extraction that never completed
  }
  err = "store the extracted snapshot: " + std::string(std::strerror(errno));
  os::remove_tree(tmp);
}

}  // namespace

void Checkpointer::with_extracted(const std::string& id, Extracted fn) {
  std::string base = snap_dir_ + "/" + id;
  if (auto m = complete_manifest(base + ".d")) return fn(std::move(*m), "", "");
  struct stat st {};
  if (::stat((base + ".tar.zst").c_str(), &st) != 0) return fn(std::nullopt, "no snapshot \"" + id + "\"", "bad_snapshot");
  struct State {
    std::optional<json::object> result;
    std::string err, code = "bad_snapshot";
  };
  auto state = std::make_shared<State>();
  offload([base, id, state, policy = policy_] { extract_snapshot(base, id, policy, state->result, state->err, state->code); },
          [state, fn] { fn(std::move(state->result), state->err, state->code); });
}

std::string Checkpointer::next_branch_name() {
  for (;;) {
    // Built by appending: GCC 12 at -O3 reports a false -Wrestrict on "f" + std::to_string(n).
    std::string n = "f";
    n.append(std::to_string(next_copy_++));
    std::string dir = box_.opts_.state_dir;
    dir.append("/branches/").append(n);
    struct stat st {};
    if (!box_.branches_.contains(n) && ::stat(dir.c_str(), &st) != 0) return n;
  }
}

void Checkpointer::restore(const std::string& snapshot, int n, bool fork, Reply done, const std::string& name,
                           int first_index) {
  if (!archive::valid_snapshot_id(snapshot))
    return done(error_reply("bad_request", "\"" + snapshot + "\" is not a snapshot id (s- and 16 hex digits)"));
  if (n < 1 || n > 64) return done(error_reply("bad_request", "n must be 1..64"));
  auto op = std::make_shared<RestoreOp>();
  op->snapshot = snapshot;
  op->n = n;
  op->fork = fork;
  op->done = std::move(done);
  op->forced_name = name;
  op->first_index = first_index;
  op->t0 = now_ms();
  if (box_.shutting_down_) return op->done(error_reply("shutting_down", "the box is shutting down"));
  // Every copy runs with the profile's full ceilings: the box runs at most resources.copies.
  // (A box's own start from an archive restores its main branch, no copy.)
  if (name != "main")
    if (auto refusal = copies_refusal("main", n)) return op->done(std::move(*refusal));
  op->counted = name != "main";
  if (op->counted) copies_starting_ += n;
  ++ops_;
  with_extracted(snapshot, [this, op](std::optional<json::object> m, std::string err, std::string code) {
    if (!m) {
      log()->error("restore {}: {}", op->snapshot, err);
      box_.emit("main", {{"type", "restore.failed"}, {"snapshot", op->snapshot}, {"error", err}});
      if (op->counted) copies_starting_ -= op->n;
      op->done(error_reply(code, err));
      return op_done();
    }
    op->manifest = std::move(*m);
    std::string mode(op->manifest.contains("mode") && op->manifest.at("mode").is_string()
                         ? op->manifest.at("mode").as_string()
                         : "fs");
    // Only an archive a trusted key signed goes to criu, which restores its images as root; any
    // other (accepted under --allow-unsigned) is restored cold: its files, the agent's command again.
    auto* verified = op->manifest.if_contains("verified");
    auto* trusted = verified && verified->is_object() ? verified->as_object().if_contains("trusted") : nullptr;
    if (mode == "live" && !(trusted && trusted->is_bool() && trusted->as_bool())) {
      auto* why = verified && verified->is_object() ? verified->as_object().if_contains("why") : nullptr;
      op->note = "restored cold, its criu images unused: the archive is untrusted (" +
                 (why && why->is_string() ? std::string(why->as_string()) : std::string("no signature checked")) + ")";
      mode = "fs";
    }
    op->live = mode == "live";
    json::object checked = op->manifest;
    checked["mode"] = mode;
    std::string why;
    std::optional<std::string> refuse;
    if (mode == "live" && !live_possible(&why)) refuse = "a live snapshot needs criu here: " + why;
    else refuse = archive::incompatibility(checked, box_.caps_.criu, image_id_);
    if (!refuse && mode == "live")
      if (auto r = box_.copy_network_refusal(op->manifest); !r.empty()) refuse = r;
    // criu does not restore Landlock: a live copy in a box whose profile asks for it would run
    // without it. A cold copy gets it again.
    if (!refuse && mode == "live" && box_.opts_.profile.isolation.landlock)
      refuse = "a live snapshot restores without Landlock, and this box's profile asks for Landlock";
    if (refuse) {
      box_.emit("main", {{"type", "restore.failed"}, {"snapshot", op->snapshot}, {"error", *refuse}});
      if (op->counted) copies_starting_ -= op->n;
      op->done(error_reply("incompatible", *refuse));
      return op_done();
    }
    op->pending = op->n;
    op->pipes.resize(static_cast<size_t>(op->n));
    for (int i = 0; i < op->n; ++i) restore_copy(op, i);
  });
}

void Checkpointer::restore_copy(std::shared_ptr<RestoreOp> op, int index) {
  std::string name = op->forced_name.empty() ? next_branch_name() : op->forced_name;
  std::string dir = box_.opts_.state_dir + "/branches/" + name;
  std::string src = snap_dir_ + "/" + op->snapshot + ".d";
  bool live = op->live;
  auto b = std::make_shared<std::unique_ptr<Branch>>(std::make_unique<Branch>());
  Branch& br = **b;
  br.name = name;
  br.main_proc = name == "main" ? "main" : "main@" + name;
  br.mode = live ? "live" : "cold";
  br.parent = std::string(op->manifest.at("branch").as_string());
  br.snapshot = op->snapshot;
  br.index = op->first_index + index;
  if (auto* a = op->manifest.at("agent").as_object().if_contains("argv"))
    for (auto& v : a->as_array()) br.argv.emplace_back(v.as_string());
  br.cwd = std::string(op->manifest.at("agent").at("cwd").as_string());
  // A copy gets exactly its parent's policy: Landlock (a cold copy's agent gets it again; a live
  // one is refused above where the profile asks for it), and the workspace's disk ceiling and
  // owner, mounted before the snapshot's files are copied into it.
  br.landlocked = box_.opts_.profile.isolation.landlock.has_value();
  auto err = std::make_shared<std::string>();
  if (auto r = os::make_dirs(dir + "/workspace", 0755); !r) *err = "create " + dir + "/workspace: " + r.error().message();
  else if (auto ws = box_.mount_workspace(br, dir); ws.starts_with("not enforced")) *err = "the copy's workspace: " + ws;
  double t_start = now_ms();
  json::array masks;
  if (auto* m = op->manifest.if_contains("masks"); m && m->is_array()) masks = m->as_array();
  offload(
      [src, dir, err, masks, live] {
        if (!err->empty()) return;
        if (auto r = os::make_dirs(dir, 0755); !r) {
          *err = "create " + dir + ": " + r.error().message();
          return;
        }
        for (const char* d : sandbox::kLayerDirs) {
          struct stat st {};
          if (::lstat((src + "/fs/" + d).c_str(), &st) != 0) continue;
          // The workspace is there already: mounted with the parent's disk ceiling and owner.
          bool into = std::string_view(d) == "workspace";
          if (!(into ? os::copy_tree_into : os::copy_tree)(src + "/fs/" + d, dir + "/" + d, *err)) return;
        }
        // A cold copy gets the /tmp overlay again: its files go to the upper layer.
        if (!live && !os::copy_tree(src + "/fs/tmp", dir + "/tmp-upper", *err)) return;
        // A live copy's /tmp is a directory of its own (not the original's overlay): the mount
        // points of the masks criu restores below /tmp must exist in it.
        for (auto& v : masks) {
          if (!v.is_object()) continue;
          std::string path(v.at("path").as_string());
          if (!path.starts_with("/tmp/")) continue;
          // The copy's tmp/ came from the agent's files: nothing in it is followed.
          std::string rel = "tmp" + path.substr(4);
          auto top = os::open_dir(dir);
          if (!top) continue;
          if (v.at("dir").as_bool()) {
            if (auto r = os::make_dirs_at(top->get(), rel, 0755); !r)
              log()->warn("create the mount point {} in {}: {}", path, dir, r.error().message());
          } else if (auto p = os::make_dirs_at(top->get(), rel.substr(0, rel.rfind('/')), 0755); !p) {
            log()->warn("create the mount point {} in {}: {}", path, dir, p.error().message());
          } else if (auto r = os::write_file_atomic_at(p->get(), rel.substr(rel.rfind('/') + 1), ""); !r) {
            log()->warn("create the mount point {} in {}: {}", path, dir, r.error().message());
          }
        }
      },
      [this, op, index, b, err, dir, src, live, t_start] {
        Branch& br = **b;
        double t_copied = now_ms();
        json::object res{{"branch", br.name}, {"index", br.index}};
        if (!err->empty()) {
          res["error"] = "copy the snapshot's files: " + *err;
          return copy_done(op, index, std::move(res));
        }
        write_branch_json(box_, br, dir);
        if (!live) {
          // Cold restart: the agent's command again, on the snapshot's files.
          sandbox::BranchSpec spec = box_.branch_spec(br.name);
          if (auto e = box_.prepare_copy_network(spec); !e.empty()) {
            res["error"] = e;
            return copy_done(op, index, std::move(res));
          }
          // The cold copy's agent gets the profile's process policy (caps, rlimits, seccomp,
          // Landlock) as the original's did, and a cgroup of its own with the original's ceilings.
          auto cg = box_.prepare_copy_cgroup(br);
          for (auto& fd : cg) spec.cgroup_procs.push_back(fd.get());
          auto lb = sandbox::launch_branch(spec);
          cg.clear();
          if (!lb) {
            res["error"] = "start the copy: " + lb.error().message();
            return copy_done(op, index, std::move(res));
          }
          br.launched = std::move(*lb);
          std::string cwd = br.launched.namespaced ? br.cwd : dir + "/workspace";
          auto env = box_.agent_env(br, dir);
          env.emplace_back("SANDBOXER_RESUMED=1");
          env.emplace_back("SANDBOXER_SNAPSHOT=" + op->snapshot);
          if (auto e = box_.attach_copy_network(br, &env); !e.empty()) {
            ::kill(br.launched.pid, SIGKILL);  // its ns-init still waits for its config
            res["error"] = e;
            return copy_done(op, index, std::move(res));
          }
          box_.send_request(br, sandbox::ns_init_config(br.argv, std::move(env), cwd, box_.opts_.profile,
                                                        box_.caps_.landlock_abi, br.launched.namespaced));
          br.launched.in.reset();
          Branch& added = box_.add_branch(std::move(*b), false);
          box_.start_watcher(added);
          box_.channel_reply(added, [&] {
            auto w = identity(box_, added);
            w["type"] = "whoami";
            return w;
          }());
          res["mode"] = "cold";
          res["proc"] = added.main_proc;
          res["timings_ms"] = {{"copy", round_ms(t_copied - t_start)}, {"restore", round_ms(now_ms() - t_copied)}};
          return copy_done(op, index, std::move(res));
        }
        auto pipes = sandbox::make_branch_pipes();
        if (!pipes) {
          res["error"] = "make pipes: " + pipes.error().message();
          return copy_done(op, index, std::move(res));
        }
        auto& pp = op->pipes[static_cast<size_t>(index)];
        pp = std::make_unique<sandbox::BranchPipes>(std::move(*pipes));
        CriuRun run;
        (void)os::make_dirs(dir + "/.criu", 0700);
        run.args = {"restore",
                    "--images-dir", src + "/criu",
                    "--work-dir", dir + "/.criu",
                    "--log-file", "restore.log",
                    "--root", dir + "/root",
                    "--restore-sibling",
                    "--restore-detached",
                    "--manage-cgroups=ignore",
                    "--tcp-close",
                    "--file-locks",
                    "--ext-mount-map", "auto",
                    "--external", "mnt[workspace]:" + dir + "/workspace",
                    "--external", "mnt[tmp]:" + dir + "/tmp",
                    "--external", "mnt[run]:" + dir + "/run",
                    "--external", "mnt[machine-id]:" + dir + "/" + sandbox::kMachineIdFile,
                    "--pidfile", dir + "/.criu/pid"};
        auto ends = pp->child_ends();
        auto& old = op->manifest.at("pipes").as_object();
        for (size_t i = 0; i < 7; ++i) {
          run.fds.push_back(ends[i]);
          auto* ino = old.if_contains(kPipeRoles[i]);
          if (!ino || !ino->is_number()) continue;
          run.args.push_back("--inherit-fd");
          run.args.push_back("fd[" + std::to_string(kCriuFirstFd + static_cast<int>(i)) + "]:pipe:[" +
                             std::to_string(ino->to_number<uint64_t>()) + "]");
        }
        run.new_netns = true;
        run.writable_proc_sys = true;
        run.hostname = (*b)->name + "." + box_.id_;
        sandbox::ensure_machine_id(dir);  // a new one: the copy is another running system
        run.output = dir + "/.criu/restore.out";
        // Its own cgroup, with the original's ceilings: criu joins it, and so does all it restores.
        auto cg = box_.prepare_copy_cgroup(**b);
        for (auto& fd : cg) run.cgroup_procs.push_back(fd.get());
        auto pid = spawn_criu(*criu_, run);
        cg.clear();
        if (!pid) {
          res["error"] = "start criu: " + pid.error().message();
          return copy_done(op, index, std::move(res));
        }
        box_.reaper_.watch(*pid, [this, op, index, b, dir, res, t_start, t_copied](pid_t, int st) mutable {
          auto& pp = op->pipes[static_cast<size_t>(index)];
          if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            res["error"] = "criu restore failed: " + criu_error_from_log(dir + "/.criu/restore.log");
            pp.reset();
            return copy_done(op, index, std::move(res));
          }
          auto text = os::read_file(dir + "/.criu/pid");
          pid_t root = text ? static_cast<pid_t>(std::atoi(text->c_str())) : -1;
          if (root <= 0) {
            res["error"] = "criu restore left no pid file";
            pp.reset();
            return copy_done(op, index, std::move(res));
          }
          Branch& br = **b;
          br.launched.pid = root;
          br.launched.namespaced = true;
          br.launched.take(*pp);
          pp.reset();  // closes the copy's ends: the restored tree holds them now
          br.launched.in.reset();
          // Its network before it runs: the copy's own broker where the agent expects it.
          if (auto e = box_.attach_copy_network(br); !e.empty()) {
            ::kill(root, SIGKILL);
            res["error"] = e;
            return copy_done(op, index, std::move(res));
          }
          Branch& added = box_.add_branch(std::move(*b), true);
          box_.start_watcher(added);
          // The tree was dumped stopped, so criu restored it stopped: it runs from here.
          continue_tree(root, added.pidfd.get());
          // The copy's first line on its channel says who it is; a channel request the original
          // was waiting on at the dump gets its answer in the copy too.
          auto w = identity(box_, added);
          w["type"] = "whoami";
          box_.channel_reply(added, w);
          if (auto* cr = op->manifest.if_contains("channel_request"); cr && cr->is_int64()) {
            box_.channel_reply(added, {{"id", cr->as_int64()},
                                       {"ok", true},
                                       {"snapshot", op->snapshot},
                                       {"copy", true},
                                       {"branch", added.name},
                                       {"index", added.index},
                                       {"mode", "live"}});
          }
          res["mode"] = "live";
          res["proc"] = added.main_proc;
          res["pid"] = root;
          res["timings_ms"] = {{"copy", round_ms(t_copied - t_start)}, {"restore", round_ms(now_ms() - t_copied)}};
          copy_done(op, index, std::move(res));
        });
      });
}

void Checkpointer::copy_done(std::shared_ptr<RestoreOp> op, int /*slot*/, json::object res) {
  std::string branch(res.at("branch").as_string());
  json::object ev{{"type", "restore.done"},
                  {"snapshot", op->snapshot},
                  {"parent", op->manifest.at("branch")},
                  {"parent_box", op->manifest.at("box")},
                  {"index", res.at("index")},
                  {"of", op->n}};
  if (op->counted) --copies_starting_;
  if (res.contains("error")) {
    // Nothing half-restored stays behind: the copy's directory goes with its failure (its
    // workspace's mount first, if it got one).
    if (!box_.branches_.contains(branch)) {
      std::string dir = box_.opts_.state_dir + "/branches/" + branch;
      (void)::umount2((dir + "/workspace").c_str(), MNT_DETACH | UMOUNT_NOFOLLOW);
      os::remove_tree(dir);
    }
    ev["type"] = "restore.failed";
    ev["error"] = res.at("error");
    log()->error("restore {} as {}: {}", op->snapshot, branch, res.at("error").as_string());
    box_.emit(branch, ev);
  } else {
    ev["mode"] = res.at("mode");
    if (!op->note.empty()) ev["note"] = res["note"] = op->note;
    ev["proc"] = res.at("proc");
    ev["timings_ms"] = res.at("timings_ms");
    box_.emit(branch, ev);
  }
  op->results.emplace_back(std::move(res));
  if (--op->pending > 0) return;
  json::array branches;
  bool all_ok = true;
  for (auto& r : op->results) {
    all_ok &= !r.as_object().contains("error");
  }
  double total = round_ms(now_ms() - op->t0);
  if (op->fork) {
    box_.emit("main", {{"type", "fork.created"},
                       {"snapshot", op->snapshot},
                       {"n", op->n},
                       {"copies", op->results},
                       {"timings_ms", {{"total", total}}}});
  }
  json::object reply{{"ok", all_ok}, {"snapshot", op->snapshot}, {"copies", op->results}, {"timings_ms", {{"total", total}}}};
  if (!all_ok) reply["error"] = {{"code", "restore_failed"}, {"message", "some copies could not be restored"}};
  op->done(std::move(reply));
  op_done();
}

// ---- snapshot store ----

json::array Checkpointer::list() const {
  json::array out;
  DIR* d = ::opendir(snap_dir_.c_str());
  if (!d) return out;
  std::vector<std::string> names;
  while (auto* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.size() > 5 && n.ends_with(".json") && archive::valid_snapshot_id(n.substr(0, n.size() - 5))) names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (auto& n : names) {
    auto text = os::read_file(snap_dir_ + "/" + n);
    boost::system::error_code ec;
    if (!text) continue;
    auto v = json::parse(*text, ec);
    if (ec || !v.is_object()) continue;
    auto& o = v.as_object();
    o.erase("files");
    out.push_back(std::move(v));
  }
  return out;
}

json::object Checkpointer::remove(const std::string& id) {
  if (!archive::valid_snapshot_id(id)) return error_reply("bad_request", "\"" + id + "\" is not a snapshot id");
  std::string base = snap_dir_ + "/" + id;
  struct stat st {};
  if (::stat((base + ".json").c_str(), &st) != 0 && ::stat((base + ".tar.zst").c_str(), &st) != 0)
    return error_reply("not_found", "no snapshot \"" + id + "\"");
  ::unlink((base + ".tar.zst").c_str());
  ::unlink((base + ".json").c_str());
  os::remove_tree(base + ".d");
  box_.emit("main", {{"type", "snapshot.deleted"}, {"snapshot", id}});
  return {{"ok", true}};
}

std::optional<std::string> Checkpointer::archive_path(const std::string& id, std::string& err) const {
  if (!archive::valid_snapshot_id(id)) {
    err = "\"" + id + "\" is not a snapshot id (s- and 16 hex digits)";
    return std::nullopt;
  }
  std::string path = snap_dir_ + "/" + id + ".tar.zst";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    err = "no snapshot \"" + id + "\"";
    return std::nullopt;
  }
  return path;
}

std::string Checkpointer::incoming_path() const {
  (void)os::make_dirs(snap_dir_, 0700);
  return snap_dir_ + "/.import-" + os::random_hex(6);
}

void Checkpointer::import_archive(const std::string& tmp, Reply done, bool announce) {
  // An import is one more snapshot kept (not a box's own start from an archive: its store is new).
  if (announce)
    if (auto refusal = snapshots_refusal("main")) {
      ::unlink(tmp.c_str());
      return done(std::move(*refusal));
    }
  ++ops_;
  struct State {
    std::string err, id;
    uint64_t bytes = 0;
    bool existing = false;
  };
  auto st = std::make_shared<State>();
  std::string dir = snap_dir_;
  offload(
      [tmp, dir, st] {
        struct stat sb {};
        if (::stat(tmp.c_str(), &sb) == 0) st->bytes = static_cast<uint64_t>(sb.st_size);
        auto sha = archive::sha256_file(tmp, st->err);
        if (!sha) return;
        st->id = "s-" + sha->substr(0, 16);
        std::string dst = dir + "/" + st->id + ".tar.zst";
        // Filed under its id without replacing anything: a second import of the same archive
        // (even one at the same moment) finds it there and says so.
        if (::link(tmp.c_str(), dst.c_str()) == 0) {
          ::unlink(tmp.c_str());
        } else if (errno == EEXIST) {
          st->existing = true;  // the same content is here already: its id says so
          ::unlink(tmp.c_str());
        } else {
          st->err = "store the archive: " + std::string(std::strerror(errno));
        }
      },
      [this, tmp, st, announce, done = std::move(done)] {
        if (!st->err.empty()) {
          ::unlink(tmp.c_str());
          done(error_reply("bad_snapshot", st->err));
          return op_done();
        }
        // Verify it whole now (its signature, every entry against the manifest, the format
        // version), so an untrusted, corrupted or truncated upload is refused here and not at
        // its first restore.
        with_extracted(st->id, [this, st, announce, done](std::optional<json::object> m, std::string e, std::string code) {
          std::string base = snap_dir_ + "/" + st->id;
          if (!m) {
            if (!st->existing) ::unlink((base + ".tar.zst").c_str());
            log()->warn("import refused: {}", e);
            done(error_reply(code,
                             e.starts_with("the archive is refused") ? e : "the archive is refused: " + e));
            return op_done();
          }
          json::object index = *m;
          index["id"] = st->id;
          index.erase("files");
          index["archive"] = {{"path", base + ".tar.zst"}, {"bytes", st->bytes}};
          index["imported"] = base::rfc3339_now();
          if (!st->existing) (void)os::write_file_atomic(base + ".json", json::serialize(index) + "\n");
          auto* v = index.if_contains("verified");
          json::value trusted = v && v->is_object() && v->as_object().contains("trusted") ? v->at("trusted") : false;
          json::value signer = v && v->is_object() && v->as_object().contains("key") ? v->at("key") : nullptr;
          if (announce)
            box_.emit("main", {{"type", "snapshot.imported"},
                             {"snapshot", st->id},
                             {"bytes", st->bytes},
                             {"existing", st->existing},
                             {"trusted", trusted},
                             {"signed_by", signer},
                             {"box", index.contains("box") ? index.at("box") : json::value(nullptr)}});
          json::object r{{"ok", true}, {"snapshot", st->id}, {"bytes", st->bytes}, {"existing", st->existing},
                         {"trusted", trusted}, {"signed_by", signer},
                         {"mode", index.contains("mode") ? index.at("mode") : json::value(nullptr)}};
          if (trusted != true) r["note"] = "untrusted, accepted under --allow-unsigned: it restores cold, files only";
          done(std::move(r));
          op_done();
        });
      });
}

void Checkpointer::start_from_archive(const std::string& path) {
  ++ops_;
  auto err = std::make_shared<std::string>();
  std::string tmp = incoming_path();
  offload([path, tmp, err] {
            // The operator's path may be a symlink (copy_tree follows none): resolved here.
            std::unique_ptr<char, decltype(&std::free)> real(::realpath(path.c_str(), nullptr), &std::free);
            (void)os::copy_tree(real ? real.get() : path, tmp, *err);
          },
          [this, err, tmp, path] {
            auto fail = [this](const std::string& msg) {
              log()->critical("restore from archive: {}", msg);
              box_.emit_started();
              box_.emit("main", {{"type", "restore.failed"}, {"error", msg}});
              box_.exit_status_ = 125;
              box_.finish(125);
              op_done();
            };
            if (!err->empty()) {
              ::unlink(tmp.c_str());
              return fail(path + ": " + *err);
            }
            import_archive(tmp, [this, fail, path](json::object r) {
              if (!r.at("ok").as_bool()) return fail(path + ": " + std::string(r.at("error").at("message").as_string()));
              std::string id(r.at("snapshot").as_string());
              // Continue the parent's numbering.
              auto text = os::read_file(snap_dir_ + "/" + id + ".json");
              boost::system::error_code ec;
              json::value m = text ? json::parse(*text, ec) : json::value();
              if (!ec && m.is_object())
                if (auto* ls = m.as_object().if_contains("last_seq"); ls && ls->is_number())
                  box_.journal_->skip_to(ls->to_number<uint64_t>());
              restore(id, 1, false,
                      [this](json::object r2) {
                        box_.emit_started();
                        if (!r2.at("ok").as_bool()) box_.finish(125);
                      },
                      "main", box_.opts_.restore_index);
              op_done();
            }, false);
          });
}

}  // namespace sbx::checkpoint
