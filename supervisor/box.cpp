#include "box.hpp"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "os/sys.hpp"
#include "policy.hpp"
#include "proc-io.hpp"
#include "server.hpp"
#include "stats.hpp"

extern char** environ;

namespace sbx::supervisor {

namespace {
auto log() {
  static auto l = spdlog::default_logger()->clone("box");
  return l;
}
}  // namespace

int exit_status_of(int st) {
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  return 255;
}

Box::Box(uv_loop_t* loop, BoxOptions opts) : loop_(loop), opts_(std::move(opts)) {}

Box::~Box() {
  server_.reset();
  metrics_.reset();
  signals_.reset();
  for (auto& [n, b] : branches_)
    if (b->reports)
      uv_close(reinterpret_cast<uv_handle_t*>(b->reports), [](uv_handle_t* h) { delete reinterpret_cast<uv_poll_t*>(h); });
  procs_.clear();
  for (auto* t : {kill_timer_, drain_timer_})
    if (t) uv_close(reinterpret_cast<uv_handle_t*>(t), [](uv_handle_t* h) { delete reinterpret_cast<uv_timer_t*>(h); });
  uv_run(loop_, UV_RUN_NOWAIT);
}

uint64_t Box::emit(const std::string& branch, boost::json::object ev) {
  ev["branch"] = branch;
  return journal_->append(std::move(ev));
}

void Box::send_request(Branch& b, const boost::json::object& req) {
  if (!b.launched.requests) return;
  if (auto r = os::write_all(b.launched.requests.get(), boost::json::serialize(req) + "\n"); !r)
    log()->warn("send request to branch {}: {}", b.name, r.error().message());
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
  for (auto& [n, b] : branches_) send_request(*b, {{"op", "shutdown"}, {"grace_ms", grace_ms}});
  // Backstop: ns-init does the grace period itself; if it has not ended its branch by then
  // (stopped, wedged), killing it ends its whole pid namespace.
  kill_timer_ = new uv_timer_t;
  uv_timer_init(loop_, kill_timer_);
  kill_timer_->data = this;
  uv_timer_start(
      kill_timer_,
      [](uv_timer_t* t) {
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
      shutdown(opts_.profile.resources.grace_ms);
      break;
    default:
      for (auto& [n, b] : branches_) signal_branch(n, sig);
  }
}

void Box::on_report(Branch& b, const boost::json::object& r) {
  auto ev = r.if_contains("ev");
  if (!ev || !ev->is_string()) return;
  auto* pid_field = r.if_contains("proc");
  std::string proc_id = pid_field && pid_field->is_string() ? std::string(pid_field->as_string()) : b.main_proc;
  auto it = procs_.find(proc_id);
  if (it == procs_.end()) return;
  Proc& p = *it->second;
  if (proc_id != b.main_proc) return on_exec_report(b, p, r);
  auto start_readers = [&] {
    if (p.out || p.err) return;
    auto on_eof = [this, &p] { maybe_proc_exited(p); };
    p.out = std::make_unique<OutputReader>(
        loop_, std::move(b.launched.out),
        OutputDecoder("stdout", true,
                      [this, &p](boost::json::object e) {
                        e["proc"] = p.id;
                        note_output(p.branch);
                        emit(p.branch, std::move(e));
                      }),
        on_eof);
    p.err = std::make_unique<OutputReader>(
        loop_, std::move(b.launched.err),
        OutputDecoder("stderr", false,
                      [this, &p](boost::json::object e) {
                        e["proc"] = p.id;
                        note_output(p.branch);
                        emit(p.branch, std::move(e));
                      }),
        on_eof);
  };
  if (*ev == "started") {
    p.ns_pid = static_cast<pid_t>(r.at("pid").to_number<int64_t>());
    p.pid = p.ns_pid;
    if (b.launched.namespaced) {
      auto kids = os::children_of(b.launched.pid);
      p.pid = kids.empty() ? -1 : kids.front();
    }
    boost::json::object e{{"type", "proc.started"}, {"proc", p.id}, {"pid", p.pid}};
    if (b.launched.namespaced) e["ns_pid"] = p.ns_pid;
    boost::json::array argv;
    for (auto& a : opts_.argv) argv.emplace_back(a);
    e["argv"] = std::move(argv);
    emit(p.branch, std::move(e));
    start_readers();
  } else if (*ev == "spawn_failed") {
    p.error = r.contains("error") ? std::string(r.at("error").as_string()) : "could not start";
    log()->error("start {}: {}", p.id, p.error);
    start_readers();
  } else if (*ev == "exited") {
    if (b.limits) b.limits->stop();
    p.status = static_cast<int>(r.at("status").to_number<int64_t>());
    p.escalated = r.contains("escalated") && r.at("escalated").as_bool();
    p.status_known = true;
    maybe_proc_exited(p);
  }
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
  e["reason"] = reason;
  if (p.escalated) e["escalated"] = true;
  if (!p.error.empty()) e["error"] = p.error;
  emit(p.branch, std::move(e));
  for (auto& w : std::exchange(p.on_started, {})) w();
  if (p.id == "main") finish(exit_status_of(p.status));
}

void Box::kill_leftovers() {
  // Anything of the agent still alive (flat mode: descendants that escaped a dead ns-init) dies
  // with the box: no process of the agent outlives the supervisor.
  for (int round = 0; round < 50; ++round) {
    std::vector<pid_t> all, stack = os::children_of(::getpid());
    while (!stack.empty()) {
      pid_t p = stack.back();
      stack.pop_back();
      all.push_back(p);
      for (pid_t c : os::children_of(p)) stack.push_back(c);
    }
    if (all.empty()) return;
    for (pid_t p : all) ::kill(p, SIGKILL);
    int st;
    while (::waitpid(-1, &st, WNOHANG | __WALL) > 0) {
    }
    ::usleep(2000);
  }
}

void Box::finish(int status) {
  if (finished_) return;
  finished_ = true;
  exit_status_ = status;
  // Clients get what is queued for them and a close, briefly, before the loop stops.
  if (server_) server_->drain([this] { uv_stop(loop_); });
  else uv_stop(loop_);
}

void Box::start() {
  if (auto r = os::make_dirs(opts_.state_dir, 0700); !r)
    throw std::runtime_error("create state dir " + opts_.state_dir + ": " + r.error().message());
  std::string box_json = opts_.state_dir + "/box.json";
  if (auto text = os::read_file(box_json)) {
    boost::system::error_code ec;
    auto v = boost::json::parse(*text, ec);
    if (!ec && v.is_object() && v.as_object().contains("id")) id_ = v.at("id").as_string();
  }
  if (id_.empty()) {
    id_ = "b-" + os::random_hex(6);
    if (auto r = os::write_file_atomic(box_json, boost::json::serialize(boost::json::object{{"id", id_}}) + "\n"); !r)
      throw std::runtime_error("write " + box_json + ": " + r.error().message());
  }
  auto j = Journal::open(loop_, {.dir = opts_.state_dir + "/journal", .box = id_,
                                .disk_cap = static_cast<uint64_t>(opts_.profile.journal.disk_cap)});
  if (!j) throw std::runtime_error("open journal in " + opts_.state_dir + ": " + j.error().message());
  journal_ = std::move(*j);

  if (opts_.events_path == "-") {
    events_fd_.reset(::fcntl(1, F_DUPFD_CLOEXEC, 3));
  } else if (!opts_.events_path.empty()) {
    events_fd_.reset(::open(opts_.events_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640));
    if (!events_fd_) throw std::runtime_error("open --events " + opts_.events_path + ": " + std::strerror(errno));
  }
  if (events_fd_) {
    journal_->add_listener([this](const Event& e) {
      if (!events_fd_) return;
      std::string l = e.line;
      l.push_back('\n');
      if (auto r = os::write_all(events_fd_.get(), l); !r) {
        log()->warn("write events: {} (the journal still has every event)", r.error().message());
        events_fd_.reset();
      }
    });
  }

  signals_ = std::make_unique<SignalSource>(loop_, [this](const struct signalfd_siginfo& si) { on_signal(si); });
  caps_ = detect_capabilities();

  auto b = std::make_unique<Branch>();
  b->name = "main";
  b->main_proc = "main";
  BranchSpec spec;
  spec.name = b->name;
  spec.dir = opts_.state_dir + "/branches/" + b->name;
  spec.self_exe = opts_.self_exe;
  spec.want_namespaces = opts_.profile.isolation.namespaces && caps_.namespaces;
  spec.masks = opts_.masks;
  spec.masks.push_back(opts_.state_dir);
  setup_branch_policy(*b, spec);
  auto lb = launch_branch(spec);
  cgroup_procs_.clear();
  if (!lb) throw std::runtime_error("start branch main: " + lb.error().message());
  b->launched = std::move(*lb);
  // launch_branch only knows that none were asked for; say which of the two reasons it was.
  if (!spec.want_namespaces)
    b->launched.why_not = !opts_.profile.isolation.namespaces ? "namespaces are off in the profile" : caps_.namespaces_why_not;

  // The agent's environment: ours, less the supervisor's secrets, plus who it is.
  boost::json::array env;
  for (char** e = environ; *e; ++e) {
    std::string_view kv = *e;
    if (kv.starts_with("SANDBOXER_TOKEN") || kv.starts_with("SANDBOXER_BOX=") || kv.starts_with("SANDBOXER_BRANCH="))
      continue;
    env.emplace_back(kv);
  }
  std::string workdir = b->launched.namespaced ? opts_.workdir : spec.dir + "/workspace";
  if (!b->launched.namespaced && opts_.workdir != "/workspace") workdir = opts_.workdir;
  env.emplace_back("SANDBOXER_BOX=" + id_);
  env.emplace_back("SANDBOXER_BRANCH=" + b->name);
  env.emplace_back("SANDBOXER_WORKSPACE=" + (b->launched.namespaced ? std::string("/workspace") : spec.dir + "/workspace"));
  boost::json::array argv;
  for (auto& a : opts_.argv) argv.emplace_back(a);
  agent_env_ = env;
  agent_cwd_ = workdir;
  boost::json::object config{{"argv", argv}, {"env", env}, {"cwd", workdir}, {"grace_ms", opts_.profile.resources.grace_ms},
                             {"policy", policy_to_json(opts_.profile, caps_.landlock_abi)}};
  send_request(*b, config);
  b->launched.in.reset();  // the main agent's stdin is empty

  Branch* bp = b.get();
  reaper_.watch(b->launched.pid, [this, bp](pid_t, int st) {
    bp->ns_init_reaped = true;
    bp->ns_init_status = st;
    if (bp->limits) bp->limits->stop();
    // Read what ns-init reported before it exited: its exit status alone loses the signal.
    char buf[4096];
    for (;;) {
      ssize_t n = ::read(bp->launched.reports.get(), buf, sizeof buf);
      if (n <= 0) break;
      bp->pending.append(buf, static_cast<size_t>(n));
    }
    size_t nl;
    while ((nl = bp->pending.find('\n')) != std::string::npos) {
      boost::system::error_code ec;
      auto v = boost::json::parse(std::string_view(bp->pending).substr(0, nl), ec);
      bp->pending.erase(0, nl + 1);
      if (!ec && v.is_object()) on_report(*bp, v.as_object());
    }
    auto& p = *procs_.at(bp->main_proc);
    if (!p.status_known) {
      p.status = st;
      p.status_known = true;
    }
    if (!p.out) {
      // ns-init died before it said anything: drain whatever the pipes hold.
      on_report(*bp, {{"ev", "spawn_failed"}, {"error", "ns-init exited before starting the agent"}});
    }
    // A process that escaped the tree may still hold the pipes: stop waiting after a moment.
    drain_timer_ = new uv_timer_t;
    uv_timer_init(loop_, drain_timer_);
    drain_timer_->data = &p;
    uv_timer_start(
        drain_timer_,
        [](uv_timer_t* t) {
          auto* p = static_cast<Proc*>(t->data);
          if (p->out) p->out->close();
          if (p->err) p->err->close();
        },
        2000, 0);
    maybe_proc_exited(p);
    end_execs_of(*bp);
  });

  auto proc = std::make_unique<Proc>();
  proc->id = "main";
  proc->branch = b->name;
  procs_.emplace(proc->id, std::move(proc));

  b->reports = reinterpret_cast<uv_pipe_t*>(new uv_poll_t);
  auto* poll = reinterpret_cast<uv_poll_t*>(b->reports);
  uv_poll_init(loop_, poll, b->launched.reports.get());
  poll->data = bp;
  branches_.emplace(b->name, std::move(b));

  boost::json::object caps = caps_.to_json();
  caps["namespaces"] = bp->launched.namespaced;
  if (!bp->launched.namespaced) caps["namespaces_why_not"] = bp->launched.why_not;
  caps["live_checkpoint"] = false;
  caps["why_not"] = !bp->launched.namespaced ? "no pid and mount namespace of its own: " + bp->launched.why_not
                    : !caps_.criu            ? std::string("criu was not found")
                                             : std::string("live checkpoint is not built yet");
  start_limits(*bp);
  emit("main", {{"type", "box.started"},
                {"profile", opts_.profile.name},
                {"isolation", caps_.isolation},
                {"version", SBX_VERSION},
                {"capabilities", caps},
                {"enforcement", enforcement_}});

  start_server();

  uv_poll_start(poll, UV_READABLE, [](uv_poll_t* h, int, int) {
    auto* br = static_cast<Branch*>(h->data);
    Box* self = nullptr;
    (void)self;
    char buf[4096];
    ssize_t n = ::read(br->launched.reports.get(), buf, sizeof buf);
    if (n <= 0) {
      if (n == 0 || (errno != EAGAIN && errno != EINTR)) uv_poll_stop(h);
      return;
    }
    br->pending.append(buf, static_cast<size_t>(n));
    // The box is reached through the loop's data pointer.
    auto* box = static_cast<Box*>(h->loop->data);
    size_t nl;
    while ((nl = br->pending.find('\n')) != std::string::npos) {
      boost::system::error_code ec;
      auto v = boost::json::parse(std::string_view(br->pending).substr(0, nl), ec);
      br->pending.erase(0, nl + 1);
      if (!ec && v.is_object()) {
        try {
          box->on_report(*br, v.as_object());
        } catch (const std::exception& e) {
          log()->error("report from branch {}: {}", br->name, e.what());
        }
      }
    }
  });
}

int Box::run() {
  loop_->data = this;
  try {
    start();
  } catch (const std::exception& e) {
    log()->critical("{}", e.what());
    kill_leftovers();
    teardown_policy();
    return 125;
  }
  uv_run(loop_, UV_RUN_DEFAULT);
  kill_leftovers();
  teardown_policy();
  journal_->flush();
  return exit_status_;
}

}  // namespace sbx::supervisor
