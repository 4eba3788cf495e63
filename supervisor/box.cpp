#include "supervisor/box.hpp"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "base/encoding.hpp"
#include "checkpoint/checkpointer.hpp"
#include "checkpoint/criu.hpp"
#include "os/box-dirs.hpp"
#include "os/files.hpp"
#include "os/pidfd.hpp"
#include "os/proc-view.hpp"
#include "os/sys.hpp"
#include "profile/agent-env.hpp"
#include "protocol/channel.hpp"
#include "sandbox/ns-init.hpp"
#include "sandbox/policy.hpp"
#include "supervisor/proc-io.hpp"
#include "supervisor/server.hpp"
#include "supervisor/stats.hpp"

extern char** environ;

namespace sbx::supervisor {

namespace {
auto log() {
  static auto l = spdlog::default_logger()->clone("box");
  return l;
}

// Whether this user is the one member of group `gid`, as OpenSSH's secure_permissions asks of a
// group-writable file: no other user names it as their primary group, its member list names no
// one else, and one of the two names this user. Read from the user and group databases (NSS).
bool only_member_is_this_user(gid_t gid) {
  std::vector<char> buf(1 << 16);
  struct group grp {};
  struct group* g = nullptr;
  struct passwd pw {};
  struct passwd* me = nullptr;
  if (::getgrgid_r(gid, &grp, buf.data(), buf.size() / 2, &g) != 0 || !g ||
      ::getpwuid_r(::geteuid(), &pw, buf.data() + buf.size() / 2, buf.size() / 2, &me) != 0 || !me)
    return false;
  int members = 0;
  for (char** m = g->gr_mem; m && *m; ++m, ++members)
    if (std::strcmp(*m, me->pw_name) != 0) return false;
  bool others = false;
  ::setpwent();
  while (struct passwd* p = ::getpwent())
    if (p->pw_gid == gid) {
      others = others || p->pw_uid != ::geteuid();
      ++members;
    }
  ::endpwent();
  return !others && members > 0;
}

// The state dir's ancestors, as OpenSSH's StrictModes walks them: whoever may rename entries in
// one may swap the state dir, or a directory above it, for a link while the supervisor runs (it
// names its files by the state dir's path). Each must be root's or this user's, and writable by
// no one else unless sticky (/tmp: there only an entry's owner may rename it); writable by
// group 0, by this user's own group on a directory of this user's (umask 002), or by a group
// whose one member is this user, passes. In a user namespace an owner it does not map shows as
// the overflow uid: taken for root's (nothing tells them apart).
// `missing_ok`: a directory not made yet is skipped (the check before the state dir is made, so a
// refused one is not left behind; it runs again, whole, on the real path once it is made).
void refuse_shared_ancestors(const std::string& dir, bool missing_ok = false) {
  // Outside a user namespace the overflow uid is a user of its own (nobody). Read only for an
  // owner that is neither root nor this user.
  auto unmapped = [](uid_t uid) {
    if (os::in_initial_user_namespace()) return false;
    auto text = os::read_file("/proc/sys/kernel/overflowuid");
    return uid == static_cast<uid_t>(text ? std::strtoul(text->c_str(), nullptr, 10) : 65534);
  };
  const char* why = "another user could swap the state dir for a link while the box runs";
  for (std::string p = dir; p.size() > 1;) {
    p.resize(std::max<size_t>(p.rfind('/'), 1));
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0) {
      if (missing_ok && errno == ENOENT) continue;
      throw std::runtime_error("state dir " + dir + ": its ancestor " + p + ": " + std::strerror(errno));
    }
    if (st.st_uid != 0 && st.st_uid != ::geteuid() && !unmapped(st.st_uid))
      throw std::runtime_error("state dir " + dir + ": its ancestor " + p + " belongs to uid " +
                               std::to_string(st.st_uid) + ": " + why +
                               "; use a directory below this user's or root's");
    bool shared = (st.st_mode & S_ISVTX) == 0 && (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
    bool own_group =
        (st.st_mode & S_IWOTH) == 0 && (st.st_gid == 0 || (st.st_uid == ::geteuid() && st.st_gid == ::getegid()) ||
                                        (shared && only_member_is_this_user(st.st_gid)));
    if (shared && !own_group) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
      throw std::runtime_error("state dir " + dir + ": its ancestor " + p + " is writable by others (mode " + mode +
                               ") and not sticky: " + why + "; chmod o-w,g-w (or +t) it, or use another directory");
    }
  }
}

// A box on a host (not a container's PID 1) refuses a state dir another user could have put
// things in: one they own (made first in a shared place such as /tmp) or one group or others may
// write that holds anything. The supervisor writes through the names in it (branches/, a
// workspace's image, the journal): a link planted there had it make directories, files and mounts,
// as its user, where the link pointed. An empty one of this user's (made with umask 002, or 0777)
// is narrowed first, then found empty. A container's state dir is the one its runtime gave it.
void refuse_shared_state_dir(const std::string& dir) {
  refuse_shared_ancestors(dir);
  const char* why = "links put in it would have the supervisor write where they point";
  auto own = os::open_own_dir(dir);
  if (!own)
    throw std::runtime_error("state dir " + own.error().message + ": " + why + "; use a directory of this user's own");
  const os::UniqueFd& fd = own->fd;
  const mode_t mode = own->st.st_mode & 07777;
  if ((mode & (S_IWGRP | S_IWOTH)) == 0) return;
  char was[8], now[8];
  std::snprintf(was, sizeof was, "%04o", mode);
  std::snprintf(now, sizeof now, "%04o", mode & ~(S_IWGRP | S_IWOTH));
  // Narrowed first: what is in it once no one else may write there stays what was.
  if (::fchmod(fd.get(), mode & ~(S_IWGRP | S_IWOTH)) != 0)
    throw std::runtime_error("state dir " + dir + " is writable by others (mode " + was + "): " + why +
                             "; narrowing it: " + std::strerror(errno));
  bool holds = false;
  // Where it cannot be listed: as if it held something.
  if (!os::for_each_name(fd.get(), [&](const char*) { return !(holds = true); })) holds = true;
  if (!holds) {
    log()->warn("state dir {} was writable by others (mode {}): narrowed to {}", dir, was, now);
    return;
  }
  (void)::fchmod(fd.get(), mode);
  throw std::runtime_error("state dir " + dir + " is writable by others (mode " + was + ") and holds files: " + why +
                           "; chmod go-w it (after checking what is in it), or use another");
}

// The state dir, made where it is missing and checked (off PID 1), by its real path: named so
// from here on (a symlink's, or a path through one, resolved once), the branch's mounts and masks,
// criu's --root and the journal all name the same directory. criu runs in other directories than
// ours (--work-dir, --root): a relative state dir would name other places there, and a live
// restore would fail on something unrelated.
std::string make_state_dir(std::string dir) {
  if (!dir.starts_with('/')) dir = std::filesystem::absolute(dir).string();
  // Where it is not made yet, the places above it are checked before it is made (below, whole).
  if (::getpid() != 1 && ::access(dir.c_str(), F_OK) != 0) {
    std::error_code planned_ec;
    auto planned = std::filesystem::weakly_canonical(dir, planned_ec);
    if (!planned_ec) refuse_shared_ancestors(planned.string(), true);
  }
  if (auto r = os::make_dirs(dir, 0700); !r)
    throw std::runtime_error("create state dir " + dir + ": " + r.error().message());
  std::error_code real_ec;
  auto real = std::filesystem::canonical(dir, real_ec);
  if (real_ec) throw std::runtime_error("resolve state dir " + dir + ": " + real_ec.message());
  if (::getpid() != 1) refuse_shared_state_dir(real.string());
  return real.string();
}

// `sandboxer ps --all` finds a stopped box by the record of where it ran (os/box-dirs.hpp), but for
// one under the default root, which it lists by itself, and a container's PID 1 (its host's tools
// list it). A record that fails is said: the box runs as it would.
void record_state_dir(const std::string& home, const std::string& dir) {
  if (home.empty() || ::getpid() == 1) return;
  if (auto root = os::real_path(os::default_box_root()); root && dir.substr(0, dir.rfind('/')) == root->first) return;
  if (auto r = os::record_box_dir(home, dir); !r)
    spdlog::warn("`sandboxer ps --all` will not list this box once it has stopped: {}", r.error().message);
}

// criu's kerndat cache is filled this long after the box starts (Checkpointer::warm_up): after
// the agent's own start, before a first checkpoint as a rule; a box that ends sooner never runs it.
constexpr uint64_t kWarmUpMs = 300;
}  // namespace

int exit_status_of(int st) {
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  return 255;
}

Box::Box(uv_loop_t* loop, BoxOptions opts) : loop_(loop), opts_(std::move(opts)) {}

Box::~Box() {
  server_.reset();
  if (!opts_.health_file.empty()) remove_health_file(opts_.health_file, health_id_);
  metrics_.reset();
  network_.reset();  // joins the broker's thread while the journal and the loop still exist
  copy_networks_.clear();
  signals_.reset();
  checkpointer_.reset();
  // The branches' handles close now, so that the loop's last turn below frees them.
  for (auto& [n, b] : branches_) {
    b->reports.reset();
    b->channel.reset();
    b->drain_timer.reset();
  }
  procs_.clear();
  kill_timer_.reset();
  heap_trimmer_.reset();
  persist_timer_.reset();
  stop_timer_.reset();
  LimitsWatcher::wait_for_registrations(loop_);
  uv_run(loop_, UV_RUN_NOWAIT);
}

uint64_t Box::emit(const std::string& branch, boost::json::object ev) {
  ev["branch"] = branch;
  heap_trimmer_.note();
  return journal_->append(std::move(ev));
}

void Box::send_request(Branch& b, const boost::json::object& req) {
  // Never a blocking write: a tree stopped for a checkpoint reads nothing until this loop
  // continues it (an exec's 200 KB argv once hung the supervisor there for good).
  if (!b.requests && b.launched.requests)  // the first: ns-init's config, before add_branch
    b.requests = std::make_unique<InputWriter>(loop_, std::move(b.launched.requests));
  if (!b.requests || b.requests->closed()) return;
  if (!b.requests->write(boost::json::serialize(req) + "\n"))
    log()->warn("send request to branch {}: over {} bytes wait for it to read them", b.name, InputWriter::kMaxPending);
}

void Box::signal_branch(const std::string& branch, int sig) {
  auto it = branches_.find(branch);
  if (it == branches_.end()) return;
  send_request(*it->second, {{"op", "signal"}, {"sig", sig}});
}

void Box::shutdown(int64_t grace_ms) {
  if (shutting_down_) {
    // A second request does not wait for the grace period.
    for (auto& [n, b] : branches_) send_request(*b, {{"op", "kill"}});
    return;
  }
  shutting_down_ = true;
  log()->info("shut down box {}: grace {} ms", id_, grace_ms);
  // A tree frozen for a full disk must see its TERM; what it writes now waits in memory.
  if (stopped_for_journal_) stop_for_journal(false);
  // A tree stopped for a checkpoint would not see the TERM until the dump ends: it goes on now.
  if (checkpointer_) checkpointer_->on_shutdown();
  for (auto& [n, b] : branches_) send_request(*b, {{"op", "shutdown"}, {"grace_ms", grace_ms}});
  maybe_finish();
  // Backstop: ns-init does the grace period itself; if it has not ended its branch by then
  // (stopped, wedged), killing it ends its whole pid namespace.
  kill_timer_ = loop::make_timer(loop_);
  kill_timer_->data = this;
  uv_timer_start(
      kill_timer_.get(),
      [](uv_timer_t* t) noexcept {
        auto* self = static_cast<Box*>(t->data);
        for (auto& [n, b] : self->branches_)
          if (!b->ns_init_reaped) {
            log()->warn("branch {} outlived its grace period: killing ns-init {}", n, b->launched.pid);
            ::kill(b->launched.pid, SIGKILL);
          }
      },
      static_cast<uint64_t>(grace_ms + 2000), 0);
}

void Box::on_signal(const struct signalfd_siginfo& si) {
  int sig = static_cast<int>(si.ssi_signo);
  switch (sig) {
    case SIGCHLD:
      reaper_.reap();
      break;
    case SIGTERM:
      stop(opts_.profile.resources.grace_ms);
      break;
    default:
      for (auto& [n, b] : branches_) signal_branch(n, sig);
  }
}

void Box::on_report(Branch& b, const boost::json::object& r, std::vector<os::UniqueFd> passed) {
  auto ev = r.if_contains("ev");
  if (!ev || !ev->is_string()) return;
  auto* pid_field = r.if_contains("proc");
  std::string proc_id = pid_field && pid_field->is_string() ? std::string(pid_field->as_string()) : b.main_proc;
  // ns-init calls its agent "main" in every branch; a copy's agent is "main@<branch>" here.
  if (proc_id == "main") proc_id = b.main_proc;
  if (*ev == "signal_failed") {
    log()->warn("signal {} to {} of branch {}: {}", r.contains("sig") ? boost::json::serialize(r.at("sig")) : "?",
                proc_id, b.name, r.contains("error") ? boost::json::serialize(r.at("error")) : "");
    return;
  }
  auto it = procs_.find(proc_key(b.name, proc_id));
  if (it == procs_.end()) return;
  Proc& p = *it->second;
  if (proc_id != b.main_proc) return on_exec_report(b, p, r, std::move(passed));
  if (*ev == "started" || *ev == "spawn_failed") b.starting = false;
  if (*ev == "started") {
    p.ns_pid = static_cast<pid_t>(r.at("pid").to_number<int64_t>());
    p.pid = p.ns_pid;
    if (b.launched.namespaced) {
      // From the kernel (launcher.hpp, kNsAgentPid): an agent that has already exited is no
      // longer among ns-init's children. A restored branch has no such record; its agent runs.
      p.pid = b.launched.take_agent_pid();
      if (p.pid < 0) {
        auto kids = os::children_of(b.launched.pid);
        p.pid = kids.empty() ? -1 : kids.front();
      }
    }
    if (auto* cg = r.if_contains("cgroup_ns_error"); cg && cg->is_string())
      log()->warn("branch {}: no cgroup namespace of its own ({}): its /proc/self/cgroup names the host's groups",
                  b.name, cg->as_string().c_str());
    boost::json::object e{{"type", "proc.started"}, {"proc", p.id}, {"pid", p.pid}};
    if (b.launched.namespaced) e["ns_pid"] = p.ns_pid;
    base::put_bytes_list(e, "argv", b.argv);
    emit(p.branch, std::move(e));
    start_readers(b, p);
  } else if (*ev == "spawn_failed") {
    p.error = r.contains("error") ? std::string(r.at("error").as_string()) : "could not start";
    log()->error("start {}: {}", p.id, p.error);
    start_readers(b, p);
  } else if (*ev == "exited") {
    if (b.limits) b.limits->stop();
    p.status = static_cast<int>(r.at("status").to_number<int64_t>());
    p.escalated = r.contains("escalated") && r.at("escalated").as_bool();
    p.status_known = true;
    maybe_proc_exited(p);
  }
}

void Box::start_readers(Branch& b, Proc& p) {
  if (p.out || p.err) return;
  auto on_eof = [this, &p] { maybe_proc_exited(p); };
  p.out = std::make_unique<OutputReader>(loop_, std::move(b.launched.out),
                                         OutputDecoder("stdout", true,
                                                       [this, &p](boost::json::object e) {
                                                         e["proc"] = p.id;
                                                         note_output(p.branch);
                                                         emit(p.branch, std::move(e));
                                                       }),
                                         on_eof);
  p.err = std::make_unique<OutputReader>(loop_, std::move(b.launched.err),
                                         OutputDecoder("stderr", false,
                                                       [this, &p](boost::json::object e) {
                                                         e["proc"] = p.id;
                                                         note_output(p.branch);
                                                         emit(p.branch, std::move(e));
                                                       }),
                                         on_eof);
  if (b.output_paused) pause_readers(p, true);  // readers of a branch whose output waits start paused
}

void Box::maybe_proc_exited(Proc& p) {
  auto& b = *branches_.at(p.branch);
  if (p.exited_sent || !p.status_known || (p.id == b.main_proc && !b.ns_init_reaped)) return;
  if ((p.out && !p.out->done()) || (p.err && !p.err->done())) return;
  p.exited_sent = true;
  boost::json::object e{{"type", "proc.exited"}, {"proc", p.id}};
  if (WIFSIGNALED(p.status))
    e["signal"] = os::signal_name(WTERMSIG(p.status));
  else
    e["code"] = WEXITSTATUS(p.status);
  std::string reason = WIFSIGNALED(p.status) ? "signaled" : "exited";
  if (shutting_down_) reason = "shutdown";
  reason = limit_reason(p, reason);
  if (!b.ended_by.empty()) {
    reason = "killed";
    e["by"] = b.ended_by;
  }
  e["reason"] = reason;
  if (p.escalated) e["escalated"] = true;
  if (!p.error.empty()) e["error"] = p.error;
  emit(p.branch, std::move(e));
  for (auto& w : std::exchange(p.on_started, {})) w();
  if (p.id != b.main_proc)
    release_ended_exec(p);
  else if (b.name != "main" && b.ns_init_reaped)
    release_ended_branch(b);
  maybe_finish();
}

void Box::maybe_finish() {
  // The box ends when every branch's agent has ended (and no snapshot operation is under way),
  // with the status of the original agent; an idle box only when it is asked to stop.
  if (opts_.idle && !shutting_down_) return;
  if (checkpointer_ && checkpointer_->busy()) return;
  for (auto& [n, p] : procs_)
    if (!p->exited_sent) return;
  auto it = procs_.find(proc_key("main", "main"));
  if (it != procs_.end()) note_agent_end();
  // A hibernated agent was ended by its checkpoint: the box ends well (a restart resumes it).
  const char* reason = hibernated_ ? "hibernated" : shutting_down_ ? "shutdown" : "agent_exited";
  finish(it != procs_.end() && !hibernated_ ? exit_status_of(it->second->status) : 0, reason);
}

void Box::kill_leftovers() {
  // Anything of the agent still alive (flat mode: descendants that escaped a dead ns-init) dies
  // with the box: no process of the agent outlives the supervisor.
  // Through pidfds: a grandchild reaped by its own parent meanwhile may have left its pid to
  // some other process, which must not be killed.
  auto self = os::pidfd_open(::getpid());
  if (!self) {
    log()->error("pidfd of the supervisor: {}; leftovers are not killed", self.error().message());
    return;
  }
  for (int round = 0; round < 50; ++round) {
    auto all = os::tree_pidfds(::getpid(), self->get());
    if (all.empty()) return;
    for (auto& m : all) (void)os::pidfd_signal(m.fd.get(), SIGKILL);
    int st;
    while (::waitpid(-1, &st, WNOHANG | __WALL) > 0) {
    }
    ::usleep(2000);
  }
}

void Box::finish(int status, const char* reason) {
  if (finished_) return;
  finished_ = true;
  exit_status_ = status;
  // Journaled (and sent) before the clients are drained: a reader of the journal or the stream
  // knows the box has ended, and why, without asking whether its supervisor still runs.
  emit("main", {{"type", "box.exited"}, {"code", status}, {"reason", reason}});
  // Clients get what is queued for them and a close, briefly, before the loop stops.
  if (server_)
    server_->drain([this] { uv_stop(loop_); });
  else
    uv_stop(loop_);
}

// --events: every event, as the journal writes it, also to stdout ("-") or a file.
void Box::open_events_output() {
  if (opts_.events_path.empty()) return;
  auto fd = EventsOutput::open(opts_.events_path);
  if (!fd) throw std::runtime_error(fd.error().message);
  events_ = std::make_unique<EventsOutput>(loop_, std::move(*fd), journal_->dir());
  journal_->add_listener([this](const journal::Event& e) { events_->on_event(e.seq, e.line); });
}

// One supervisor a state dir (an flock on the directory itself, no file: a new inode would cost
// every start in a new state dir ~0.3 ms on ext4 here): a second one on it took the first's
// journal, box id and cgroups, and killed its agent as "an earlier run of this box" still in its
// cgroup.
void Box::lock_state_dir() {
  std::string holder;
  auto lock = os::lock_dir(opts_.state_dir, &holder);
  if (lock) {
    state_lock_ = std::move(*lock);
    // An earlier run's URL (note_url): this box writes its own once it listens.
    (void)::unlinkat(state_lock_.get(), "url", 0);
  } else if (lock.error() == std::errc::operation_would_block) {
    throw std::runtime_error("state dir " + opts_.state_dir + " is in use by another box" +
                             (holder.empty() ? "" : " (sandboxer-init, pid " + holder + ")") +
                             ": stop it first, or give this box a state dir of its own");
  } else {
    log()->warn("lock state dir {}: {}; a second box on it would not be refused", opts_.state_dir,
                lock.error().message());
  }
}

void Box::start() {
  opts_.state_dir = make_state_dir(opts_.state_dir);
  lock_state_dir();
  // Before anything is made in it by path (a workspace's mount point, resolv.conf): a link planted
  // in a state dir shared with another user is refused, not followed (as a container's PID 1 the
  // state dir itself is not checked).
  if (auto r = sandbox::make_branches_dir(opts_.state_dir); !r) throw std::runtime_error(r.error().message);
  std::string box_json = opts_.state_dir + "/box.json";
  if (auto text = os::read_file(box_json)) {
    reused_state_ = true;
    boost::system::error_code ec;
    auto v = boost::json::parse(*text, ec);
    if (!ec && v.is_object() && v.as_object().contains("id")) id_ = v.at("id").as_string();
  }
  if (id_.empty()) {
    id_ = "b-" + os::random_hex(6);
    if (auto r = os::write_file_atomic(box_json, boost::json::serialize(boost::json::object{{"id", id_}}) + "\n"); !r)
      throw std::runtime_error("write " + box_json + ": " + r.error().message());
  }
  auto j = journal::Journal::open(loop_, {.dir = opts_.state_dir + "/journal",
                                          .box = id_,
                                          .disk_cap = static_cast<uint64_t>(opts_.profile.journal.disk_cap),
                                          .queue_bytes = static_cast<uint64_t>(opts_.profile.journal.queue),
                                          .headroom = kFrameHeadroom});
  if (!j) throw std::runtime_error("open journal in " + opts_.state_dir + ": " + j.error().message());
  journal_ = std::move(*j);
  journal_->on_pressure([this](bool stop) { stop_for_journal(stop); });

  open_events_output();

  signals_ = std::make_unique<SignalSource>(loop_, [this](const struct signalfd_siginfo& si) { on_signal(si); });
  // A box that starts an agent learns whether it may make namespaces from the agent's own clone.
  caps_ = sandbox::detect_capabilities(nullptr, opts_.idle || !opts_.restore_file.empty());
  checkpointer_ = std::make_unique<checkpoint::Checkpointer>(loop_, *this, checkpoint_settings());
  // criu's version (for box.started) of the criu the checkpointer found: from the user's cache,
  // else `criu --version`, which takes several ms and runs while the agent is launched.
  if (auto home = os::state_home()) state_home_ = *home;
  choose_ns_init();
  sandbox::CriuVersionProbe criu_probe(checkpointer_->criu(), state_home_);

  boost::json::object caps;
  std::string why_not;
  bool live = false;
  auto read_criu = [&] {
    caps_.criu = criu_probe.version(3000);
    caps = caps_.to_json();
    // KSM shares identical pages of the box's live copies when the host runs it (README, "Forks").
    caps["ksm"] = boost::json::object{{"host", checkpoint::ksm_state()}, {"copies", opts_.profile.resources.ksm}};
    auto possible = checkpointer_->live_possible();
    live = possible.has_value();
    if (!live) why_not = possible.error().message;
    checkpointer_->warm_up(kWarmUpMs);
  };
  bool resuming = resumes_at_start();  // the newest snapshot of its main branch, not the command
  if (opts_.idle || !opts_.restore_file.empty() || resuming) {
    checkpointer_->open_store();
    read_criu();
    caps["live_checkpoint"] = live;
    if (!live) caps["why_not"] = why_not;
    boost::json::object started{{"type", "box.started"},
                                {"profile", opts_.profile.name},
                                {"isolation", caps_.isolation},
                                {"version", SBX_VERSION},
                                {"capabilities", caps}};
    if (resuming) started["resuming"] = true;
    uint64_t ended_seq = journal_->last_seq();  // the previous run's last event
    record_state_dir(state_home_, opts_.state_dir);
    if (opts_.restore_file.empty()) {
      emit("main", std::move(started));
      start_server();
      if (resuming) try_resume(ended_seq);
      return;
    }
    // A box from an archive continues the parent's journal: its own starts with restore.done
    // (after the parent's last seq), then box.started (docs/architecture.md, "Events").
    started["restored_from"] = opts_.restore_file;
    pending_started_ = std::move(started);
    checkpointer_->start_from_archive(opts_.restore_file);
    return;
  }

  auto b = std::make_unique<Branch>();
  b->name = "main";
  b->main_proc = "main";
  b->argv = opts_.argv;
  sandbox::BranchSpec spec = branch_spec(b->name);
  setup_branch_policy(*b, spec);
  BranchNetwork::prepare(opts_.profile, spec);
  // criu does not restore Landlock: such a tree is refused at checkpoint (docs/architecture.md, "Hosts").
  b->landlocked = opts_.profile.isolation.landlock.has_value();
  auto lb = sandbox::launch_branch(spec);
  cgroup_join_.clear();
  cgroup_dir_.reset();
  if (!lb) throw std::runtime_error("start branch main: " + lb.error().message);
  b->launched = std::move(*lb);
  b->starting = true;
  if (spec.want_namespaces && !b->launched.namespaced && b->launched.why_not.starts_with("clone(")) {
    caps_.namespaces = false;  // for the branches to come (forks, copies): flat, as this one
    caps_.namespaces_why_not = b->launched.why_not;
  }
  // launch_branch only knows that none were asked for; say which of the two reasons it was (before
  // the network, whose refusal quotes it).
  if (!spec.want_namespaces)
    b->launched.why_not =
        !opts_.profile.isolation.namespaces ? "namespaces are off in the profile" : caps_.namespaces_why_not;
  // Before the agent starts (ns-init waits for its config): its namespace's loopback and broker.
  network_ = std::make_unique<BranchNetwork>(loop_, opts_.profile, b->launched,
                                             [this](boost::json::object e) { emit("main", std::move(e)); });

  std::string workdir = b->launched.namespaced ? opts_.workdir : spec.dir + "/workspace";
  if (!b->launched.namespaced && opts_.workdir != "/workspace") workdir = opts_.workdir;
  b->cwd = workdir;
  // Where the agent has a root of its own, it reads who it is at /run/sandboxer/branch.json.
  if (b->launched.namespaced) checkpoint::write_branch_json(id_, b->name, b->lineage, spec.dir);
  auto env = agent_env(*b, spec.dir);
  network_->edit_env(env);
  agent_cwd_ = workdir;
  send_request(*b, sandbox::ns_init_config(opts_.argv, env, workdir, opts_.profile, caps_.landlock_abi,
                                           b->launched.namespaced, seccomp_program()));
  b->launched.in.reset();  // the main agent's stdin is empty
  // Not needed before the agent's start: made while ns-init runs (the snapshots dir is a new
  // inode of the state dir's disk, and a reused one may hold chunks to collect), as is the record
  // of where the box runs.
  checkpointer_->open_store();
  record_state_dir(state_home_, opts_.state_dir);

  Branch& bp = add_branch(std::move(b), false);
  start_limits(bp);
  read_criu();
  caps["namespaces"] = bp.launched.namespaced;
  if (!bp.launched.namespaced) caps["namespaces_why_not"] = bp.launched.why_not;
  caps["live_checkpoint"] = live && bp.launched.namespaced;
  if (!live)
    caps["why_not"] = why_not;
  else if (!bp.launched.namespaced)
    caps["why_not"] = "no pid and mount namespace of its own: " + bp.launched.why_not;
  emit("main", {{"type", "box.started"},
                {"profile", opts_.profile.name},
                {"isolation", caps_.isolation},
                {"version", SBX_VERSION},
                {"capabilities", caps},
                {"enforcement", enforcement_},
                {"network", network_->describe()}});
  start_server();
  start_persistence();
}

// ns-init's program: the same file for every branch of the box's life, a copy in the user's state
// dir that an upgrade replacing the installed one leaves (sandbox::stable_ns_init). Not as a
// container's PID 1: an image's files do not change under it, and each new container would copy.
void Box::choose_ns_init() {
  auto installed = sandbox::ns_init_binary(opts_.self_exe);
  ns_init_ = installed;
  if (::getpid() == 1) return;
  if (auto copy = sandbox::stable_ns_init(installed, state_home_))
    ns_init_ = *copy;
  else
    spdlog::info(
        "ns-init runs from {}, not from a copy of its own ({}): a checkpoint of this box after an upgrade "
        "that replaces that file fails",
        installed.path, copy.error().message);
}

sandbox::BranchSpec Box::branch_spec(const std::string& name) const {
  sandbox::BranchSpec spec;
  spec.name = name;
  spec.dir = opts_.state_dir + "/branches/" + name;
  spec.self_exe = opts_.self_exe;
  spec.ns_init = ns_init_;
  spec.want_namespaces = opts_.profile.isolation.namespaces && caps_.namespaces;
  spec.flat_refusal = sandbox::flat_fallback_refusal(opts_.profile.isolation.without_namespaces, caps_);
  spec.flat_fallback = spec.flat_refusal.empty();
  spec.masks = base_masks();
  return spec;
}

std::vector<std::string> Box::base_masks() const {
  auto masks = opts_.masks;
  masks.insert(masks.end(), opts_.profile.isolation.masks.begin(), opts_.profile.isolation.masks.end());
  masks.push_back(opts_.state_dir);
  for (auto& c : sandbox::credential_paths()) masks.push_back(c);
  return masks;
}

const std::vector<struct sock_filter>& Box::seccomp_program() {
  if (!seccomp_) {
    // The profile's policy was checked at start (check_profile_for_host): a file that has gone
    // since, or a libseccomp failure, throws here, and the branch's launch reports it.
    auto got = sandbox::cached_seccomp(sandbox::seccomp_description(opts_.profile.isolation.seccomp), state_home_);
    if (got.from_cache)
      spdlog::debug("seccomp program from the cache in {} ({} instructions)", state_home_, got.program.size());
    else if (!got.program.empty())
      spdlog::debug("seccomp program built ({} instructions){}", got.program.size(),
                    got.cache_error.empty() ? ", cached" : ", not cached: " + got.cache_error);
    seccomp_ = std::move(got.program);
  }
  return *seccomp_;
}

std::vector<std::string> Box::agent_env(const Branch& b, const std::string& dir) const {
  // A clean environment (agent-env.hpp), then who it is.
  profile::AgentEnvSpec spec;
  spec.inherit = opts_.env_inherit;
  for (char** e = environ; *e; ++e) spec.supervisor_env.emplace_back(*e);
  spec.home = opts_.profile.isolation.uid && *opts_.profile.isolation.uid != 0
                  ? profile::home_of(*opts_.profile.isolation.uid)
                  : "/root";
  spec.profile_env = opts_.profile.env;
  spec.extra = opts_.env;
  std::vector<std::string> env = profile::build_agent_env(spec);
  env.emplace_back("SANDBOXER_BOX=" + id_);
  env.emplace_back("SANDBOXER_BRANCH=" + b.name);
  env.emplace_back("SANDBOXER_WORKSPACE=" + (b.launched.namespaced ? std::string("/workspace") : dir + "/workspace"));
  env.emplace_back("SANDBOXER_CHANNEL_FD=" + std::to_string(sandbox::kAgentChanReq) + "," +
                   std::to_string(sandbox::kAgentChanRep));
  return env;
}

namespace {

// Reads what is there on a non-blocking fd into `pending`; false at EOF or a hard error.
bool read_available(int fd, std::string& pending) {
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      pending.append(buf, static_cast<size_t>(n));
      if (pending.size() > (1u << 20)) return false;  // no line is that long: a broken peer
      continue;
    }
    if (n == 0) return false;
    return errno == EAGAIN || errno == EINTR;
  }
}

// Calls fn for each complete JSON-object line in `pending`; `passed`, the fds that came with
// the message that completed the last of them, go with that line.
template <class Fn>
void for_each_line(std::string& pending, Fn&& fn, std::vector<os::UniqueFd> passed) {
  size_t nl;
  while ((nl = pending.find('\n')) != std::string::npos) {
    boost::system::error_code ec;
    auto v = boost::json::parse(std::string_view(pending).substr(0, nl), ec);
    pending.erase(0, nl + 1);
    bool last = pending.find('\n') == std::string::npos;
    fn(ec || !v.is_object() ? nullptr : &v.as_object(), last ? std::move(passed) : std::vector<os::UniqueFd>{});
  }
}

// Reads and hands to fn (as for_each_line) every report waiting on ns-init's reports socket
// (sandbox/launcher.hpp): one message per report, an exec'd process's fds attached to its own.
// False once ns-init's end is closed, or on a report no supervisor could take.
template <class Fn>
bool read_reports(int fd, std::string& pending, const std::string& branch, Fn&& fn) {
  constexpr size_t kMaxReport = 64 * 1024, kMaxFds = 8;
  std::vector<char> buf(kMaxReport);
  for (;;) {
    iovec iov{buf.data(), buf.size()};
    alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * kMaxFds)];
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    ssize_t n = ::recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno == EAGAIN;
    if (n == 0) return false;
    std::vector<os::UniqueFd> passed;
    for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int one;
        std::memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof one);
        passed.emplace_back(one);
      }
    }
    if (m.msg_flags & MSG_TRUNC) {
      // Not from the ns-init we started: its reports are small.
      log()->error("a report from branch {} over 64 KiB: dropped", branch);
      continue;
    }
    // Out of fds (RLIMIT_NOFILE), or more than ns-init sends: the report goes on without what did
    // not come, and its process fails to start, naming them.
    if (m.msg_flags & MSG_CTRUNC)
      log()->error(
          "a report from branch {} came without (some of) its fds: we are at RLIMIT_NOFILE, or it sent over {}", branch,
          kMaxFds);
    pending.append(buf.data(), static_cast<size_t>(n));
    if (pending.size() > (1u << 20)) return false;  // no line is that long: a broken peer
    for_each_line(pending, fn, std::move(passed));
  }
}

}  // namespace

Branch& Box::add_branch(std::unique_ptr<Branch> b, bool running) {
  Branch* bp = b.get();
  // ns-init is our child and not reaped yet (the reaper collects it on this loop), so its pid is
  // still its own: the pidfd opened now names it for good, even after it is reaped.
  if (auto fd = os::pidfd_open(b->launched.pid))
    b->pidfd = std::move(*fd);
  else
    log()->warn("pidfd of branch {} (ns-init {}): {}", b->name, b->launched.pid, fd.error().message());
  reaper_.watch(b->launched.pid, [this, bp](pid_t, int st) { on_branch_exit(*bp, st); });

  auto proc = std::make_unique<Proc>();
  proc->id = b->main_proc;
  proc->branch = b->name;
  Proc& p = *proc;
  procs_[proc_key(b->name, proc->id)] = std::move(proc);

  if (auto poll = loop::UvHandle<uv_poll_t>::make(loop_, uv_poll_init, b->launched.reports.get())) {
    b->reports = std::move(*poll);
    b->reports->data = bp;
  } else {
    log()->error("watch the reports of branch {}: {}", b->name, poll.error().message);
  }
  if (b->launched.requests) b->requests = std::make_unique<InputWriter>(loop_, std::move(b->launched.requests));
  if (b->launched.chan_rep) {
    b->chan_out = std::make_unique<InputWriter>(loop_, std::move(b->launched.chan_rep));
    b->chan_out->on_drained = [this, bp] {
      if (!bp->chan_backlogged) return;
      bp->chan_backlogged = false;
      serve_channel(*bp);
      if (!bp->chan_backlogged && !bp->output_paused) watch_channel(*bp, true);
    };
  }
  if (b->launched.chan_req) {
    if (auto poll = loop::UvHandle<uv_poll_t>::make(loop_, uv_poll_init, b->launched.chan_req.get())) {
      b->channel = std::move(*poll);
      b->channel->data = bp;
    } else {
      log()->error("watch the agent channel of branch {}: {}", b->name, poll.error().message);
    }
  }
  branches_[b->name] = std::move(b);
  if (running) start_readers(*bp, p);
  // A copy that finished restoring while the box stops ends with the others.
  if (shutting_down_) send_request(*bp, {{"op", "shutdown"}, {"grace_ms", opts_.profile.resources.grace_ms}});

  if (bp->reports) {
    uv_poll_start(bp->reports.get(), UV_READABLE, [](uv_poll_t* h, int, int) noexcept {
      auto* br = static_cast<Branch*>(h->data);
      auto* box = static_cast<Box*>(h->loop->data);
      bool open = read_reports(br->launched.reports.get(), br->pending, br->name,
                               [&](const boost::json::object* o, std::vector<os::UniqueFd> passed) {
                                 if (!o) return;
                                 try {
                                   box->on_report(*br, *o, std::move(passed));
                                 } catch (const std::exception& e) {
                                   log()->error("report from branch {}: {}", br->name, e.what());
                                 }
                               });
      if (!open) uv_poll_stop(h);
    });
  }
  if (bp->channel) watch_channel(*bp, true);
  return *bp;
}

void Box::watch_channel(Branch& b, bool on) {
  if (!b.channel || b.chan_closed) return;
  if (!on || b.chan_backlogged) {
    uv_poll_stop(b.channel.get());
    return;
  }
  uv_poll_start(b.channel.get(), UV_READABLE, [](uv_poll_t* h, int, int) noexcept {
    auto* br = static_cast<Branch*>(h->data);
    auto* box = static_cast<Box*>(h->loop->data);
    if (!read_available(br->launched.chan_req.get(), br->chan_pending)) {
      uv_poll_stop(h);
      br->chan_closed = true;
    }
    box->serve_channel(*br);
  });
}

void Box::serve_channel(Branch& b) {
  // One request per line; on_channel answers each one, a refusal included. What was read is
  // erased once at the end: a line at a time, a full 1 MiB pipe of short requests moved ~25 GB.
  size_t pos = 0;
  for (size_t nl; !b.chan_backlogged && (nl = b.chan_pending.find('\n', pos)) != std::string::npos; pos = nl + 1)
    on_channel(b, std::string(b.chan_pending, pos, nl - pos));
  b.chan_pending.erase(0, pos);
}

void Box::on_branch_exit(Branch& b, int st) {
  b.ns_init_reaped = true;
  b.ns_init_status = st;
  copy_networks_.erase(b.name);  // a copy's broker ends with its namespace
  if (b.limits) b.limits->stop();
  // Read what ns-init reported before it exited: its exit status alone loses the signal.
  (void)read_reports(b.launched.reports.get(), b.pending, b.name,
                     [&](const boost::json::object* o, std::vector<os::UniqueFd> passed) {
                       if (o) on_report(b, *o, std::move(passed));
                     });
  auto& p = *procs_.at(proc_key(b.name, b.main_proc));
  if (!p.status_known) {
    p.status = st;
    p.status_known = true;
  }
  if (!p.out) {
    // ns-init died before it said anything: drain whatever the pipes hold.
    on_report(b, {{"ev", "spawn_failed"}, {"error", "ns-init exited before starting the agent"}});
  }
  // A process that escaped the tree may still hold the pipes: stop waiting after a moment.
  if (!b.drain_timer) b.drain_timer = loop::make_timer(loop_);
  b.drain_timer->data = &p;
  uv_timer_start(
      b.drain_timer.get(),
      [](uv_timer_t* t) noexcept {
        auto* p = static_cast<Proc*>(t->data);
        try {
          if (p->out) p->out->close();
          if (p->err) p->err->close();
        } catch (const std::exception& e) {
          log()->error("stop reading the output of {}: {}", p->id, e.what());
        }
      },
      2000, 0);
  maybe_proc_exited(p);
  end_execs_of(b);
}

void Box::channel_reply(Branch& b, const boost::json::object& msg) {
  if (!b.chan_out || b.chan_out->closed()) return;
  // Never a blocking write: an agent that sends requests and reads no replies once hung the
  // supervisor in write(2). Past kChanBacklog unread, no request is served until it reads.
  if (!b.chan_out->write(protocol::channel_line(msg)))
    log()->warn("reply on the agent channel of branch {}: dropped, the agent is not reading them", b.name);
  if (b.chan_out->pending() > kChanBacklog && !b.chan_backlogged) {
    b.chan_backlogged = true;
    if (b.channel && !b.chan_closed) uv_poll_stop(b.channel.get());
  }
}

// One request on the agent channel, parsed by protocol::parse_channel_request, answered in the
// server's reply shape with the request's id. This is the channel's one boundary (docs/errors.md,
// section 3): a refusal (RequestError) is answered with its code, anything else with `internal`,
// and the agent and its channel go on either way.
void Box::on_channel(Branch& b, std::string_view line) {
  using protocol::ChannelOp;
  boost::json::value id;
  try {
    auto req = protocol::parse_channel_request(line, &id);
    auto answer = [this, &b, &id](const boost::json::object& body) {
      channel_reply(b, protocol::reply_with_id(id, body));
    };
    // An answer given later finds the branch again by name: it may have ended meanwhile.
    std::string bname = b.name;
    auto later = [this, bname, id](const boost::json::object& body) {
      auto it = branches_.find(bname);
      if (it != branches_.end()) channel_reply(*it->second, protocol::reply_with_id(id, body));
    };
    switch (req.op) {
      case ChannelOp::whoami:
        return answer(checkpoint::identity(id_, b.name, b.lineage));
      case ChannelOp::event: {
        boost::json::object ev = std::move(req.event);
        ev["proc"] = b.main_proc;
        uint64_t seq = emit(b.name, std::move(ev));
        return answer({{"ok", true}, {"seq", seq}});
      }
      case ChannelOp::checkpoint:
      case ChannelOp::fork: {
        int n = req.op == ChannelOp::fork ? req.n : 0;
        // A live copy answers this same request in its own channel: the manifest keeps its id.
        b.chan_inflight = id.is_int64() && id.as_int64() >= 0 ? id.as_int64() : -1;
        auto answered = [this, bname, later](boost::json::object r) {
          auto it = branches_.find(bname);
          if (it != branches_.end()) it->second->chan_inflight = -1;
          r["copy"] = false;
          later(r);
        };
        // A fork's copies start from the dump's images, before its archive is sealed.
        if (n > 0)
          return checkpointer_->fork_branch(bname, req.name, n, req.leave_running, answered, bname,
                                            opts_.profile.checkpoint.enabled());
        checkpoint(bname, req.name, req.leave_running, answered, bname);
        return;
      }
      case ChannelOp::snapshot_list:
        // The channel sees the snapshots it may restore (checkpoint/README.md, "The agent channel").
        return answer({{"ok", true}, {"snapshots", checkpointer_->list_for(b.name, b.lineage)}});
      case ChannelOp::restore:
      case ChannelOp::snapshot_delete: {
        bool to_delete = req.op == ChannelOp::snapshot_delete;
        if (auto refusal = checkpointer_->channel_refusal(b.name, b.lineage, req.snapshot, to_delete)) {
          log()->warn("agent channel of branch {}: {} {}: {}", b.name, protocol::channel_op_name(req.op), req.snapshot,
                      std::string(refusal->at("error").at("message").as_string()));
          return answer(*refusal);
        }
        if (to_delete) return answer(snapshot_delete(req.snapshot));
        if (auto refusal = checkpointer_->copies_refusal(bname, 1)) return answer(*refusal);
        return restore(req.snapshot, 1, false, later);
      }
    }
  } catch (const protocol::RequestError& e) {
    channel_reply(b, protocol::error_reply(id, e.code, e.what()));
  } catch (const std::exception& e) {
    log()->error("agent channel of branch {}: {}", b.name, e.what());
    channel_reply(b, protocol::error_reply(id, "internal", e.what()));
  }
}

void Box::emit_started() {
  if (pending_started_.empty()) return;
  emit("main", std::exchange(pending_started_, {}));
  // A box from an archive serves once its journal has begun (restore.done, box.started).
  start_server();
  // Its agent, if the restore gave it one, is kept as any box's is (the profile's `checkpoint`).
  if (branches_.contains("main")) start_persistence();
}

void Box::checkpoint(const std::string& branch, const std::string& name, bool leave_running, Reply done,
                     const std::string& by) {
  // In a box that keeps snapshots of its own (the profile's `checkpoint` section), one asked for
  // (the API's, the agent channel's, a fork's) joins them in the chunk store and adds what
  // changed, as theirs do; it is exported as an archive written from the store.
  checkpointer_->checkpoint(branch, name, leave_running, std::move(done), by, opts_.profile.checkpoint.enabled());
}

void Box::fork_branch(const std::string& branch, const std::string& name, int n, Reply done) {
  checkpointer_->fork_branch(branch, name, n, true, std::move(done), "", opts_.profile.checkpoint.enabled());
}

void Box::restore(const std::string& snapshot, int n, bool fork, Reply done) {
  checkpointer_->restore(snapshot, n, fork, std::move(done));
}

void Box::restore_as_copy(const std::string& snapshot, int index, Reply done, const std::string& from) {
  if (!opts_.idle || becoming_copy_ || branches_.contains("main")) {
    std::string why = becoming_copy_ ? "is becoming one already" : "runs an agent of its own";
    return done({{"ok", false},
                 {"error",
                  {{"code", "not_idle"},
                   {"message", "restore with an index makes an idle box (--idle) a copy; this box " + why}}}});
  }
  becoming_copy_ = true;
  checkpointer_->restore_main(
      snapshot, index,
      [this, done = std::move(done)](boost::json::object r) {
        becoming_copy_ = false;
        if (r.at("ok").as_bool()) {
          opts_.idle = false;  // the box now ends with its agent, and keeps it as its profile says
          start_persistence();
        }
        done(std::move(r));
      },
      from);
}

boost::json::array Box::snapshot_list() { return checkpointer_->list(); }

boost::json::object Box::snapshot_delete(const std::string& id) { return checkpointer_->remove(id); }

void Box::snapshot_archive(const std::string& id, checkpoint::Checkpointer::ArchiveReady ready, const std::string& base,
                           const std::string& lacks) {
  checkpointer_->export_archive(id, std::move(ready), base, lacks);
}

void Box::snapshot_chunks(const std::string& id, uint64_t from, Reply done) {
  checkpointer_->chunk_page(id, from, std::move(done));
}

void Box::snapshot_lacks(std::string hashes, Reply done) { checkpointer_->lacks(std::move(hashes), std::move(done)); }

std::string Box::snapshot_incoming_path() const { return checkpointer_->incoming_path(); }

void Box::snapshot_import(const std::string& tmp, Reply done) { checkpointer_->import_archive(tmp, std::move(done)); }

int Box::run() {
  loop_->data = this;
  try {
    start();
  } catch (const std::exception& e) {
    log()->critical("{}", e.what());
    kill_leftovers();
    teardown_policy();
    // The journal of a start that failed once it was open (after box.started where the server
    // could not listen) ends with why, as a box's last event: `sandboxer log` tells it.
    if (journal_ && !finished_) {
      finished_ = true;
      emit("main", {{"type", "box.exited"}, {"code", 125}, {"reason", "failed"}, {"error", e.what()}});
      journal_->flush();
    }
    if (events_) events_->finish();
    return 125;
  }
  uv_run(loop_, UV_RUN_DEFAULT);
  kill_leftovers();
  teardown_policy();
  journal_->flush();
  if (events_) events_->finish();
  return exit_status_;
}

}  // namespace sbx::supervisor
