// Checkpoint: a branch's tree stopped, dumped by criu (live) or not (files only), its writable
// layer copied at the same instant, and one signed archive written (checkpointer.hpp).
#include "checkpoint/checkpointer.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "archive/archive.hpp"
#include "base/encoding.hpp"
#include "checkpoint/criu.hpp"
#include "checkpoint/internal.hpp"
#include "os/files.hpp"
#include "os/pidfd.hpp"
#include "os/proc-view.hpp"
#include "os/sys.hpp"
#include "sandbox/launcher.hpp"

namespace sbx::checkpoint {

namespace json = boost::json;
using namespace detail;

namespace detail {

void continue_tree(pid_t root, int root_fd) {
  (void)os::pidfd_signal(root_fd, SIGCONT);
  for (auto& m : os::tree_pidfds(root, root_fd)) (void)os::pidfd_signal(m.fd.get(), SIGCONT);
}

}  // namespace detail

namespace {

// The refusal of a criu beside the agent while the kerndat cache is empty (when_kdat_ready).
const std::string kKdatRefused =
    "criu is not started beside the agent while its kerndat cache is empty (see checkpoint/README.md): ";

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

void kill_tree(pid_t root, int root_fd) {
  auto members = os::tree_pidfds(root, root_fd);
  (void)os::pidfd_signal(root_fd, SIGKILL);
  for (auto& m : members) (void)os::pidfd_signal(m.fd.get(), SIGKILL);
}

// The profile's document as JSON (null if it is none): a box started elsewhere from the snapshot
// is given it (fork onto another host).
json::value profile_document(const std::string& text) {
  boost::system::error_code ec;
  auto v = json::parse(text, ec);
  return !ec && v.is_object() ? v : json::value(nullptr);
}

std::string kernel_release() {
  struct utsname u {};
  ::uname(&u);
  return u.release;
}

// The paths masked in a branch's view (launcher.cpp), each a mount point criu restores: as the
// launcher masks them, by their real paths.
// A live branch's masks below /tmp are also taken from its own mount table: those sit in its /tmp
// overlay, which keeps a mount under the name its path had at the branch's start, and criu dumps
// that mount; a path the host has renamed or removed since (a token file) is no longer there to
// resolve, and a copy needs the mount point in its /tmp's upper layer all the same (copy_layer).
json::array mask_list(const std::vector<std::string>& masks, pid_t ns_init = 0) {
  json::array out;
  for (const auto& [path, st] : sandbox::outermost_masks(masks))
    out.push_back({{"path", path}, {"dir", S_ISDIR(st.st_mode)}});
  if (ns_init <= 0) return out;
  for (auto& m : os::mounts_under("/tmp", ns_init)) {
    if (m.path == "/tmp" ||
        std::any_of(out.begin(), out.end(), [&](const json::value& v) { return v.at("path").as_string() == m.path; }))
      continue;
    struct stat st {};
    if (::lstat(("/proc/" + std::to_string(ns_init) + "/root" + m.path).c_str(), &st) == 0)
      out.push_back({{"path", m.path}, {"dir", S_ISDIR(st.st_mode)}});
  }
  return out;
}

// The mounts the branch whose ns-init is `ns_init` sees beneath the host's directories (its
// top-level directories but for its own: a container's /etc/resolv.conf, a container beside the
// box, a user's mount), but for the masks: criu restores each where it was, bound from the same
// path of the host it restores on, and a copy needs it there (restore.cpp, missing_host_mount).
json::array host_mount_list(pid_t ns_init, const json::array& masks) {
  json::array out;
  if (ns_init <= 0) return out;
  auto all = os::mounts_under("/", ns_init);
  auto own = [](std::string_view name) {
    return std::find(std::begin(sandbox::kOwnTopDirs), std::end(sandbox::kOwnTopDirs), name) !=
           std::end(sandbox::kOwnTopDirs);
  };
  std::set<std::string, std::less<>> tops;
  for (auto& m : all)
    if (m.path.size() > 1 && m.path.find('/', 1) == std::string::npos && !own(m.path.substr(1))) tops.insert(m.path);
  std::set<std::string> seen;
  for (auto& m : all) {
    auto slash = m.path.find('/', 1);
    if (slash == std::string::npos || !tops.contains(std::string_view(m.path).substr(0, slash))) continue;
    if (std::any_of(masks.begin(), masks.end(),
                    [&](const json::value& v) { return v.at("path").as_string() == m.path; }))
      continue;
    if (seen.insert(m.path).second) out.push_back({{"path", m.path}, {"type", m.fstype}});
  }
  return out;
}

// What the copy of one of a branch's layer dirs may write, `in_dir` bytes copied already from its
// dir's filesystem where this one is there too: no more than the filesystem it comes from can
// hold under the branch's disk ceiling (its workspace is one, its dir with /tmp, /run and the
// root's top the other, each of `ceiling` bytes), leaving the state dir what `room` keeps. A copy
// that keeps hard links and holes (os::copy_tree) needs no more than its source takes.
os::CopyBound layer_bound(const os::CopyBound& room, uint64_t ceiling, uint64_t in_dir) {
  os::CopyBound b = room;
  if (ceiling) {
    b.bytes = ceiling - std::min(ceiling, in_dir);
    b.what = "the branch's disk ceiling (resources.disk: " + std::to_string(ceiling) +
             " bytes for its workspace, as many for its /tmp, /run and root together)";
    b.code = "limit";
  }
  return b;
}

// Whether the branch's /tmp, as its ns-init sees it, keeps its files in tmp-upper/ (its /tmp
// overlay over the host's /tmp, or a live copy's bind of tmp-upper/ where no overlay could be
// had) rather than being the branch's tmp/ itself (a launched branch's where no overlay could be
// had). Told by identity, not by a mount table's strings: a bind of tmp/ on a state dir that is
// itself on overlayfs (a container's root) shows as "overlay" there too.
bool tmp_in_upper(pid_t pid, const std::string& dir) {
  struct stat seen {};
  struct stat own {};
  if (::stat(("/proc/" + std::to_string(pid) + "/root/tmp").c_str(), &seen) != 0) return false;
  if (::lstat((dir + "/tmp").c_str(), &own) != 0) return true;
  return seen.st_dev != own.st_dev || seen.st_ino != own.st_ino;
}

// The most entries a layer dir's copy records while its agent runs (os::CopyRecord, ~80 bytes
// each: ~20 MiB of the supervisor's memory); past them, the rest is copied while it is stopped.
constexpr size_t kRecordEntries = 1u << 18;

// Whether the filesystem of `path` is one whose times are known to move at every change of a
// file's data but writes through a page mapped and written before (ext4, xfs, btrfs: their
// page_mkwrite; tmpfs: the kernel's own at the write fault): those are copied again by the
// tree_files scans and the 2 s rule. Elsewhere (a network or FUSE filesystem, whose times
// may be another machine's) a file kept by its times is also compared by its data.
bool times_follow_mappings(const std::string& path) {
  struct statfs fs {};
  if (::statfs(path.c_str(), &fs) != 0) return false;
  for (uint64_t magic : {0xEF53ull, 0x58465342ull, 0x9123683Eull, 0x01021994ull})
    if (static_cast<uint64_t>(fs.f_type) == magic) return true;
  return false;
}

// A pass of copy_layer: the copy while the agent runs; a sync of it while the agent still runs,
// recorded again (what changed during the copy, so that less is left for the stop); the sync once
// the agent is stopped, not recorded (with no copy before, a copy).
enum class LayerPass { copy, resync, sync };

// The branch's layer (sandbox::kLayerDirs; its /tmp from tmp-upper/ where `in_upper`), from its
// dir `src` into `fs` (a payload's fs/), each dir within layer_bound: copied, each dir's entries
// recorded in `records` (LayerPass::copy); else brought up to date from those records
// (os::sync_tree, `policy`), a dir with none copied whole, and with LayerPass::resync recorded
// anew. The bytes of data the layer's copy holds, or what failed (code io for a plain failure).
base::Result<uint64_t> copy_layer(const std::string& src, const std::string& fs, bool in_upper,
                                  const os::CopyBound& room, uint64_t ceiling,
                                  std::vector<std::optional<os::CopyRecord>>& records, LayerPass pass,
                                  os::SyncPolicy policy) {
  bool sync = pass != LayerPass::copy, record = pass != LayerPass::sync;
  records.resize(std::size(sandbox::kLayerDirs));
  uint64_t in_dir = 0, total = 0;  // written from the branch's dir, one filesystem under a ceiling
  for (size_t i = 0; i < std::size(sandbox::kLayerDirs); ++i) {
    std::string d = sandbox::kLayerDirs[i];
    std::string from = src + "/" + (d == "tmp" && in_upper ? "tmp-upper" : d), to = fs + "/" + d;
    struct stat st {};
    bool there = ::lstat(from.c_str(), &st) == 0;
    bool ws = d == "workspace";
    auto bound = layer_bound(room, ceiling, ws ? 0 : in_dir);
    base::Result<uint64_t> r = uint64_t{0};
    if (sync && records[i] && there && S_ISDIR(st.st_mode)) {
      policy.compare_data = !times_follow_mappings(from);
      os::CopyRecord next;
      next.max_entries = kRecordEntries;
      r = os::sync_tree(from, to, *records[i], policy, bound, record ? &next : nullptr);
      if (r && record) records[i] = std::move(next);
    } else {
      if (sync) os::remove_tree(to);  // a dir that came or went (or changed type) since
      records[i].reset();
      if (!there) continue;
      if (record) records[i].emplace().max_entries = kRecordEntries;
      r = os::copy_tree(from, to, bound, record ? &*records[i] : nullptr);
    }
    if (!r) return base::fail(r.error().message, r.error().code == "failed" ? "io" : r.error().code);
    total += *r;
    if (!ws) in_dir += *r;
  }
  return total;
}

// Whether a pass of copy_layer that took `took_ms` and left `records` is worth another while the
// agent runs: it copied something anew, and took long enough for the agent to change much meanwhile.
constexpr int kResyncs = 3;  // at most, after the copy
bool resync_worth(const std::vector<std::optional<os::CopyRecord>>& records, double took_ms) {
  constexpr double kResyncAfterMs = 250;
  uint64_t renewed = 0;
  for (auto& r : records)
    if (r) renewed += r->renewed;
  return renewed > 0 && took_ms >= kResyncAfterMs;
}

}  // namespace

struct Checkpointer::CheckpointOp {
  std::string branch, name;
  bool leave_running = true;
  Reply done;
  bool live = false;
  std::string note;                                // why files only
  std::string work;                                // snapshots/.work-X: payload/{criu,fs}, logs
  std::shared_ptr<const archive::SigningKey> key;  // what signs the archive; null: nothing does
  std::string by;                                  // the branch whose agent channel asked, or "" (the operator)
  bool chunked = false;                            // kept in the chunk store, not as an archive file
  pid_t ns_init_pid = -1;  // the branch's ns-init (the root of its tree), in the supervisor's pid namespace
  os::UniqueFd tree_fd;    // a pidfd of ns_init_pid: the tree is stopped, continued, killed through it
  pid_t criu = -1;         // criu dumping it, until the reaper collects it
  bool stopped = false;    // the tree is stopped by us and not continued yet
  int64_t hold_ms = 0;     // checkpoint_held: the tree stays stopped after the dump, this long at most
  bool held = false;       // ... and it is (held_[branch])
  // t_stop: when the tree is told to stop (a live one once criu may start: when_kdat_ready).
  double t0 = 0, t_stop = 0, t_stopped = 0, t_dumped = 0, t_snapped = 0, t_resumed = 0, t_compressed = 0;
  double probe_wait = 0;  // ms the checkpoint waited for criu's kernel probe (0: it did not wait)
  json::object manifest;
  uint64_t fs_bytes = 0, image_bytes = 0;
  uint64_t ghost_limit = 0;  // criu's --ghost-limit for its dump
  // The layer copied before the tree stopped (precopy): each layer dir's record, by its index in
  // sandbox::kLayerDirs (none where it was not there), whether its /tmp was tmp-upper/ then, and
  // what the tree mapped shared and writable then.
  bool precopied = false;
  bool in_upper = false;
  std::vector<std::optional<os::CopyRecord>> records;
  std::set<std::pair<dev_t, ino_t>> mapped;
  double precopy_ms = -1;
  int resyncs = 0;  // the syncs of the layer's copy while the agent ran (after its copy)
  std::string error;
  std::string error_code = "io";  // limit or no_space past a bound of the layer copy or the archive
  std::optional<archive::ArchiveInfo> info;
  std::string id;
  std::shared_ptr<ForkSeal> fork;  // fork_branch: copies of it start before its archive is sealed
};

Checkpointer::Checkpointer(uv_loop_t* loop, Host& host, Settings settings)
    : loop_(loop),
      host_(host),
      settings_(std::move(settings)),
      snap_dir_(settings_.state_dir + "/snapshots"),
      criu_(find_criu()),
      image_id_(archive::read_image_id()) {}

void Checkpointer::open_store() {
  (void)os::make_dirs(snap_dir_, 0700);
  // What a supervisor killed while it took a snapshot or forked one left: its work dirs, the
  // linked trees of forks (fork_early), and chunks no list names yet.
  std::error_code ec;
  for (auto& e : std::filesystem::directory_iterator(snap_dir_, ec)) {
    std::string name = e.path().filename().string();
    if (name.starts_with(".work-") || name.starts_with(".fork-")) {
      log()->info("removing {}, left by a supervisor that ended before its checkpoint or fork did", name);
      os::remove_tree(e.path().string());
    }
  }
  collect_chunks();
}

base::Result<archive::ImportPolicy> Checkpointer::import_policy() const {
  archive::ImportPolicy p;
  if (settings_.keys) {
    auto trusted = settings_.keys->trusted();
    if (!trusted) return base::fail(trusted.error().message, "bad_key");
    p.trusted = std::move(*trusted);
  }
  p.allow_unsigned = settings_.allow_unsigned;
  p.max_bytes = settings_.max_archive_bytes;
  p.keep_inodes = kJournalInodes;
  return p;
}

Checkpointer::~Checkpointer() {
  *alive_ = false;
  if (warming_ > 0) ::kill(warming_, SIGKILL);
  if (kdat_own_ && kdat_waiting_on_ > 0) ::kill(kdat_waiting_on_, SIGKILL);
}

void Checkpointer::warm_up(uint64_t delay_ms) {
  if (!criu_ || !live_possible()) return;
  // SANDBOXER_KDAT_WARM_MS: another delay, or "off" (the control of the test that checks it).
  if (const char* env = std::getenv("SANDBOXER_KDAT_WARM_MS")) {
    if (std::string_view(env) == "off") return;
    delay_ms = std::strtoull(env, nullptr, 10);
  }
  warm_timer_ = loop::make_timer(loop_);
  warm_timer_->data = this;
  uv_timer_start(
      warm_timer_.get(),
      [](uv_timer_t* t) {
        auto* self = static_cast<Checkpointer*>(t->data);
        if (self->host_.shutting_down() || self->kdat_.fd() < 0 || self->kdat_cached()) return;
        auto pid = spawn_criu(*self->criu_, self->kdat_fill());
        if (!pid) return log()->info("criu's kerndat cache not filled ahead: {}", pid.error().message());
        self->warming_ = *pid;
        self->host_.watch_child(*pid, [self](pid_t p, int st) {
          self->warming_ = -1;
          self->kdat_probe_ended(p, st);
        });
      },
      delay_ms, 0);
  // A box that ends before the delay does not wait for it.
  uv_unref(reinterpret_cast<uv_handle_t*>(warm_timer_.get()));
}

base::Result<pid_t> Checkpointer::start_criu(CriuRun run) {
  run.run_tmpfs = kdat_.fd();
  // Every caller is a `then` of when_kdat_ready.
  if (run.run_tmpfs >= 0 && !kdat_warned_ && !kdat_cached())
    return base::fail(kKdatRefused + "no kernel probe ran before it", "criu");
  const char* step = nullptr;
  auto pid = spawn_criu(*criu_, run, &step);
  if (!pid) return base::sys_fail(step ? std::string("start criu: ") + step : "start criu", pid.error());
  return *pid;
}

CriuRun Checkpointer::kdat_fill() {
  return {.args = {"check", "--feature", "mnt_id", "-v0", "--log-file", "/dev/null"},
          .output = "/dev/null",
          .run_tmpfs = kdat_.fd(),
          .own_pid_ns = true};
}

bool Checkpointer::kdat_cached() {
  struct stat st {};
  return kdat_.fd() >= 0 && ::fstatat(kdat_.fd(), "criu.kdat", &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
         st.st_size > 0;
}

void Checkpointer::kdat_unprotected(const std::string& why) {
  if (!std::exchange(kdat_warned_, true))
    log()->warn(
        "{}: each criu probes the kernel in the box's pid namespace (a failed fork of its probe "
        "kills every process there but PID 1)",
        why);
}

void Checkpointer::when_kdat_ready(std::function<void(base::Result<void>)> then) {
  if (kdat_.fd() < 0) kdat_unprotected("no tmpfs for criu's kerndat cache here");
  if (kdat_warned_ || kdat_cached()) return then({});
  if (host_.shutting_down()) return then(base::fail("the box is shutting down", "shutting_down"));
  kdat_waiters_.push_back(std::move(then));
  if (kdat_waiting_on_ > 0) return;  // a probe is under way: its end settles every waiter
  kdat_probe(warming_ <= 0);
}

void Checkpointer::kdat_probe(bool own) {
  pid_t pid = warming_;  // the warm-up's criu, reaped by the reaper, which tells kdat_probe_ended
  if (own) {
    auto started = spawn_criu(*criu_, kdat_fill());
    int e = started ? 0 : started.error().value();
    // At a pids or memory ceiling: no criu now, rather than one that probes beside the agent.
    if (e == EAGAIN || e == ENOMEM)
      return kdat_settled(
          base::fail(kKdatRefused + "its kernel probe could not start: " + started.error().message(), "criu"));
    if (!started) {
      kdat_unprotected("criu's kernel probe in a pid namespace of its own: " + started.error().message());
      return kdat_settled({});
    }
    pid = *started;
    host_.watch_child(pid, [this](pid_t p, int st) { kdat_probe_ended(p, st); });
  }
  kdat_waiting_on_ = pid;
  kdat_own_ = own;
  if (!kdat_timer_) {
    kdat_timer_ = loop::make_timer(loop_);
    kdat_timer_->data = this;
  }
  uv_timer_start(
      kdat_timer_.get(),
      [](uv_timer_t* t) {
        // A probe that hangs is killed, the warm-up's too: the next criu probes again rather
        // than wait on it. Its end, when the reaper collects it, is no one's.
        auto* self = static_cast<Checkpointer*>(t->data);
        pid_t hung = std::exchange(self->kdat_waiting_on_, -1);
        ::kill(hung, SIGKILL);
        int64_t ms = self->settings_.probe_timeout_ms;
        std::string limit = ms % 1000 ? std::to_string(ms) + " ms" : std::to_string(ms / 1000) + " s";
        self->kdat_settled(base::fail(kKdatRefused + "its kernel probe (pid " + std::to_string(hung) +
                                          ") did not end within " + limit + " (checkpoint.probe_timeout)",
                                      "criu"));
      },
      static_cast<uint64_t>(settings_.probe_timeout_ms), 0);
}

void Checkpointer::kdat_probe_ended(pid_t pid, int status) {
  if (pid <= 0 || pid != kdat_waiting_on_) return;  // no one waits on it (or its wait timed out)
  kdat_waiting_on_ = -1;
  uv_timer_stop(kdat_timer_.get());
  if (kdat_cached()) return kdat_settled({});
  if (!kdat_own_) return kdat_probe(true);  // the warm-up wrote none: a probe of their own
  // A probe that ran and wrote nothing (its own forks refused at a ceiling, as a rule): the criu
  // that would probe next, beside the agent, would meet the same ceiling.
  kdat_settled(base::fail(kKdatRefused + "its kernel probe " +
                              (WIFEXITED(status) ? "exited " + std::to_string(WEXITSTATUS(status))
                                                 : "was killed by signal " + std::to_string(WTERMSIG(status))) +
                              " and wrote no cache",
                          "criu"));
}

void Checkpointer::kdat_settled(const base::Result<void>& r) {
  for (auto& then : std::exchange(kdat_waiters_, {})) then(r);
}

base::Result<void> Checkpointer::live_possible() const {
  auto version = host_.criu_version();
  if (!criu_ || !version) return base::fail("criu was not found on PATH", "unavailable");
  int major = 0, minor = 0;
  std::sscanf(version->c_str(), "%d.%d", &major, &minor);
  if (major < 4 || (major == 4 && minor < 2))
    return base::fail("criu " + *version + " is too old: sockets need criu >= 4.2", "unavailable");
  if (!os::in_initial_user_namespace())
    return base::fail(
        "the supervisor runs in a user namespace of its own (rootless), where criu cannot dump the agent: "
        "suspending its seccomp filter (PTRACE_O_SUSPEND_SECCOMP) takes CAP_SYS_ADMIN in the host's user namespace",
        "unavailable");
  return {};
}

void Checkpointer::offload(std::function<void()> work, std::function<void()> after) {
  struct Work {
    uv_work_t req;
    std::function<void()> work, after;
    std::shared_ptr<const bool> alive;
  };
  auto* w = new Work{{}, std::move(work), std::move(after), alive_};
  w->req.data = w;
  uv_queue_work(
      loop_, &w->req,
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
          if (*w->alive) w->after();
        } catch (const std::exception& e) {
          log()->error("after a background step: {}", e.what());
        }
        delete w;
      });
}

void Checkpointer::op_done() {
  --ops_;
  host_.operation_done();
}

json::object identity(const std::string& box, const std::string& branch, const Lineage& lineage) {
  json::object o{{"box", box}, {"branch", branch}, {"mode", lineage.mode}, {"index", lineage.index}};
  o["parent"] = lineage.parent.empty() ? json::value(nullptr) : json::value(lineage.parent);
  o["snapshot"] = lineage.snapshot.empty() ? json::value(nullptr) : json::value(lineage.snapshot);
  return o;
}

void write_branch_json(const std::string& box, const std::string& branch, const Lineage& lineage,
                       const std::string& dir) {
  // The branch's /run is the agent's to write: run/sandboxer is reached from the branch's dir
  // without following a symlink, and branch.json replaces whatever is at its place.
  auto top = os::open_dir(dir);
  auto d = top ? os::make_dirs_at(top->get(), "run/sandboxer", 0755) : os::Result<os::UniqueFd>(top.error());
  if (!d) {
    log()->warn("create {}/run/sandboxer: {}", dir, d.error().message());
    return;
  }
  if (auto r =
          os::write_file_atomic_at(d->get(), "branch.json", json::serialize(identity(box, branch, lineage)) + "\n");
      !r)
    log()->warn("write {}/run/sandboxer/branch.json: {}", dir, r.error().message());
}

// ---- a checkpoint's tree ----

void Checkpointer::continue_op(CheckpointOp& op) {
  if (!op.stopped) return;
  op.stopped = false;
  continue_tree(op.ns_init_pid, op.tree_fd.get());
}

void Checkpointer::on_shutdown() {
  cancel_copies_->store(true);  // a layer copy in flight (its agent running, or continued below) stops
  // A tree stopped for a dump cannot act on the shutdown's TERM: criu goes (it is our child, not
  // yet reaped, so its pid is still its own), and the tree continues now, not at the dump's end.
  for (auto& op : dumping_) {
    if (op->criu > 0) ::kill(op->criu, SIGKILL);
    continue_op(*op);
  }
  // A tree held after a checkpoint gets the shutdown's TERM too.
  while (!held_.empty()) (void)release(held_.begin()->first, false, "the box is shutting down");
  // A copy whose memory is still arriving ends with the box: its daemon goes too.
  for (pid_t d : lazy_daemons_) ::kill(d, SIGKILL);
  if (warming_ > 0) ::kill(warming_, SIGKILL);
  // A checkpoint or copy that waits for criu's kernel probe starts no criu now.
  if (kdat_own_ && kdat_waiting_on_ > 0) ::kill(kdat_waiting_on_, SIGKILL);
  kdat_waiting_on_ = -1;
  if (kdat_timer_) uv_timer_stop(kdat_timer_.get());
  kdat_settled(base::fail("the box is shutting down", "shutting_down"));
}

// ---- checkpoint ----

void Checkpointer::checkpoint(const std::string& branch, const std::string& name, bool leave_running, Reply done,
                              const std::string& by, bool chunked) {
  start_checkpoint(branch, name, leave_running, std::move(done), by, chunked, 0);
}

void Checkpointer::checkpoint_held(const std::string& branch, const std::string& name, int64_t hold_ms, Reply done) {
  start_checkpoint(branch, name, true, std::move(done), "", false, std::max<int64_t>(hold_ms, 1));
}

void Checkpointer::defer(uint64_t ms, std::function<void()> run) {
  auto& d = deferred_.emplace_back();
  d.run = std::move(run);
  d.timer = loop::make_timer(loop_);
  d.timer->data = this;
  uv_timer_start(
      d.timer.get(),
      [](uv_timer_t* t) {
        auto* self = static_cast<Checkpointer*>(t->data);
        for (auto it = self->deferred_.begin(); it != self->deferred_.end(); ++it)
          if (it->timer.get() == t) {
            auto run = std::move(it->run);
            self->deferred_.erase(it);  // closes the timer: libuv allows it in its own callback
            return run();
          }
      },
      ms, 0);
}

// What the archive's manifest says of the box and of the branch being checkpointed.
json::object Checkpointer::manifest_of(const BranchView& b, const CheckpointOp& op) const {
  json::object pipes;
  for (size_t i = 0; i < 7; ++i) pipes[kPipeRoles[i]] = b.pipe_inodes[i];
  // The agent's command and working directory as put_bytes_* write them: text, and where any is
  // not UTF-8 its bytes beside it (a reader before that read the text).
  json::object agent;
  base::put_bytes_list(agent, "argv", b.argv);
  base::put_bytes_field(agent, "cwd", b.cwd);
  json::object m = {
      {"format", archive::kFormatName},
      {"format_version", archive::kFormatVersion},
      {"created", base::rfc3339_now()},
      {"box", settings_.box_id},
      {"branch", b.name},
      {"name", op.name},
      {"parent", b.lineage.snapshot.empty() ? json::value(nullptr) : json::value(b.lineage.snapshot)},
      {"profile", settings_.profile_name},
      {"profile_doc", profile_document(settings_.profile_doc)},
      {"image", image_id_ ? json::value(*image_id_) : json::value(nullptr)},
      {"mode", op.live ? "live" : "fs"},
      {"criu", op.live ? json::value(*host_.criu_version()) : json::value(nullptr)},
      {"kernel", kernel_release()},
      {"agent", std::move(agent)},
      {"pipes", pipes},
      // Those of them that are unix sockets (criu names them socket:[INO], not pipe:[INO]).
      {"sockets", json::array{kSocketRoles[0]}},
      // Its own network namespace, dumped as external (criu's key kNetnsKey), or null: the host's.
      {"netns_inode", b.netns_inode ? json::value(b.netns_inode) : json::value(nullptr)},
      // The names under its /sys/fs/cgroup, each its own group (dumped as external mounts).
      {"cgroup_view", json::value_from(b.cgroup_view)},
      {"masks", mask_list(host_.branch_masks(), op.live ? b.ns_init_pid : 0)},
      {"network", host_.network_manifest()},
      {"channel_request", b.channel_request >= 0 ? json::value(b.channel_request) : json::value(nullptr)}};
  if (!op.live) m["note"] = op.note;
  if (op.live) m["host_mounts"] = host_mount_list(b.ns_init_pid, m.at("masks").as_array());
  return m;
}

void Checkpointer::start_checkpoint(const std::string& branch, const std::string& name, bool leave_running, Reply done,
                                    const std::string& by, bool chunked, int64_t hold_ms,
                                    std::shared_ptr<ForkSeal> fork, int64_t waited_ms) {
  auto found = host_.find_branch(branch);
  if (!found) return done(error_reply("not_found", "no branch \"" + branch + "\""));
  const BranchView& b = *found;
  if (!b.running) return done(error_reply("not_running", "branch \"" + branch + "\" is not running"));
  // Until ns-init reports the agent started it holds the socket the agent's pid comes through,
  // which criu would refuse as an external socket: a checkpoint asked for in those few
  // milliseconds (right after the box starts) waits for the start.
  if (b.starting) {
    constexpr int64_t kStep = 10, kStartWaitMs = 10000;
    if (waited_ms >= kStartWaitMs)
      return done(error_reply("not_running", "branch \"" + branch + "\" has not started its agent within " +
                                                 std::to_string(kStartWaitMs / 1000) + " s"));
    return defer(kStep, [=, this, done = std::move(done), fork = std::move(fork)]() mutable {
      start_checkpoint(branch, name, leave_running, std::move(done), by, chunked, hold_ms, std::move(fork),
                       waited_ms + kStep);
    });
  }
  if (b.busy) return done(error_reply("busy", "a checkpoint of branch \"" + branch + "\" is already under way"));
  if (auto refusal = snapshots_refusal(branch)) return done(std::move(*refusal));
  // The journal's room comes first: no agent is stopped for a snapshot that could not be kept.
  if (auto why = room_refusal()) {
    log()->warn("checkpoint branch {}: {}", branch, *why);
    return done(error_reply("no_space", "checkpoint refused: " + *why));
  }
  // libarchive and libcrypto are loaded at the first checkpoint, not at start: a host where they
  // cannot be is told so here, before the agent is stopped.
  if (auto lib = archive::library_loadable(); !lib) {
    log()->error("checkpoint branch {}: {}", branch, lib.error().message);
    return done(error_reply(lib.error().code, "checkpoint refused: " + lib.error().message));
  }
  // The signing key is read at the first checkpoint, not at start (archive::ArchiveKeys): a key
  // that does not parse is refused here, before the agent is stopped, naming its file.
  std::shared_ptr<const archive::SigningKey> key;
  if (settings_.keys) {
    auto k = settings_.keys->signing();
    if (!k) {
      log()->error("checkpoint branch {}: {}", branch, k.error().message);
      return done(error_reply("bad_key", k.error().message));
    }
    key = *k;
  }
  auto op = std::make_shared<CheckpointOp>();
  op->key = std::move(key);
  op->branch = branch;
  op->name = name;
  op->by = by;
  op->chunked = chunked;
  op->leave_running = leave_running;
  op->hold_ms = hold_ms;
  op->done = std::move(done);
  op->fork = std::move(fork);
  if (auto live = live_possible(); !live) {
    op->note = "filesystem only: " + live.error().message;
  } else if (!b.namespaced) {
    op->note = "filesystem only: the branch has no pid and mount namespace of its own (" + b.why_not + ")";
  } else {
    op->live = true;
  }
  // A held agent is ended once its copy runs elsewhere: a files-only snapshot would lose its memory.
  if (hold_ms > 0 && !op->live)
    return op->done(error_reply("not_live", "holding an agent needs a live checkpoint; this one would be " + op->note));
  // A files-only snapshot restores cold, and a cold copy gets the profile's Landlock again.
  if (b.landlocked && op->live)
    return op->done(error_reply("landlocked", "branch \"" + branch +
                                                  "\" is confined by Landlock, which criu does not restore: its copies "
                                                  "would run without that confinement"));
  op->tree_fd.reset(b.pidfd >= 0 ? ::fcntl(b.pidfd, F_DUPFD_CLOEXEC, 3) : -1);
  if (!op->tree_fd) return op->done(error_reply("not_running", "branch \"" + branch + "\" has no pidfd of its tree"));
  op->work = snap_dir_ + "/.work-" + os::random_hex(4);
  for (const char* d : {"", "/payload/criu", "/payload/fs", "/logs"})
    if (auto r = os::make_dirs(op->work + d, 0700); !r)
      return op->done(error_reply("io", "create " + op->work + d + ": " + r.error().message()));
  ++ops_;
  ++checkpoints_;
  host_.set_busy(branch, true);
  op->ns_init_pid = b.ns_init_pid;
  op->t0 = now_ms();
  dumping_.push_back(op);

  op->manifest = manifest_of(b, *op);

  if (!op->live) {
    // Files only, but still at one instant: the tree is stopped while its layer is copied (what
    // changed since a copy made while it ran, where it goes on after).
    auto stop_and_copy = [this, op] {
      op->stopped = true;  // from here until continue_op(), on every path
      op->t_stop = now_ms();
      (void)stop_tree(op->ns_init_pid, op->tree_fd.get());
      op->t_stopped = op->t_dumped = now_ms();
      if (op->precopied) op->mapped.merge(tree_files(op->ns_init_pid, op->tree_fd.get(), false).mapped);
      snapshot_layer(op);
    };
    if (op->leave_running) return precopy(op, stop_and_copy);
    return stop_and_copy();
  }
  // criu's kernel probe, where the box has not run it yet, ends before the tree is stopped: it is
  // no part of the agent's pause, and the loop serves on while it runs.
  // A continuation that runs before when_kdat_ready returns did not wait.
  auto waiting = std::make_shared<bool>(false);
  double asked = now_ms();
  when_kdat_ready([this, op, waiting, asked](base::Result<void> ready) {
    if (*waiting) op->probe_wait = now_ms() - asked;
    if (!ready) return checkpoint_failed(op, ready.error().code, ready.error().message);
    dump_live(op);
  });
  *waiting = true;
}

namespace {
// The refusal of a checkpoint whose tree holds `deleted` files of more than `room` bytes together.
std::string deleted_refusal(const TreeFiles::Deleted& deleted, uint64_t room) {
  auto n = deleted.files.size();
  return "the branch's processes hold " + std::to_string(n) + (n == 1 ? " file" : " files") +
         " deleted since they were opened, " + std::to_string(deleted.bytes) + " bytes" + (n == 1 ? "" : " together") +
         " (the largest: " + deleted.largest + ", " + std::to_string(deleted.largest_bytes) +
         " bytes), which criu carries in the checkpoint: more than the " + std::to_string(room) +
         " bytes the state dir's filesystem has for it. Close them, or give the state dir more space";
}

// criu's reason, and where it is a ghost file criu would not dump (larger than `ghost_limit`), what
// that means here.
std::string dump_failure(const std::string& why, uint64_t ghost_limit) {
  if (why.find("Can't dump ghost file") == std::string::npos) return why;
  return why + " (a file the branch's processes hold open or mapped was deleted, and it is larger than the " +
         std::to_string(ghost_limit) + " bytes the state dir's filesystem has for the checkpoint)";
}
}  // namespace

void Checkpointer::precopy(std::shared_ptr<CheckpointOp> op, std::function<void()> next) {
  op->precopied = true;
  std::string src = settings_.state_dir + "/branches/" + op->branch;
  op->in_upper = tmp_in_upper(op->ns_init_pid, src);
  op->mapped = tree_files(op->ns_init_pid, op->tree_fd.get(), false).mapped;
  double started = now_ms();
  offload(
      [op, src, room = room_bound(true), ceiling = settings_.disk_bytes, cancel = cancel_copies_, started] {
        auto bounded = room;
        bounded.cancel = cancel.get();
        auto r =
            copy_layer(src, op->work + "/payload/fs", op->in_upper, bounded, ceiling, op->records, LayerPass::copy, {});
        // What the agent changed while it was copied is synced again while it runs, and again
        // while a pass still copies much anew: the stop is left what changed during the last.
        // Each pass copies again what the tree maps shared and writable at its start or at any
        // pass's before (read again here): a file mapped after one pass's start was first
        // written after it, and the next pass copies it again by its times, but a write through
        // a page written before moves none, so once unmapped it must be read after the unmap.
        os::SyncPolicy policy;
        for (double t0 = now_ms(), took = t0 - started; r && op->resyncs < kResyncs && resync_worth(op->records, took);
             took = now_ms() - t0, ++op->resyncs) {
          t0 = now_ms();
          op->mapped.merge(tree_files(op->ns_init_pid, op->tree_fd.get(), false).mapped);
          policy.always = op->mapped;
          r = copy_layer(src, op->work + "/payload/fs", op->in_upper, bounded, ceiling, op->records, LayerPass::resync,
                         policy);
        }
        if (!r) {
          op->error = r.error().message;
          op->error_code = r.error().code;
        }
      },
      [this, op, next = std::move(next), started] {
        op->precopy_ms = now_ms() - started;
        if (host_.shutting_down()) return checkpoint_failed(op, "shutting_down", "the box is shutting down");
        if (!op->error.empty())
          return checkpoint_failed(op, op->error_code, "snapshot the writable layer: " + op->error);
        next();
      });
}

void Checkpointer::dump_live(std::shared_ptr<CheckpointOp> op) {
  if (op->leave_running && !op->precopied) return precopy(op, [this, op] { dump_live(op); });
  const std::string& branch = op->branch;
  // Memory and files at one instant: the tree is stopped first and stays stopped through the
  // dump (criu leaves tasks as it found them with --leave-running) and the copy of its layer.
  // criu's own --leave-stopped is not used: it leaves TCP sockets in repair mode, so a resumed
  // original would lose its live connections.
  op->stopped = true;  // from here until continue_op(), on every path
  op->t_stop = now_ms();
  if (!stop_tree(op->ns_init_pid, op->tree_fd.get())) {
    continue_op(*op);
    host_.set_busy(branch, false);
    checkpoint_failed(op, "busy", "could not stop every process of branch \"" + branch + "\" within 0.4 s");
    return;
  }
  op->t_stopped = now_ms();
  auto held = tree_files(op->ns_init_pid, op->tree_fd.get(), true);
  op->mapped.merge(held.mapped);  // stopped now: what it maps at the stop, beside what it did at the copy's start
  if (held.host_ghost) {
    continue_op(*op);
    host_.set_busy(branch, false);
    checkpoint_failed(op, "host_file_deleted",
                      *held.host_ghost +
                          ", deleted since it was opened (the host replaced or removed it: an upgrade?); criu would "
                          "write it back into that mount's directory at a restore. Restart what holds it, then "
                          "checkpoint");
    return;
  }
  // A file its agent holds open after deleting it (Python's TemporaryFile, a download's spool) is
  // carried in the images, as large as the checkpoint's room allows (criu's own limit, 1 MiB a
  // file, failed the checkpoint of any agent holding a larger one); criu's limit is a file's, so
  // their sum is checked here, before criu fills the state dir's filesystem with them.
  auto room = ghost_room(op->leave_running);
  op->ghost_limit = room ? std::max(*room, kCriuGhostLimit) : kCriuGhostLimit;
  if (room && held.deleted.bytes > *room) {
    continue_op(*op);
    host_.set_busy(branch, false);
    checkpoint_failed(op, "no_space", deleted_refusal(held.deleted, *room));
    return;
  }
  CriuRun run;
  run.args = {"dump", "--tree", std::to_string(op->ns_init_pid), "--images-dir", op->work + "/payload/criu",
              "--work-dir", op->work + "/logs", "--log-file", "dump.log", "--external", "mnt[]", "--external",
              "mnt[/workspace]:workspace", "--external", "mnt[/tmp]:tmp", "--external", "mnt[/run]:run", "--external",
              "mnt[/etc/machine-id]:machine-id", "--manage-cgroups=ignore",
              // Live TCP connections are dumped; the network is not locked: the tree is stopped,
              // criu's iptables lock would sit in the host's tables (the tree shares the host's
              // network namespace), and no restored copy keeps the connections (--tcp-close).
              "--tcp-established", "--network-lock", "skip", "--file-locks", "--leave-running"};
  run.args.insert(run.args.end(), {"--ghost-limit", std::to_string(op->ghost_limit)});
  // ns-init's reports socket, whose peer is ours: dumped as external, given back at restore
  // (--inherit-fd socket:[INO], restore.cpp).
  if (auto* ino = op->manifest.at("pipes").as_object().if_contains("reports"); ino && ino->is_number())
    run.args.insert(run.args.end(), {"--external", "unix[" + std::to_string(ino->to_number<uint64_t>()) + "]"});
  // Its groups in its /sys/fs/cgroup: the copy gets its own (restore.cpp, cgroup_mounts).
  if (auto* names = op->manifest.if_contains("cgroup_view"); names && names->is_array())
    for (size_t i = 0; i < names->as_array().size(); ++i) {
      std::string name(names->as_array()[i].as_string());
      run.args.insert(run.args.end(), {"--external", "mnt[/sys/fs/cgroup" + (name.empty() ? "" : "/" + name) +
                                                         "]:" + kCgroupKey + std::to_string(i)});
    }
  // Its network namespace, ours: not dumped, but named, for the copy to be restored into its own.
  if (auto* ino = op->manifest.if_contains("netns_inode"); ino && ino->is_number())
    run.args.insert(run.args.end(),
                    {"--external", "net[" + std::to_string(ino->to_number<uint64_t>()) + "]:" + kNetnsKey});
  run.output = op->work + "/logs/dump.out";
  // With criu's kerndat cache (criu.hpp): its ~30 ms of probes would be part of the agent's pause.
  auto pid = start_criu(std::move(run));
  if (!pid) {
    continue_op(*op);
    host_.set_busy(branch, false);
    checkpoint_failed(op, "criu", pid.error().message);
    return;
  }
  log()->info("dump branch {} (ns-init {}): criu {}", branch, op->ns_init_pid, *pid);
  op->criu = *pid;
  host_.watch_child(*pid, [this, op](pid_t, int st) {
    op->criu = -1;
    op->t_dumped = now_ms();
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      std::string why = WIFSIGNALED(st) ? std::string("criu was killed by SIG") + os::signal_name(WTERMSIG(st))
                                        : criu_error_from_log(op->work + "/logs/dump.log");
      continue_op(*op);
      checkpoint_failed(op, "criu", "criu dump failed: " + dump_failure(why, op->ghost_limit));
      return;
    }
    if (host_.shutting_down()) {
      continue_op(*op);
      return checkpoint_failed(op, "shutting_down", "the box is shutting down");
    }
    snapshot_layer(op);
  });
}

void Checkpointer::checkpoint_failed(std::shared_ptr<CheckpointOp> op, const std::string& code,
                                     const std::string& msg) {
  log()->error("checkpoint branch {}: {}", op->branch, msg);
  continue_op(*op);  // whatever failed, the agent goes on
  if (op->held) (void)release(op->branch, false, "the checkpoint failed");
  --checkpoints_;
  std::erase(dumping_, op);
  host_.set_busy(op->branch, false);
  host_.emit(op->branch,
             {{"type", "checkpoint.failed"}, {"name", op->name}, {"error", {{"code", code}, {"message", msg}}}});
  os::remove_tree(op->work);
  if (op->chunked) collect_chunks();  // what it stored before it failed
  op->done(error_reply(code, msg));
  op_done();
}

void Checkpointer::snapshot_layer(std::shared_ptr<CheckpointOp> op) {
  std::string src = settings_.state_dir + "/branches/" + op->branch;
  // The agent's /tmp is one of two directories: tmp-upper/ (its /tmp overlay's upper layer,
  // launcher.cpp and CriuRun::tmp_overlay, or what a live copy's bind shows), or tmp/ itself
  // (a launched branch's where no overlay could be had). Exactly that one is its /tmp in the
  // snapshot: two sources never go into one place.
  bool in_upper = tmp_in_upper(op->ns_init_pid, src);
  // The dump's images are written: a checkpoint that leaves its agent running must leave the
  // journal its room (as its seal must), refused now rather than after a copy of the layer. One
  // that ends its agent keeps its snapshot whatever it takes, as far as the disk has room.
  if (op->leave_running)
    if (auto why = room_refusal()) return checkpoint_failed(op, "no_space", "checkpoint not kept: " + *why);
  // Copied while the agent ran: what changed since is copied now, and what it maps shared and
  // writable (then or now) whatever its times say.
  os::SyncPolicy policy;
  if (op->precopied) {
    // tmp/ then, tmp-upper/ now (or the other way): that one copied whole.
    auto tmp = std::find(std::begin(sandbox::kLayerDirs), std::end(sandbox::kLayerDirs), std::string_view("tmp"));
    if (op->in_upper != in_upper) op->records.at(static_cast<size_t>(tmp - std::begin(sandbox::kLayerDirs))).reset();
    policy.always = std::move(op->mapped);  // at the copy's start and at the stop
  }
  offload(
      [op, src, in_upper, room = room_bound(op->leave_running), ceiling = settings_.disk_bytes,
       policy = std::move(policy), cancel = cancel_copies_] {
        // Overlay whiteouts (devices) are left out of the copy.
        auto bounded = room;
        bounded.cancel = cancel.get();
        // A layer not copied before (no record) is copied whole, and not recorded: no sync follows.
        auto r =
            copy_layer(src, op->work + "/payload/fs", in_upper, bounded, ceiling, op->records, LayerPass::sync, policy);
        if (!r) {
          op->error = r.error().message;
          op->error_code = r.error().code;
          return;
        }
        op->fs_bytes = *r;
        // A live snapshot restores onto its root/: the mount points of the branch's root, which
        // is a tmpfs (launcher.cpp) or, in a restored copy, root/ itself. The tree is stopped.
        if (op->live)
          if (auto r = sandbox::copy_root_top(op->ns_init_pid, op->work + "/payload/fs/root"); !r) {
            op->error = "the mount points of the branch's root: " + r.error().message();
            return;
          }
        op->image_bytes = os::tree_bytes(op->work + "/payload/criu");
      },
      [this, op] {
        op->t_snapped = now_ms();
        auto b = host_.find_branch(op->branch);
        if (b && op->hold_ms > 0 && op->error.empty()) hold_tree(*op);
        if (b && !op->leave_running && op->error.empty()) {
          host_.ended_by_checkpoint(op->branch);
          // Every process of the tree is killed while it is still stopped, and none is continued
          // (SIGKILL ends a stopped process). Killing only a namespaced ns-init ends the others as
          // it exits, a moment later: continued meanwhile, the agent ran on past its snapshot, and
          // a line it wrote then came again from the resumed agent.
          kill_tree(op->ns_init_pid, op->tree_fd.get());
          op->stopped = false;
        }
        continue_op(*op);
        op->t_resumed = now_ms();
        if (op->error_code == "cancelled") return checkpoint_failed(op, "shutting_down", "the box is shutting down");
        if (!op->error.empty())
          return checkpoint_failed(op, op->error_code, "snapshot the writable layer: " + op->error);
        // A fork's copies start from the images now; only a signed snapshot restores live.
        if (op->fork && op->live && op->key && !host_.shutting_down()) return fork_early(op);
        compress(op);
      });
}

namespace {
// What a box's own snapshot says of its signature (the extracted manifest's "verified").
json::object own_verified(const archive::SigningKey* key) {
  return key ? json::object{{"trusted", true}, {"key", key->public_key().fingerprint()}}
             : json::object{{"trusted", false}, {"why", "this box signs nothing (no signing key)"}};
}
}  // namespace

void Checkpointer::fork_early(std::shared_ptr<CheckpointOp> op) {
  // The copies restore from the dump's images and files as they are, linked (not copied) into a
  // tree of the fork's own: the archive is written from the payload meanwhile and moves it away
  // when sealed, and the copies' KSM marks replace their mm images there (a new inode each), so
  // the archive's stay as criu wrote them. The tree goes when the last copy's memory has arrived.
  std::string dir = snap_dir_ + "/.fork-" + os::random_hex(6);
  auto err = std::make_shared<std::string>();
  offload(
      [src = op->work + "/payload", dir, err] {
        if (auto r = os::link_tree(src, dir); !r) *err = r.error().message;
      },
      [this, op, dir, err] {
        if (err->empty() && !host_.shutting_down()) {
          json::object m = op->manifest;
          m["verified"] = own_verified(op->key.get());
          fork_copies(op->fork, dir, std::move(m));
        } else {
          os::remove_tree(dir);
          if (!err->empty()) log()->warn("fork of branch {}: the copies wait for the archive: {}", op->branch, *err);
        }
        compress(op);
      });
}

json::object Checkpointer::sizes_of(const CheckpointOp& op) {
  json::object sizes{{"raw", op.info->raw_bytes},
                     {"compressed", op.info->compressed_bytes},
                     {"images", op.image_bytes},
                     {"fs", op.fs_bytes}};
  // In the chunk store: what the snapshot takes there, and what it added (the rest it shares).
  if (op.chunked) {
    sizes["compressed"] = op.info->chunks->stored_bytes;
    sizes["added"] = op.info->chunks->added_bytes;
    sizes["chunks"] = op.info->chunks->chunks.size();
    sizes["new_chunks"] = op.info->chunks->new_chunks;
  }
  return sizes;
}

json::object Checkpointer::dump_timings(const CheckpointOp& op) {
  json::object timings{{"dump", round_ms(op.t_dumped - op.t_stopped)},
                       {"snapshot", round_ms(op.t_snapped - op.t_dumped)},
                       {"stop", round_ms(op.t_stopped - op.t_stop)},
                       {"freeze", round_ms(op.t_resumed - op.t_stop)}};
  // The wait for criu's kernel probe before the tree was stopped (no part of the pause).
  if (op.probe_wait > 0) timings["probe_wait"] = round_ms(op.probe_wait);
  // The layer's copy while the agent ran (no part of the pause either).
  if (op.precopy_ms >= 0) {
    timings["precopy"] = round_ms(op.precopy_ms);
    timings["precopy_resyncs"] = op.resyncs;
  }
  // criu's own phases of the dump (freezing, memory dump, page writes), from its stats image.
  if (op.live) timings["criu"] = criu_stats(op.work + "/logs/stats-dump");
  return timings;
}

void Checkpointer::compress(std::shared_ptr<CheckpointOp> op) {
  op->manifest["last_seq"] = host_.last_seq();
  op->manifest["sizes"] = {{"images", op->image_bytes}, {"fs", op->fs_bytes}};
  op->manifest["timings_ms"] = dump_timings(*op);
  std::string tmp = op->chunked ? "" : op->work + "/archive.tar.zst";
  if (op->chunked) ++chunk_writers_;
  // A fork's copies start from the images while this runs (fork_early): on a thread of its own
  // at a lower priority (nice 10; zstd's workers inherit it), so criu's restores and lazy-pages
  // daemons come first and the archive takes what CPU they leave. Measured on 2 cores, a 50 MB
  // agent's 8 copies ran 0.42 s after the pause with the seal beside them at the same priority.
  bool behind = op->fork && op->fork->early;
  // Past what this box's own extraction allows (--max-archive-bytes), holes included, no archive
  // is written: it could not be restored, and its files' contents would be read and hashed whole.
  auto write = [op, tmp, key = op->key, store = chunk_dir(), max = settings_.max_archive_bytes] {
    std::unique_ptr<archive::ChunkWriter> chunks;
    if (op->chunked) {
      auto w = archive::ChunkWriter::open(store, 3, false);  // the manifest's hash names it
      if (!w) {
        op->error = w.error().message;
        return;
      }
      chunks = std::move(*w);
    }
    auto info = archive::write_snapshot(op->work + "/payload", op->manifest, {tmp, chunks.get(), max}, 3, key.get());
    if (info) {
      op->info = std::move(*info);
    } else {
      op->error = info.error().message;
      op->error_code = info.error().code == "limit" ? "limit" : "io";
    }
  };
  offload(
      [write, behind] {
        if (!behind) return write();
        try {
          std::thread t([write] {
            (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10);
            write();
          });
          t.join();
        } catch (const std::system_error&) {
          write();  // no thread to be had: at the pool's priority, as any other checkpoint
        }
      },
      [this, op, tmp] {
        op->t_compressed = now_ms();
        // A writer until its list is stored: the chunks it found already there are named by no
        // list of its own before that, and a collection meanwhile would take them.
        auto writer_done = [this, op] {
          if (op->chunked) chunk_writer_done();
        };
        if (!op->info) {
          writer_done();
          return checkpoint_failed(op, op->error_code, "write the archive: " + op->error);
        }
        op->id = archive::snapshot_id_of(op->info->manifest_sha256);
        op->manifest["format_version"] = op->info->format_version;  // 4 where it holds hard links
        std::string base = snap_dir_ + "/" + op->id;
        json::object index = op->manifest;
        index["id"] = op->id;
        if (op->chunked) {
          const archive::ChunkList& l = *op->info->chunks;
          index["archive"] = {{"stored", "chunks"},
                              {"manifest_sha256", op->info->manifest_sha256},
                              {"bytes", l.stored_bytes},
                              {"added_bytes", l.added_bytes},
                              {"chunks", l.chunks.size()},
                              {"new_chunks", l.new_chunks},
                              {"raw_bytes", op->info->raw_bytes}};
        } else {
          index["archive"] = {{"path", base + ".tar.zst"},
                              {"manifest_sha256", op->info->manifest_sha256},
                              {"sha256", op->info->sha256},
                              {"bytes", op->info->compressed_bytes},
                              {"raw_bytes", op->info->raw_bytes}};
        }
        json::object timings = op->manifest["timings_ms"].as_object();
        timings["compress"] = round_ms(op->t_compressed - op->t_resumed);
        timings["total"] = round_ms(op->t_compressed - op->t0);
        index["timings_ms"] = timings;
        // Who asked: the agent channel of a branch reaches only its own snapshots (channel_refusal).
        index["origin"] =
            op->by.empty() ? json::object{{"by", "operator"}} : json::object{{"by", "channel"}, {"branch", op->by}};
        // Stored, it must still leave the journal its room; a tree the checkpoint ended keeps its
        // snapshot whatever it takes (it is the agent's only state now).
        if (auto why = op->leave_running ? room_refusal() : std::nullopt) {
          ::unlink(tmp.c_str());
          writer_done();
          return checkpoint_failed(op, "no_space", "checkpoint not kept: " + *why);
        }
        if (op->chunked) {
          // The chunk list before the index that makes the snapshot visible.
          auto w = os::write_file_atomic(base + ".chunks", json::serialize(archive::to_json(*op->info->chunks)));
          writer_done();
          if (!w) return checkpoint_failed(op, "io", "store the chunk list: " + w.error().message());
        } else if (::rename(tmp.c_str(), (base + ".tar.zst").c_str()) != 0) {
          return checkpoint_failed(op, "io", "store the archive: " + std::string(std::strerror(errno)));
        }
        --checkpoints_;
        std::erase(dumping_, op);
        // The payload stays extracted beside the archive: forks of it need no decompression. A
        // snapshot in the chunk store keeps only its chunks; it is extracted when restored.
        os::remove_tree(base + ".d");
        if (!op->chunked && ::rename((op->work + "/payload").c_str(), (base + ".d").c_str()) == 0) {
          json::object m = op->manifest;
          m["verified"] = own_verified(op->key.get());
          (void)os::write_file_atomic(base + ".d/manifest.json", json::serialize(m) + "\n");
          (void)os::write_file_atomic(base + ".d/.complete", "");
        }
        (void)os::write_file_atomic(base + ".json", json::serialize(index) + "\n");
        os::remove_tree(op->work);
        if (op->held) {
          held_[op->branch].snapshot = op->id;
        } else {
          host_.set_busy(op->branch, false);
        }
        json::object ev{{"type", "checkpoint.created"},
                        {"snapshot", op->id},
                        {"name", op->name},
                        {"parent", op->manifest["parent"]},
                        {"mode", op->live ? "live" : "fs"},
                        {"leave_running", op->leave_running},
                        {"sizes", sizes_of(*op)},
                        {"timings_ms", timings},
                        // The agent's pause (stopped until its dump and layer copy ended), and
                        // the whole checkpoint with the archive's compression and hashing.
                        {"pause_ms", timings["freeze"]},
                        {"total_ms", timings["total"]}};
        if (!op->chunked) ev["archive"] = base + ".tar.zst";
        if (!op->live) ev["note"] = op->note;
        if (op->held) ev["held"] = true;
        host_.emit(op->branch, ev);
        log()->info("checkpoint {} of branch {}: {} bytes in {} ms", op->id, op->branch,
                    op->chunked ? op->info->chunks->added_bytes : op->info->compressed_bytes,
                    timings["total"].to_number<double>());
        json::object r{{"ok", true},
                       {"snapshot", op->id},
                       {"mode", op->live ? "live" : "fs"},
                       {"sizes", ev["sizes"]},
                       {"timings_ms", timings}};
        if (!op->live) r["note"] = op->note;
        if (op->held) r["held"] = true;
        op->done(std::move(r));
        op_done();
      });
}

// ---- held trees (checkpoint_held) ----

void Checkpointer::hold_tree(CheckpointOp& op) {
  Held h;
  h.pid = op.ns_init_pid;
  h.fd = std::move(op.tree_fd);
  h.hold = ++holds_;
  // Continued if nobody released it within its hold: this hold, not a later one of the branch.
  defer(static_cast<uint64_t>(op.hold_ms), [this, branch = op.branch, hold = h.hold] {
    if (auto it = held_.find(branch); it != held_.end() && it->second.hold == hold)
      (void)release(branch, false, "nobody released it within its hold");
  });
  held_[op.branch] = std::move(h);
  op.stopped = false;  // the held tree is held_'s now: continue_op leaves it
  op.held = true;
}

json::object Checkpointer::release(const std::string& branch, bool end, const std::string& why) {
  auto it = held_.find(branch);
  if (it == held_.end())
    return error_reply("not_held", "branch \"" + branch + "\" holds no agent stopped by a checkpoint");
  Held h = std::move(it->second);
  held_.erase(it);
  if (end) {
    host_.ended_by_checkpoint(branch);
    kill_tree(h.pid, h.fd.get());
  } else {
    continue_tree(h.pid, h.fd.get());
  }
  host_.set_busy(branch, false);
  json::object ev{{"type", "checkpoint.released"}, {"action", end ? "ended" : "continued"}, {"why", why}};
  if (!h.snapshot.empty()) ev["snapshot"] = h.snapshot;
  host_.emit(branch, ev);
  log()->info("branch {} held by a checkpoint: {} ({})", branch, end ? "ended" : "continued", why);
  return {{"ok", true}, {"action", end ? "ended" : "continued"}};
}

}  // namespace sbx::checkpoint
