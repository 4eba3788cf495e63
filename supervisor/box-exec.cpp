// The protocol's operations on processes: exec (forked by the branch's ns-init), stdin, signal,
// resize, and the reports ns-init sends about exec'd processes.
#include <dirent.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "base/encoding.hpp"
#include "os/sys.hpp"
#include "supervisor/box.hpp"
#include "supervisor/proc-io.hpp"

namespace sbx::supervisor {

Proc::~Proc() = default;

std::string Box::branch_dir(const std::string& branch) const {
  if (!branches_.contains(branch)) return {};
  return opts_.state_dir + "/branches/" + branch;
}

pid_t Box::ns_init_pid(const std::string& branch) const {
  auto it = branches_.find(branch);
  return it == branches_.end() || it->second->ns_init_reaped ? -1 : it->second->launched.pid;
}

std::string Box::branch_tmp(const std::string& branch) const {
  auto it = branches_.find(branch);
  if (it == branches_.end()) return {};
  const Branch& b = *it->second;
  // Without namespaces the agent's /tmp is this process's own, ended or not ("not contained").
  if (b.launched.pid > 0 && !b.launched.namespaced) return "/tmp";
  if (b.launched.namespaced && !b.ns_init_reaped && b.launched.pid > 0)
    return "/proc/" + std::to_string(b.launched.pid) + "/root/tmp";
  std::string dir = branch_dir(branch);
  bool upper_holds = false;
  if (DIR* d = ::opendir((dir + "/tmp-upper").c_str())) {
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
        upper_holds = true;
        break;
      }
    ::closedir(d);
  }
  return dir + (upper_holds ? "/tmp-upper" : "/tmp");
}

boost::json::object Box::proc_state(const Proc& p) const {
  boost::json::object o{{"proc", p.id}, {"branch", p.branch}};
  if (p.exited_sent || p.status_known) {
    o["state"] = "exited";
    if (WIFSIGNALED(p.status))
      o["signal"] = os::signal_name(WTERMSIG(p.status));
    else
      o["code"] = WEXITSTATUS(p.status);
  } else {
    o["state"] = p.started || p.id == "main" ? "running" : "starting";
  }
  if (p.pid > 0) o["pid"] = p.pid;
  if (p.ns_pid > 0) o["ns_pid"] = p.ns_pid;
  if (p.started_seq) o["started_seq"] = p.started_seq;
  if (!p.error.empty()) o["error"] = p.error;
  o["tty"] = p.tty;
  return o;
}

void Box::exec(const ExecSpec& spec, std::function<void(std::optional<OpError>, boost::json::object)> done) {
  // "main" and "main@BRANCH" name a branch's agent (ns-init reports it as "main"): an exec by
  // that name is the agent itself (the idempotent answer below), never a new process.
  std::string id = spec.proc;
  bool agent = id == "main" || id.starts_with("main@");
  if (agent) {
    auto bit = branches_.find(spec.branch);
    if (bit != branches_.end() && id != "main" && id != bit->second->main_proc) bit = branches_.end();
    if (bit == branches_.end())
      return done(OpError{"bad_request", "proc id " + id + " is reserved: main and main@BRANCH name a branch's agent"},
                  {});
    id = bit->second->main_proc;
  }
  if (auto it = procs_.find(proc_key(spec.branch, id)); it != procs_.end()) {
    // Idempotent: the same id names the same process, whatever else the request says.
    Proc& p = *it->second;
    auto reply = [this, &p, done] {
      auto st = proc_state(p);
      st["existing"] = true;
      done(std::nullopt, std::move(st));
    };
    if (!p.started && !p.status_known && !agent)
      p.on_started.push_back(reply);
    else
      reply();
    return;
  }
  auto bit = branches_.find(spec.branch);
  if (bit == branches_.end()) return done(OpError{"no_such_branch", "no branch named " + spec.branch}, {});
  Branch& b = *bit->second;
  if (b.ns_init_reaped || shutting_down_ || finished_)
    return done(OpError{"box_stopping", "branch " + spec.branch + " is shutting down"}, {});

  auto p = std::make_unique<Proc>();
  p->id = spec.proc;
  p->branch = spec.branch;
  p->argv = spec.argv;
  p->tty = spec.tty;
  p->io = std::make_unique<ProcIo>(loop_);
  Proc& pr = *p;
  procs_.emplace(proc_key(p->branch, p->id), std::move(p));
  pr.on_started.push_back([this, &pr, done] {
    if (!pr.error.empty() && !pr.started) return done(OpError{"spawn_failed", pr.error}, proc_state(pr));
    done(std::nullopt, proc_state(pr));
  });

  boost::json::object req{{"op", "exec"},      {"proc", spec.proc}, {"tty", spec.tty}, {"stdin", spec.stdin_open},
                          {"cols", spec.cols}, {"rows", spec.rows}};
  // Each as its bytes where they are not UTF-8 (an ns-init restored from an older snapshot reads
  // only the text, and fails to find a program whose name it has with U+FFFD).
  base::put_bytes_list(req, "argv", spec.argv);
  base::put_bytes_list(req, "env", spec.env);
  base::put_bytes_field(req, "cwd", spec.cwd.empty() ? agent_cwd_ : spec.cwd);
  send_request(b, req);
}

void Box::on_exec_report(Branch& b, Proc& p, const boost::json::object& r, std::vector<os::UniqueFd> passed) {
  auto ev = r.at("ev").as_string();
  if (ev == "started" || ev == "spawn_failed") {
    if (ev == "spawn_failed")
      p.error = r.contains("error") ? std::string(r.at("error").as_string()) : "could not start";
    if (auto* pid = r.if_contains("pid")) {
      p.ns_pid = static_cast<pid_t>(pid->to_number<int64_t>());
      p.pid = p.ns_pid;
      if (b.launched.namespaced) {
        // The host pid: the child of ns-init whose innermost pid is ns_pid.
        p.pid = -1;
        for (pid_t c : os::children_of(b.launched.pid)) {
          auto st = os::read_file("/proc/" + std::to_string(c) + "/status");
          if (!st) continue;
          auto pos = st->find("NSpid:");
          if (pos == std::string::npos) continue;
          auto eol = st->find('\n', pos);
          std::string line = st->substr(pos, eol - pos);
          auto last = line.find_last_of(" \t");
          if (last != std::string::npos && std::atoi(line.c_str() + last + 1) == p.ns_pid) p.pid = c;
        }
      }
    }
    if (!p.io) p.io = std::make_unique<ProcIo>(loop_);
    auto emit_to = [this, &p](boost::json::object e) {
      e["proc"] = p.id;
      emit(p.branch, std::move(e));
    };
    auto on_eof = [this, &p] { maybe_proc_exited(p); };
    // The process's pipe ends (or its pty's master) came with the report, named in "passed" in
    // their order (ns-init.cpp, exec_proc).
    std::map<std::string, os::UniqueFd, std::less<>> got;
    if (const auto* names = r.if_contains("passed"); names && names->is_array())
      for (size_t i = 0; i < names->as_array().size() && i < passed.size(); ++i)
        if (names->as_array()[i].is_string()) got[std::string(names->as_array()[i].as_string())] = std::move(passed[i]);
    // An ns-init that names its fds by number ("fds") and passes none is one from before the
    // reports socket, restored from an older snapshot: it holds them until told "release".
    bool legacy = r.contains("fds") && !r.contains("passed");
    std::string missing;
    for (const char* k : p.tty ? std::vector<const char*>{"pty"} : std::vector<const char*>{"out", "err"})
      if (!got.contains(k)) missing += std::string(missing.empty() ? "" : ", ") + k;
    if (ev == "started" && (legacy || !missing.empty())) {
      // Its output and input out of our reach, nothing it prints or reads would reach anyone: a
      // failed start, whose process ends.
      p.error = legacy ? "the ns-init of branch " + b.name +
                             " was restored from a snapshot of an older sandboxer and does not pass a process's "
                             "pipes; exec in a branch started by this version"
                       : "ns-init's report of " + p.id + " came without its " + missing + " (the log says why)";
      send_request(b, {{"op", "signal"}, {"proc", p.id}, {"sig", SIGKILL}});
    } else if (ev == "started") {
      p.started = true;
      boost::json::object e{{"type", "proc.started"}, {"proc", p.id}, {"pid", p.pid}};
      if (b.launched.namespaced) e["ns_pid"] = p.ns_pid;
      base::put_bytes_list(e, "argv", p.argv);
      if (p.tty) e["tty"] = true;
      p.started_seq = emit(p.branch, std::move(e));
    }
    if (auto& master = got["pty"]; p.tty && master) {
      os::UniqueFd rd(::fcntl(master.get(), F_DUPFD_CLOEXEC, 3));
      p.io->pty = master.get();
      p.io->input = std::make_unique<InputWriter>(loop_, std::move(master));
      p.out = std::make_unique<OutputReader>(loop_, std::move(rd), OutputDecoder("pty", false, emit_to), on_eof);
    } else if (!p.tty) {
      if (auto& in = got["in"]) p.io->input = std::make_unique<InputWriter>(loop_, std::move(in));
      if (auto& out = got["out"])
        p.out = std::make_unique<OutputReader>(loop_, std::move(out), OutputDecoder("stdout", true, emit_to), on_eof);
      if (auto& err = got["err"])
        p.err = std::make_unique<OutputReader>(loop_, std::move(err), OutputDecoder("stderr", false, emit_to), on_eof);
    }
    if (b.output_paused) pause_readers(p, true);  // the journal waits and the branch was not frozen
    if (legacy) send_request(b, {{"op", "release"}, {"proc", p.id}});
    if (p.io->input) {
      if (!p.io->early_input.empty()) (void)p.io->input->write(std::exchange(p.io->early_input, {}));
      if (p.io->early_eof) {
        if (p.tty)
          (void)p.io->input->write("\x04");
        else
          p.io->input->eof();
      }
    }
    if (ev == "started" || !p.error.empty()) {
      // Wake the waiting exec replies (spawn_failed is followed by an exit, handled below).
      for (auto& w : std::exchange(p.on_started, {})) w();
    }
  } else if (ev == "exited") {
    p.status = static_cast<int>(r.at("status").to_number<int64_t>());
    p.status_known = true;
    if (p.io) {
      // A process that left children holding its output: stop waiting after a moment.
      p.io->after(2000, [&p] {
        if (p.out) p.out->close();
        if (p.err) p.err->close();
      });
    }
    maybe_proc_exited(p);
  }
}

void Box::end_execs_of(Branch& b) {
  // ns-init is gone and with it everything in its pid namespace: every exec'd proc has ended.
  for (auto& [key, p] : procs_) {
    if (p->branch != b.name || p->id == b.main_proc) continue;
    if (!p->status_known) {
      p->status = SIGKILL;  // a wait status: killed by KILL
      p->status_known = true;
      if (!p->started && p->error.empty()) p->error = "the branch ended before the process started";
      for (auto& w : std::exchange(p->on_started, {})) w();
    }
    if (p->out) p->out->close();
    if (p->err) p->err->close();
    maybe_proc_exited(*p);
  }
}

void Box::release_ended_exec(const Proc& p) {
  ended_unreleased_.push_back(proc_key(p.branch, p.id));
  release_later();
}

void Box::release_ended_branch(const Branch& b) {
  ended_branches_.push_back(b.name);
  release_later();
}

void Box::release_later() {
  if (!release_timer_) release_timer_ = loop::make_timer(loop_);
  release_timer_->data = this;
  uv_timer_start(
      release_timer_.get(),
      [](uv_timer_t* t) noexcept {
        auto* box = static_cast<Box*>(t->data);
        for (auto& key : std::exchange(box->ended_unreleased_, {})) {
          auto it = box->procs_.find(key);
          if (it == box->procs_.end()) continue;
          Proc& ended = *it->second;
          ended.out.reset();
          ended.err.reset();
          ended.io.reset();
          box->ended_execs_.push_back(key);
        }
        while (box->ended_execs_.size() > kEndedExecsKept) {
          auto it = box->procs_.find(box->ended_execs_.front());
          if (it != box->procs_.end() && it->second->exited_sent) box->procs_.erase(it);
          box->ended_execs_.pop_front();
        }
        for (auto& name : std::exchange(box->ended_branches_, {})) {
          auto it = box->branches_.find(name);
          if (it == box->branches_.end() || !it->second->ns_init_reaped) continue;
          Branch& b = *it->second;
          if (auto p = box->procs_.find(proc_key(b.name, b.main_proc)); p != box->procs_.end()) {
            p->second->out.reset();
            p->second->err.reset();
          }
          // The watchers before the fds they watch.
          b.reports.reset();
          b.channel.reset();
          b.requests.reset();
          b.chan_out.reset();
          b.chan_closed = true;
          b.drain_timer.reset();
          b.limits.reset();
          b.cgroup.reset();  // empty now: its rmdirs
          b.pidfd.reset();
          sandbox::LaunchedBranch& l = b.launched;
          for (auto* fd :
               {&l.requests, &l.reports, &l.in, &l.out, &l.err, &l.chan_req, &l.chan_rep, &l.agent_pid, &l.netns})
            fd->reset();
        }
      },
      0, 0);
}

Proc* Box::find_proc(const std::string& proc, const BranchName& branch, std::optional<OpError>& err) {
  if (branch) {
    if (auto it = procs_.find(proc_key(*branch, proc)); it != procs_.end()) return it->second.get();
    err = OpError{"no_such_proc", "no process named " + proc + " in branch " + *branch};
    return nullptr;
  }
  Proc* found = nullptr;
  std::string where;
  for (auto& [key, p] : procs_) {
    if (p->id != proc) continue;
    where += (where.empty() ? "" : ", ") + p->branch;
    if (found) {
      err = OpError{"ambiguous_proc", "process " + proc + " runs in branches " + where + ": say which with \"branch\""};
      continue;
    }
    found = p.get();
  }
  if (err) return nullptr;
  if (!found) err = OpError{"no_such_proc", "no process named " + proc};
  return found;
}

std::optional<OpError> Box::proc_stdin(const std::string& proc, const BranchName& branch, std::string_view data,
                                       bool eof) {
  std::optional<OpError> err;
  Proc* pp = find_proc(proc, branch, err);
  if (!pp) return err;
  Proc& p = *pp;
  if (p.exited_sent) return OpError{"not_running", "process " + proc + " has exited"};
  if (p.io && !p.started && !p.status_known) {
    // Not started yet: keep it for when it is.
    if (p.io->early_eof) return OpError{"stdin_closed", "the stdin of " + proc + " is closed"};
    if (p.io->early_input.size() + data.size() > InputWriter::kMaxPending)
      return OpError{"stdin_full", "the stdin buffer of " + proc + " is full"};
    p.io->early_input.append(data);
    p.io->early_eof |= eof;
    return std::nullopt;
  }
  if (!p.io || !p.io->input)
    return OpError{"no_stdin", "process " + proc + " was not started with stdin (exec with stdin: true)"};
  if (p.io->input->closed()) return OpError{"stdin_closed", "the stdin of " + proc + " is closed"};
  if (!data.empty() && !p.io->input->write(data))
    return OpError{"stdin_full", "the stdin buffer of " + proc + " is full (the process is not reading)"};
  if (eof) {
    if (p.tty)
      (void)p.io->input->write("\x04");  // the terminal's end-of-file character
    else
      p.io->input->eof();
  }
  return std::nullopt;
}

std::optional<OpError> Box::proc_signal(const std::string& proc, const BranchName& branch, int sig) {
  std::optional<OpError> err;
  Proc* pp = find_proc(proc, branch, err);
  if (!pp) return err;
  Proc& p = *pp;
  if (p.status_known) return OpError{"not_running", "process " + proc + " has exited"};
  auto bit = branches_.find(p.branch);
  if (bit == branches_.end() || bit->second->ns_init_reaped)
    return OpError{"not_running", "branch " + p.branch + " has ended"};
  // ns-init calls its branch's agent "main", whatever this box calls it ("main@f1" in a copy).
  Branch& b = *bit->second;
  send_request(b, {{"op", "signal"}, {"proc", p.id == b.main_proc ? std::string("main") : p.id}, {"sig", sig}});
  return std::nullopt;
}

std::optional<OpError> Box::proc_resize(const std::string& proc, const BranchName& branch, int cols, int rows) {
  std::optional<OpError> err;
  Proc* pp = find_proc(proc, branch, err);
  if (!pp) return err;
  Proc& p = *pp;
  if (p.exited_sent) return OpError{"not_running", "process " + proc + " has exited"};
  if (!p.io || p.io->pty < 0) return OpError{"no_tty", "process " + proc + " has no terminal"};
  struct winsize ws {};
  ws.ws_col = static_cast<unsigned short>(cols);
  ws.ws_row = static_cast<unsigned short>(rows);
  if (::ioctl(p.io->pty, TIOCSWINSZ, &ws) != 0)
    return OpError{"resize_failed", std::string("TIOCSWINSZ: ") + std::strerror(errno)};
  return std::nullopt;
}

}  // namespace sbx::supervisor
