#include "sandbox/ns-init.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <cerrno>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/encoding.hpp"
#include "base/result.hpp"
#include "os/child-error.hpp"
#include "os/pidfd.hpp"
#include "os/signal-mask.hpp"
#include "os/sys.hpp"
#include "sandbox/launcher.hpp"
#include "sandbox/policy.hpp"

namespace sbx::sandbox {

namespace {

int64_t now_ms() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

// One report, one message on the reports socket (launcher.hpp), with `fds` attached to it
// (SCM_RIGHTS): the supervisor gets its own copies of them, as a dup would give. A failed send
// means the supervisor is gone, and then nobody is listening.
void report(const boost::json::object& o, std::span<const int> fds = {}) {
  std::string line = boost::json::serialize(o) + "\n";
  iovec iov{line.data(), line.size()};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  constexpr size_t kMaxFds = 3;
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
  if (!fds.empty() && fds.size() <= kMaxFds) {
    m.msg_control = ctl;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  while (::sendmsg(kNsCtlOut, &m, MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

// Reads the first line from the blocking requests fd (the config, before the loop starts);
// whatever follows it stays in `rest` for the loop.
std::string read_line_blocking(int fd, std::string& rest) {
  char buf[16384];
  for (;;) {
    size_t nl = rest.find('\n');
    if (nl != std::string::npos) {
      std::string line = rest.substr(0, nl);
      rest.erase(0, nl + 1);
      return line;
    }
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::exchange(rest, {});
    rest.append(buf, static_cast<size_t>(n));
  }
}

class NsInit {
 public:
  explicit NsInit(bool flat) : flat_(flat) {}
  int run();

 private:
  void spawn_agent(const boost::json::object& cfg);
  /// Collects every exited child; true when none is left at all (ECHILD).
  bool reap();
  void on_signal(int sig);
  void on_request(const boost::json::object& req);
  void signal_tree(int sig);
  void begin_shutdown(int64_t grace_ms);
  void exec_proc(const boost::json::object& req);
  void handle_pending();

  bool flat_;
  std::string cgroup_ns_error_;         // why the branch has no cgroup namespace of its own ("": it has)
  os::UniqueFd self_;                   // our own pidfd: the root of tree_pidfds in flat mode
  std::vector<std::string> base_env_;   // the agent's environment, for exec
  std::map<pid_t, std::string> execs_;  // exec'd procs by pid -> proc id
  // The agent's policy (policy.hpp), prepared before the first fork; every process ns-init
  // starts in the branch gets it with apply_policy() in its child.
  PreparedPolicy policy_;
  pid_t agent_ = -1;
  bool agent_done_ = false;
  int agent_status_ = 0;
  bool escalated_ = false;
  int64_t deadline_ = -1;  // when to send KILL, or -1
  int64_t grace_ms_ = 10000;
  bool killed_ = false;
  std::string pending_;
};

void NsInit::signal_tree(int sig) {
  if (!flat_) {
    // PID 1 of the namespace: -1 reaches every other process in it, whatever its group.
    ::kill(-1, sig);
    return;
  }
  // Flat mode: the agent's group, then every descendant (orphans reparent to us, the subreaper),
  // each through a pidfd checked against its parent (os/pidfd.hpp): never a reused pid.
  if (agent_ > 0 && !agent_done_) ::kill(-agent_, sig);
  if (!self_) {
    if (auto fd = os::pidfd_open(::getpid())) self_ = std::move(*fd);
  }
  for (auto& m : os::tree_pidfds(::getpid(), self_.get())) (void)os::pidfd_signal(m.fd.get(), sig);
}

void NsInit::begin_shutdown(int64_t grace_ms) {
  if (deadline_ < 0) deadline_ = now_ms() + grace_ms;
  signal_tree(SIGTERM);
  // A stopped process cannot act on TERM until it is continued.
  signal_tree(SIGCONT);
}

// The steps of an agent's child before exec, as it reports them (os::child_fail).
enum : int { kStepChdir = 1, kStepExec = 2, kStepPolicy = 3 };

// A process spawn() started. Its child may have failed before it ran the program (its chdir, the
// policy, the exec: they arrive through a close-on-exec pipe): then `failed` says how, and the
// child, which exits 127, is reaped like any other.
struct Spawned {
  pid_t pid = -1;
  std::string failed;
};

// Forks and execs argv with the given stdio and the branch's policy; `tty` makes fd 0 the
// controlling terminal. An error when no process was made.
base::Result<Spawned> spawn(const std::vector<std::string>& argv_in, const std::vector<std::string>& env_in,
                            const std::string& cwd, int in, int out, int err_fd, bool tty, bool channel,
                            const PreparedPolicy& policy) {
  std::vector<std::string> argv = argv_in, env = env_in;
  if (argv.empty()) return base::fail("empty argv");
  std::vector<char*> av, ev;
  for (auto& s : argv) av.push_back(s.data());
  av.push_back(nullptr);
  for (auto& s : env) ev.push_back(s.data());
  ev.push_back(nullptr);
  // PATH lookup uses the agent's PATH, not ours (we have no environment).
  std::string path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
  for (auto& s : env)
    if (s.starts_with("PATH=")) path = s.substr(5);
  std::vector<std::string> candidates;
  if (argv[0].find('/') != std::string::npos) {
    candidates.push_back(argv[0]);
  } else {
    size_t start = 0;
    while (start <= path.size()) {
      size_t c = path.find(':', start);
      std::string dir = path.substr(start, c == std::string::npos ? std::string::npos : c - start);
      candidates.push_back((dir.empty() ? "." : dir) + "/" + argv[0]);
      if (c == std::string::npos) break;
      start = c + 1;
    }
  }

  auto ep = os::make_pipe();
  pid_t pid = ::fork();
  if (pid == 0) {
    os::reset_signals_for_child();
    // The branch's agent tells the supervisor its pid (launcher.hpp, kNsAgentPid) before anything
    // can fail or exit; the fd is closed with everything from 6 on below.
    if (channel && ::fcntl(kNsAgentPid, F_GETFD) >= 0) (void)!::write(kNsAgentPid, "p", 1);
    ::setsid();
    // Sources may sit on 0..2 already: move them high first.
    int hi[3] = {::fcntl(in, F_DUPFD_CLOEXEC, 10), ::fcntl(out, F_DUPFD_CLOEXEC, 10),
                 ::fcntl(err_fd, F_DUPFD_CLOEXEC, 10)};
    ::dup2(hi[0], 0);
    ::dup2(hi[1], 1);
    ::dup2(hi[2], 2);
    if (tty) ::ioctl(0, TIOCSCTTY, 0);
    // 3 and 4: the agent channel for the branch's agent (SANDBOXER_CHANNEL_FD names them);
    // otherwise closed, since they are ns-init's own request and report pipes.
    if (channel && ::fcntl(kNsChanReq, F_GETFD) >= 0) {
      ::dup2(kNsChanReq, kAgentChanReq);
      ::dup2(kNsChanRep, kAgentChanRep);
    } else {
      ::close(kAgentChanReq);
      ::close(kAgentChanRep);
    }
    int efd = ep ? ep->write.get() : -1;
    // The exec error pipe goes to 5; everything from 6 on closes after the policy is applied.
    if (efd >= 0) efd = ::dup3(efd, 5, O_CLOEXEC) >= 0 ? 5 : -1;
    int e = 0;
    if (::chdir(cwd.c_str()) != 0) os::child_fail(efd, kStepChdir, errno);
    // The policy (policy.hpp) while its prepared fds are still open; seccomp is its last step.
    int step = 0;
    if (int perr = apply_policy(policy, &step); perr != 0) os::child_fail(efd, kStepPolicy, perr, step);
    ::close_range(6, ~0U, 0);
    // The last meaningful error wins, as execvp reports it: ENOENT only if nothing was found.
    for (auto& c : candidates) {
      ::execve(c.c_str(), av.data(), ev.data());
      if (errno != ENOENT || e == 0) e = errno;
    }
    os::child_fail(efd, kStepExec, e);
  }
  if (pid < 0) return base::sys_fail("fork", errno);
  ep->write.reset();
  Spawned s{pid, ""};
  if (auto ce = os::read_child_error(ep->read.get())) {
    // A name of any length: the report must stay under the supervisor's 64 KiB a line (a longer
    // one was dropped, and the exec answered as started and exited 127, with no reason).
    auto shown = [](const std::string& s) {
      return s.size() <= 1024 ? s : s.substr(0, 1024) + "... (" + std::to_string(s.size()) + " bytes)";
    };
    std::string what = ce->step == kStepChdir    ? "chdir " + shown(cwd)
                       : ce->step == kStepPolicy ? std::string("apply policy: ") + policy_step_name(ce->detail)
                                                 : "exec " + shown(argv[0]);
    s.failed = what + ": " + std::strerror(ce->err);
    // Where a program name was looked for: the agent starts in its working directory (/workspace
    // by default), not the caller's, and with its own PATH.
    if (ce->step == kStepExec && ce->err == ENOENT) {
      if (argv[0].find('/') == std::string::npos)
        s.failed += " (looked for on the agent's PATH, " + shown(path) + ")";
      else if (argv[0][0] != '/')
        s.failed += " (relative to the agent's working directory " + shown(cwd) + ", not the caller's)";
    }
    // A report is JSON text: a name that is not UTF-8 goes with U+FFFD (the supervisor has it whole).
    s.failed = base::utf8_lossy(s.failed);
  }
  return s;
}

void NsInit::spawn_agent(const boost::json::object& cfg) {
  auto argv = base::get_bytes_list(cfg, "argv").value_or(std::vector<std::string>{});
  base_env_ = base::get_bytes_list(cfg, "env").value_or(std::vector<std::string>{});
  std::string cwd = base::get_bytes_field(cfg, "cwd").value_or("/");
  if (auto* g = cfg.if_contains("grace_ms")) grace_ms_ = g->to_number<int64_t>();
  // Everything the policy needs is built now, once for the branch: a child only makes syscalls.
  if (auto* pol = cfg.if_contains("policy"); pol && pol->is_object()) policy_ = prepare_policy(pol->as_object());

  auto spawned = spawn(argv, base_env_, cwd, kNsAgentIn, kNsAgentOut, kNsAgentErr, false, true, policy_);
  ::close(kNsAgentIn);
  ::close(kNsAgentOut);
  ::close(kNsAgentErr);
  ::close(kNsChanReq);
  ::close(kNsChanRep);
  ::close(kNsAgentPid);
  if (!spawned) {
    report({{"ev", "spawn_failed"}, {"proc", "main"}, {"error", spawned.error().message}});
    agent_done_ = true;
    agent_status_ = 127 << 8;
    return;
  }
  agent_ = spawned->pid;
  if (!spawned->failed.empty()) {
    report({{"ev", "spawn_failed"}, {"proc", "main"}, {"error", spawned->failed}});
    return;  // its exit (127) is collected by reap() like any other
  }
  boost::json::object started{{"ev", "started"}, {"proc", "main"}, {"pid", spawned->pid}};
  if (!cgroup_ns_error_.empty()) started["cgroup_ns_error"] = cgroup_ns_error_;
  report(started);
}

// An exec request: stdio pipes (or a pty) made here, inside the branch's root, and the process
// forked here, so it belongs to the branch's tree. Our ends of the pipes (or the pty's master) go
// to the supervisor with the report, named in its "passed" in their order, and we close ours.
void NsInit::exec_proc(const boost::json::object& req) {
  std::string id(req.at("proc").as_string());
  auto argv = base::get_bytes_list(req, "argv").value_or(std::vector<std::string>{});
  std::vector<std::string> env = base_env_;
  for (auto& kv : base::get_bytes_list(req, "env").value_or(std::vector<std::string>{})) {
    std::string key = kv.substr(0, kv.find('='));
    std::erase_if(env, [&](const std::string& x) { return x.compare(0, key.size() + 1, key + "=") == 0; });
    env.push_back(kv);
  }
  std::string cwd = base::get_bytes_field(req, "cwd").value_or("/");
  bool tty = req.contains("tty") && req.at("tty").as_bool();
  bool want_stdin = req.contains("stdin") && req.at("stdin").as_bool();
  auto fail = [&](const std::string& e) { report({{"ev", "spawn_failed"}, {"proc", id}, {"error", e}}); };

  std::vector<os::UniqueFd> keep;  // our ends, for the supervisor
  boost::json::array passed;       // their names, in the same order
  os::UniqueFd child_in, child_out, child_err;
  if (tty) {
    os::UniqueFd master(::open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC));
    if (!master) return fail(std::string("open /dev/ptmx: ") + std::strerror(errno));
    int unlock = 0;
    ::ioctl(master.get(), TIOCSPTLCK, &unlock);
    struct winsize ws {};
    ws.ws_col = static_cast<unsigned short>(req.contains("cols") ? req.at("cols").to_number<int64_t>() : 80);
    ws.ws_row = static_cast<unsigned short>(req.contains("rows") ? req.at("rows").to_number<int64_t>() : 24);
    ::ioctl(master.get(), TIOCSWINSZ, &ws);
    os::UniqueFd slave(::ioctl(master.get(), TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC));
    if (!slave) return fail(std::string("open the pty's peer: ") + std::strerror(errno));
    child_in.reset(::fcntl(slave.get(), F_DUPFD_CLOEXEC, 3));
    child_out.reset(::fcntl(slave.get(), F_DUPFD_CLOEXEC, 3));
    child_err = std::move(slave);
    passed.emplace_back("pty");
    keep.push_back(std::move(master));
  } else {
    auto o = os::make_pipe(), e = os::make_pipe();
    if (!o || !e) return fail(std::string("pipe: ") + std::strerror(errno));
    if (want_stdin) {
      auto i = os::make_pipe();
      if (!i) return fail(std::string("pipe: ") + std::strerror(errno));
      child_in = std::move(i->read);
      passed.emplace_back("in");
      keep.push_back(std::move(i->write));
    } else {
      child_in.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    }
    child_out = std::move(o->write);
    child_err = std::move(e->write);
    passed.emplace_back("out");
    passed.emplace_back("err");
    keep.push_back(std::move(o->read));
    keep.push_back(std::move(e->read));
  }
  auto spawned = spawn(argv, env, cwd, child_in.get(), child_out.get(), child_err.get(), tty, false, policy_);
  if (!spawned) return fail(spawned.error().message);
  execs_[spawned->pid] = id;
  boost::json::object r{{"ev", "started"}, {"proc", id}, {"pid", spawned->pid}, {"passed", passed}};
  if (!spawned->failed.empty()) {
    r["ev"] = "spawn_failed";
    r["error"] = spawned->failed;
  }
  std::vector<int> raw;
  for (auto& f : keep) raw.push_back(f.get());
  report(r, raw);
}

bool NsInit::reap() {
  // The one waitpid of ns-init: every status it collects is looked at here, so an exec'd
  // process's exit is never taken by another caller and lost.
  bool agent_ended = false, none_left = false;
  for (;;) {
    int st;
    pid_t p = ::waitpid(-1, &st, WNOHANG | __WALL);
    if (p < 0 && errno == EINTR) continue;
    if (p <= 0) {
      none_left = p < 0 && errno == ECHILD;
      break;
    }
    if (auto it = execs_.find(p); it != execs_.end()) {
      report({{"ev", "exited"}, {"proc", it->second}, {"status", st}});
      execs_.erase(it);
      continue;
    }
    if (p == agent_ && !agent_done_) {
      agent_done_ = true;
      agent_status_ = st;
      agent_ended = true;
    }
  }
  // What is left of the tree gets TERM and the grace period, then KILL. With no child left there
  // is no tree: every descendant of ours has an ancestor among our children (orphans reparent to
  // us, PID 1 of the namespace or the subreaper, before their parent's exit is seen), so nothing
  // is signalled, and in flat mode /proc is not walked for nothing.
  if (agent_ended && !none_left) begin_shutdown(grace_ms_);
  return none_left;
}

void NsInit::on_signal(int sig) {
  if (sig == SIGCHLD) {
    (void)reap();
    return;
  }
  if (agent_ > 0 && !agent_done_) ::kill(-agent_, sig);
}

void NsInit::on_request(const boost::json::object& req) {
  auto op = req.if_contains("op");
  if (!op || !op->is_string()) return;
  if (*op == "signal") {
    int sig = static_cast<int>(req.at("sig").to_number<int64_t>());
    // "main" (or no proc) is this branch's agent, whatever the supervisor calls it; anything
    // else is an exec'd process of this branch. One that is not (or no longer) here is reported,
    // never dropped in silence.
    auto* proc = req.if_contains("proc");
    std::string id = proc && proc->is_string() ? std::string(proc->as_string()) : "main";
    bool found = false;
    if (id == "main") {
      found = agent_ > 0 && !agent_done_;
      if (found) ::kill(-agent_, sig);
    } else {
      for (auto& [pid, pid_id] : execs_)
        if (pid_id == id) {
          found = true;
          ::kill(-pid, sig);
        }
    }
    if (!found)
      report(
          {{"ev", "signal_failed"}, {"proc", id}, {"sig", sig}, {"error", "no such running process in this branch"}});
  } else if (*op == "exec") {
    exec_proc(req);
  } else if (*op == "shutdown") {
    int64_t g = req.contains("grace_ms") ? req.at("grace_ms").to_number<int64_t>() : grace_ms_;
    begin_shutdown(g);
  } else if (*op == "kill") {
    deadline_ = now_ms();
  }
}

void NsInit::handle_pending() {
  size_t nl;
  while ((nl = pending_.find('\n')) != std::string::npos) {
    boost::system::error_code ec;
    auto req = boost::json::parse(std::string_view(pending_).substr(0, nl), ec);
    pending_.erase(0, nl + 1);
    if (!ec && req.is_object()) {
      try {
        on_request(req.as_object());
      } catch (const std::exception&) {
        // A malformed request changes nothing.
      }
    }
  }
}

int NsInit::run() {
  // Our own stdio: nothing the supervisor holds, opened inside our root.
  int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (devnull >= 0) {
    for (int fd = 0; fd < 3; ++fd) ::dup2(devnull, fd);
    if (devnull > 2) ::close(devnull);
  }
  // If the supervisor dies while our tree is stopped for a checkpoint, nobody would ever continue
  // it: SIGCONT on its death wakes ns-init, which then sees its requests pipe closed and ends the
  // branch (TERM and CONT to everything, the grace period, KILL). A running ns-init ignores it.
  (void)::prctl(PR_SET_PDEATHSIG, SIGCONT);
  if (flat_ && ::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    report({{"ev", "spawn_failed"}, {"error", std::string("PR_SET_CHILD_SUBREAPER: ") + std::strerror(errno)}});
    return 127;
  }
  os::block_handled_signals();
  sigset_t set = os::handled_signals();
  int sfd = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);

  boost::system::error_code ec;
  auto cfg = boost::json::parse(read_line_blocking(kNsCtlIn, pending_), ec);
  if (ec || !cfg.is_object() || !cfg.as_object().contains("argv")) {
    report({{"ev", "spawn_failed"}, {"error", "ns-init: bad config from the supervisor"}});
    return 127;
  }
  // A cgroup namespace of the branch's own, rooted at the groups we are in by now (the supervisor
  // sends the config once we have joined them): the agent's /proc/self/cgroup names them "/", as
  // its /sys/fs/cgroup shows them, and no path of the host's (its container's id, other groups).
  // Where it cannot be had the agent sees those paths, as before; the started report says why.
  if (!flat_ && ::unshare(CLONE_NEWCGROUP) != 0)
    cgroup_ns_error_ = std::string("unshare(CLONE_NEWCGROUP): ") + std::strerror(errno);
  // Not dumpable from here on: an agent holding every capability we hold (flat mode, under a
  // supervisor with few) cannot ptrace us, nor open our /proc/PID/mem, fd/ or environ, to act
  // outside its own policy. The supervisor has what it opens of ours (the network namespace)
  // before it sends the config; exec'd processes' fds come with the reports. The processes we
  // fork are dumpable again at their exec, as any program is.
  (void)::prctl(PR_SET_DUMPABLE, 0);
  try {
    spawn_agent(cfg.as_object());
  } catch (const std::exception& e) {
    report({{"ev", "spawn_failed"}, {"error", std::string("ns-init: ") + e.what()}});
    return 127;
  }
  (void)os::set_nonblocking(kNsCtlIn);
  bool ctl_open = true;
  // Requests that arrived with the config were read with it: the pipe will not wake us for them.
  handle_pending();

  for (;;) {
    // Done when the agent has ended and no child is left.
    if (reap() && agent_done_) break;
    int64_t timeout = -1;
    if (deadline_ >= 0) {
      timeout = deadline_ - now_ms();
      if (timeout <= 0) {
        if (!killed_) {
          killed_ = true;
          // Escalation counts only if something was still there to kill.
          escalated_ = !agent_done_ || !os::children_of(::getpid()).empty();
        }
        // Again on every round: a process forked while the last KILL went out (a fork storm)
        // is caught by the next.
        signal_tree(SIGKILL);
        timeout = 100;
      }
    }
    struct pollfd pfd[2] = {{sfd, POLLIN, 0}, {ctl_open ? kNsCtlIn : -1, POLLIN, 0}};
    int n = ::poll(pfd, 2, static_cast<int>(timeout));
    if (n < 0 && errno != EINTR) break;
    if (pfd[0].revents & POLLIN) {
      struct signalfd_siginfo si[8];
      ssize_t r = ::read(sfd, si, sizeof si);
      for (ssize_t i = 0; i < r / static_cast<ssize_t>(sizeof si[0]); ++i)
        if (si[i].ssi_signo != SIGPIPE) on_signal(static_cast<int>(si[i].ssi_signo));
    }
    if (pfd[1].revents & (POLLIN | POLLHUP)) {
      char buf[4096];
      ssize_t r = ::read(kNsCtlIn, buf, sizeof buf);
      if (r == 0) {
        // The supervisor is gone: nobody can be told anything; end the branch.
        ctl_open = false;
        begin_shutdown(grace_ms_);
      } else if (r > 0) {
        pending_.append(buf, static_cast<size_t>(r));
        handle_pending();
      }
    }
  }
  report({{"ev", "exited"}, {"proc", "main"}, {"status", agent_status_}, {"escalated", escalated_}});
  if (WIFSIGNALED(agent_status_)) return 128 + WTERMSIG(agent_status_);
  return WEXITSTATUS(agent_status_);
}

}  // namespace

boost::json::object ns_init_config(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                                   const std::string& cwd, const profile::Profile& profile, int landlock_abi,
                                   bool namespaced, const std::vector<struct sock_filter>& seccomp) {
  boost::json::object cfg{
      {"grace_ms", profile.resources.grace_ms},
      {"policy", policy_to_json(profile, landlock_abi, shares_host_network(profile, namespaced), seccomp)}};
  base::put_bytes_list(cfg, "argv", argv);
  base::put_bytes_list(cfg, "env", env);
  base::put_bytes_field(cfg, "cwd", cwd);
  return cfg;
}

int ns_init_main(bool flat) {
  NsInit n(flat);
  return n.run();
}

}  // namespace sbx::sandbox
