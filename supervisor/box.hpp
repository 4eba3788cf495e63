#pragma once
// The box: one supervisor's state. Owns the journal, the reaper, the signal source and the
// branches with their processes, and decides when the box ends and with which status.
#include <linux/filter.h>
#include <uv.h>

#include <boost/json.hpp>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "archive/archive.hpp"
#include "base/result.hpp"
#include "checkpoint/checkpointer.hpp"
#include "journal/journal.hpp"
#include "loop/uv-handle.hpp"
#include "os/cgroup.hpp"
#include "profile/profile.hpp"
#include "sandbox/capabilities.hpp"
#include "sandbox/launcher.hpp"
#include "supervisor/events-output.hpp"
#include "supervisor/health.hpp"
#include "supervisor/heap.hpp"
#include "supervisor/limits.hpp"
#include "supervisor/network.hpp"
#include "supervisor/output.hpp"
#include "supervisor/proc-io.hpp"
#include "supervisor/reaper.hpp"
#include "supervisor/signals.hpp"

namespace sbx::supervisor {

struct BoxOptions {
  std::vector<std::string> argv;  // the agent's command
  std::string state_dir;          // created if missing; an existing one continues its journal
  std::string events_path;        // "" none, "-" stdout, else a file (JSON lines)
  std::string workdir = "/workspace";
  profile::Profile profile;
  std::string self_exe;
  std::vector<std::string> masks;  // extra host paths to hide from the agent
  // The agent's environment (agent-env.hpp): clean unless env_inherit; `env` is --env's K=V.
  std::vector<std::string> env;
  bool env_inherit = false;
  // The WebSocket server (server.hpp): off when `listen` is empty.
  std::string listen;  // ADDR:PORT
  std::string token;   // required with `listen`
  std::string tls_cert, tls_key;
  int64_t metrics_ms = 5000;  // cadence of `metrics` events; 0: none
  bool idle = false;          // start with no agent and wait (--idle)
  std::string restore_file;   // start from this checkpoint archive (--restore)
  int restore_index = 0;      // which copy this box is (--restore-index)
  // Signed archives (checkpoint/signing.hpp): what this box signs with, and what it trusts (its
  // own key's public half among them); --allow-unsigned; the bound on one archive's expansion.
  // Read when first needed (archive::ArchiveKeys), not at start.
  std::shared_ptr<const archive::ArchiveKeys> keys;
  bool allow_unsigned = false;
  uint64_t max_archive_bytes = archive::kDefaultMaxArchiveBytes;
  std::string health_file;  // "" none; else health.hpp's file, once the server is up
};

class ProcIo;
class Server;
struct ServerOptions;
class MetricsTimer;

/// What `exec` starts: a process forked by the branch's ns-init.
struct ExecSpec {
  std::string proc;
  std::string branch = "main";
  std::vector<std::string> argv;
  std::vector<std::string> env;  // KEY=VALUE, over the agent's environment
  std::string cwd;               // "" : the agent's working directory
  bool tty = false;
  bool stdin_open = false;
  int cols = 80, rows = 24;
};

/// An operation's refusal, as the protocol's error object says it.
struct OpError {
  std::string code;
  std::string message;
};

struct Proc {
  std::string id;
  std::string branch;
  pid_t pid = -1;     // in the supervisor's pid namespace
  pid_t ns_pid = -1;  // in the branch's pid namespace
  std::unique_ptr<OutputReader> out, err;
  bool status_known = false;
  int status = 0;
  bool escalated = false;
  std::string error;  // why it could not start
  bool exited_sent = false;
  // Exec'd procs (box-exec.cpp).
  std::vector<std::string> argv;
  bool tty = false;
  bool started = false;
  uint64_t started_seq = 0;
  std::unique_ptr<ProcIo> io;
  std::vector<std::function<void()>> on_started;  // waiting exec replies
  ~Proc();
};

/// Bytes of replies an agent may leave unread on its channel before its requests wait.
inline constexpr size_t kChanBacklog = 256u << 10;

struct Branch {
  std::string name;
  sandbox::LaunchedBranch launched;
  loop::UvHandle<uv_poll_t> reports;  // ns-init's reports, read on the loop
  // ns-init's requests, written without blocking the loop: a tree stopped for a checkpoint, or
  // frozen, reads none of them meanwhile (the write end of launched.requests, moved here).
  std::unique_ptr<InputWriter> requests;
  std::string pending;
  bool ns_init_reaped = false;
  int ns_init_status = 0;
  std::string main_proc;
  std::vector<std::string> argv;  // the agent's command
  std::string cwd;
  // Who this branch is (also in /run/sandboxer/branch.json): how it came to run.
  checkpoint::Lineage lineage;
  // The agent channel: requests read on the loop, replies written back.
  loop::UvHandle<uv_poll_t> channel;
  bool chan_closed = false;  // its end was read: not watched again
  std::string chan_pending;
  // Its replies, likewise (launched.chan_rep's write end): an agent that does not read them gets
  // no more served once kChanBacklog bytes of them wait; its requests wait in its pipe meanwhile.
  std::unique_ptr<InputWriter> chan_out;
  bool chan_backlogged = false;
  int64_t chan_inflight = -1;  // id of a channel request being served (checkpoint), else -1
  loop::UvHandle<uv_timer_t> drain_timer;
  bool landlocked = false;  // set by the policy layer; such a tree cannot be checkpointed
  bool busy = false;        // a checkpoint of it is under way
  // Launched, and its ns-init has not yet reported the agent started (or failed to start): it
  // still holds the socket the agent's pid comes through (kNsAgentPid). A restored copy: false.
  bool starting = false;
  std::string ended_by;  // "checkpoint" when a checkpoint ended it
  // Ceilings and policy (box-policy.cpp).
  std::unique_ptr<os::CgroupDir> cgroup;
  std::unique_ptr<LimitsWatcher> limits;
  // Its processes' output is not read while the journal waits for disk space and the branch
  // could not be frozen (no freezer cgroup, as in a container): their writes block instead.
  bool output_paused = false;
  std::string workspace_mount;  // a sized tmpfs we mounted, unmounted at the end
  std::string layer_mount;      // the branch's dir on a sized tmpfs (its /tmp's layers), likewise
  os::UniqueFd pidfd;           // of ns-init (the tree's root), opened while it is our unreaped child
  /// Detaches workspace_mount and layer_mount (the workspace's first), once: at the box's end,
  /// and for a branch that never ran (a main whose start failed, a copy whose restore did)
  /// before its dir is removed. The destructor does the same.
  void release_mounts();
  ~Branch() { release_mounts(); }
};

/// The box implements checkpoint::Host (box-checkpoint.cpp): all the checkpointer reaches of it.
class Box : public checkpoint::Host {
 public:
  Box(uv_loop_t* loop, BoxOptions opts);
  ~Box();
  Box(const Box&) = delete;
  Box& operator=(const Box&) = delete;

  /// Starts the box and runs the loop until it ends; returns the supervisor's exit status.
  int run();

  journal::Journal& journal() { return *journal_; }
  const std::string& id() const { return id_; }
  uv_loop_t* loop() { return loop_; }

  /// Ends the box: TERM to every branch, the grace period, then KILL.
  void shutdown(int64_t grace_ms);
  /// SIGTERM and the `shutdown` op: shutdown(), after a checkpoint of the main branch when the
  /// profile asks for one on stop (box-persist.cpp).
  void stop(int64_t grace_ms);
  /// Delivers `sig` to the main process group of `branch`.
  void signal_branch(const std::string& branch, int sig);

  /// Appends an event of `branch` to the journal.
  uint64_t emit(const std::string& branch, boost::json::object ev) override;

  // Operations of the protocol on processes (box-exec.cpp).
  /// Starts `spec` in its branch, or finds the proc of that id; `done` gets the reply's fields.
  void exec(const ExecSpec& spec, std::function<void(std::optional<OpError>, boost::json::object)> done);
  /// Process ids are per branch: `branch` names it; unset, the one process of that id in any
  /// branch (refused as ambiguous when several branches have one).
  using BranchName = std::optional<std::string>;
  std::optional<OpError> proc_stdin(const std::string& proc, const BranchName& branch, std::string_view data, bool eof);
  std::optional<OpError> proc_signal(const std::string& proc, const BranchName& branch, int sig);
  std::optional<OpError> proc_resize(const std::string& proc, const BranchName& branch, int cols, int rows);
  boost::json::object proc_state(const Proc& p) const;
  /// Every process, keyed by proc_key(branch, id).
  const std::map<std::string, std::unique_ptr<Proc>>& procs() const { return procs_; }
  static std::string proc_key(const std::string& branch, const std::string& id) { return branch + "/" + id; }
  /// The host directory of a branch (root/, workspace/, tmp/ below it); "" if no such branch.
  std::string branch_dir(const std::string& branch) const;
  bool has_branch(const std::string& branch) const override { return branches_.contains(branch); }
  /// Host pid of a branch's ns-init, or -1.
  pid_t ns_init_pid(const std::string& branch) const;
  /// The directory the file ops take as a branch's /tmp (fs-ops.hpp); "" if no such branch.
  /// While the branch runs in namespaces of its own, its /tmp is a mount of its mount namespace
  /// (the overlay on the host's /tmp with tmp-upper/ as upper layer; or a bind of tmp/ or
  /// tmp-upper/ where no overlay could be had): reached through its ns-init's root, it is the
  /// agent's very /tmp, and a write goes through that mount as the agent's own do (a file made in
  /// an overlay's upper layer beside the mount is not reliably seen through it). A branch launched
  /// without namespaces shares the host's /tmp with its agent: "/tmp", running or ended. Otherwise
  /// (ended, or not launched): tmp-upper/ where it holds anything (the files an ended overlay
  /// left), else tmp/.
  std::string branch_tmp(const std::string& branch) const;
  /// The branches running now (main and its copies), by name.
  std::vector<std::string> branch_names() const {
    std::vector<std::string> out;
    for (auto& [n, b] : branches_) out.push_back(n);
    return out;
  }
  const BoxOptions& options() const { return opts_; }
  /// The snapshot operations (the WebSocket server and the agent channel call these). `done`
  /// receives the reply body: {"ok": true, ...} or {"ok": false, "error": {code, message}}.
  using Reply = std::function<void(boost::json::object)>;
  /// `by`: the branch whose agent channel asks ("" for the operator, who reaches every snapshot).
  void checkpoint(const std::string& branch, const std::string& name, bool leave_running, Reply done,
                  const std::string& by = "");
  /// checkpoint{hold_ms}: the branch's tree stays stopped after its snapshot until
  /// checkpoint.release (migrate: ended once its copy runs elsewhere, continued if that failed).
  void checkpoint_held(const std::string& branch, const std::string& name, int64_t hold_ms, Reply done) {
    checkpointer_->checkpoint_held(branch, name, hold_ms, std::move(done));
  }
  boost::json::object checkpoint_release(const std::string& branch, bool end) {
    auto r = checkpointer_->release(branch, end, end ? "released to end" : "released to continue");
    // The main agent ended so (it goes on elsewhere): the box ends well, as a hibernated one does.
    if (end && branch == "main" && r.at("ok").as_bool()) hibernated_ = true;
    return r;
  }
  void restore(const std::string& snapshot, int n, bool fork, Reply done);
  /// A live checkpoint of `branch` and n copies of it, started before its archive is sealed
  /// (Checkpointer::fork_branch).
  void fork_branch(const std::string& branch, const std::string& name, int n, Reply done);
  /// restore{snapshot, index}: an idle box (--idle) becomes copy `index` of the snapshot, its
  /// main branch, and from then on ends with that agent, as a box started with `--restore
  /// ARCHIVE --restore-index N` does; refused (not_idle) in any other box. A failed restore
  /// leaves the box idle.
  void restore_as_copy(const std::string& snapshot, int index, Reply done, const std::string& from = "");
  boost::json::array snapshot_list();
  boost::json::object snapshot_delete(const std::string& id);
  /// snapshot.export and snapshot.import: see checkpoint::Checkpointer.
  void snapshot_archive(const std::string& id, checkpoint::Checkpointer::ArchiveReady ready,
                        const std::string& base = "", const std::string& lacks = "");
  /// snapshot.chunks and snapshot.lacks: see checkpoint::Checkpointer::chunk_page and lacks.
  void snapshot_chunks(const std::string& id, uint64_t from, Reply done);
  void snapshot_lacks(std::string hashes, Reply done);
  std::string snapshot_incoming_path() const;
  /// The bytes of the state dir's filesystem kept for the journal before any snapshot is stored.
  uint64_t journal_room_for_snapshots() const { return journal_room(); }
  void snapshot_import(const std::string& tmp, Reply done);
  /// The branch's groups as its /sys/fs/cgroup shows them (sandbox::BranchSpec::cgroup_view).
  static std::vector<std::pair<std::string, std::string>> cgroup_view(const Branch& b);

 private:
  void start();
  void open_events_output();
  void lock_state_dir();
  void note_url(const ServerOptions& so);
  void on_signal(const struct signalfd_siginfo& si);
  void on_report(Branch& b, const boost::json::object& r, std::vector<os::UniqueFd> passed = {});
  void maybe_proc_exited(Proc& p);
  /// The box's end: its last event, box.exited {code: `status`, reason}, then the loop stops once
  /// the clients have what is queued for them.
  void finish(int status, const char* reason);
  void send_request(Branch& b, const boost::json::object& req);
  void kill_leftovers();
  void on_exec_report(Branch& b, Proc& p, const boost::json::object& r, std::vector<os::UniqueFd> passed);
  void end_execs_of(Branch& b);
  /// An exec'd process has ended and said so (proc.exited): on the next loop turn its readers,
  /// input and timer are freed (not from within their own callbacks), and past the last
  /// kEndedExecsKept ended ones, the oldest is forgotten (its id free again). An agent loop that
  /// execs a command per step held ~256 KiB for each, for the box's life.
  void release_ended_exec(const Proc& p);
  /// A copy's agent has ended (ns-init reaped, proc.exited out): on the next loop turn its fds
  /// (ns-init's requests and reports, the agent channel, stdin, the network namespace), their
  /// watchers, its output readers, its limits watcher and its cgroup go. Its record, its dir and
  /// its mounts stay (its files are read after its end). A fork-and-explore box held ~10 fds and
  /// ~90 KiB for each ended copy: ~2,000 copies from the supervisor's fd limit.
  void release_ended_branch(const Branch& b);
  void release_later();
  static constexpr size_t kEndedExecsKept = 1000;
  std::vector<std::string> ended_unreleased_;  // procs_ keys
  std::vector<std::string> ended_branches_;    // branches_ keys
  std::deque<std::string> ended_execs_;        // procs_ keys, oldest first
  loop::UvHandle<uv_timer_t> release_timer_;
  void start_server();
  /// The process `proc` of `branch` (see proc_stdin), or why there is none.
  Proc* find_proc(const std::string& proc, const BranchName& branch, std::optional<OpError>& err);
  /// Takes a started (or restored, `running`) branch: watches ns-init, its reports, its
  /// channel and its main process's output.
  Branch& add_branch(std::unique_ptr<Branch> b, bool running);
  void start_readers(Branch& b, Proc& p);
  void on_branch_exit(Branch& b, int status);
  void on_channel(Branch& b, std::string_view line);
  void channel_reply(Branch& b, const boost::json::object& msg);
  void maybe_finish();
  std::vector<std::string> agent_env(const Branch& b, const std::string& dir) const;
  /// The profile's seccomp program for every branch's ns-init, built once per box or read from the
  /// user's state dir (sandbox::cached_seccomp).
  const std::vector<struct sock_filter>& seccomp_program();
  std::unique_ptr<checkpoint::Checkpointer> checkpointer_;
  boost::json::object pending_started_;  // box.started of a box from an archive, until restored
  void emit_started();

  // box-policy.cpp: cgroup, workspace, masks and the agent's policy for a branch.
  void setup_branch_policy(Branch& b, sandbox::BranchSpec& spec);
  /// Starts libuv's thread pool now where no group of the agent's own holds its pids (the main
  /// branch's enforcement_, at the end of setup_branch_policy): there the agent can take the
  /// box's last pid, and libuv aborts when it cannot start the pool at the first work queued.
  void start_thread_pool_if_pids_shared();
  /// The workspace DIR/workspace (existing) of a branch, the original or a copy: a sized tmpfs or
  /// ext4 image for the profile's disk ceiling, owned by the agent's user. Returns what enforces
  /// the ceiling ("" when none is asked for), or why the mount failed (the ceiling is then not
  /// enforced: the original's enforcement says so, a copy is refused).
  base::Result<std::string> mount_workspace(Branch& b, const std::string& dir);
  /// Once, on a state dir an earlier run used, before its first branch: what a killed supervisor
  /// left. Its branches' cgroups (their processes killed; release_stale_cgroups), then its mounts
  /// under branches/ (the branches' tmpfs, a persistent workspace's ext4 image, whose data an
  /// unmount writes back; release_stale_mounts), before this run makes them again.
  base::Result<void> release_earlier_run();
  void release_stale_cgroups();
  base::Result<void> release_stale_mounts();
  bool reused_state_ = false;  // box.json was there at start: an earlier run used the state dir
  bool earlier_run_released_ = false;
  void start_limits(Branch& b);
  /// The limits watcher of a branch (timeout, idle, OOM, pids, warnings): the original's from
  /// start_limits, a copy's from the checkpointer once it runs.
  void start_watcher(Branch& b);
  os::CgroupHost cgroup_host() const;
  /// Creates the branch's cgroup with the profile's ceilings (below the box's own); returns its
  /// cgroup.procs fds, which the branch's first process writes itself into. `state` gets what
  /// each ceiling is enforced by (for box.started).
  std::vector<os::UniqueFd> make_branch_cgroup(const os::CgroupHost& host, Branch& b, boost::json::object* state);
  /// A copy's cgroup (restore, fork): the same ceilings as the original's, its own accounting.
  /// Empty where there is no hierarchy or it cannot be made (then the copy runs without).
  std::vector<os::UniqueFd> prepare_copy_cgroup(Branch& b);
  std::string limit_reason(const Proc& p, const std::string& fallback) const;
  void note_output(const std::string& branch);
  /// The journal's back-pressure: while events wait in memory for a full disk, every branch's
  /// tree is frozen (not killed) and thawed when they are written.
  void stop_for_journal(bool stop);
  void pause_output(Branch& b, bool on);        // stop_for_journal's fallback: its procs' output unread
  void watch_channel(Branch& b, bool on);       // reads the agent channel's requests (or stops for now)
  void serve_channel(Branch& b);                // answers the requests read, while the agent reads replies
  static void pause_readers(Proc& p, bool on);  // its stdout and stderr readers
  bool stopped_for_journal_ = false;
  void teardown_policy();
  os::UniqueFd state_lock_;                            // the state dir, flock()ed (lock_state_dir) to the end
  std::vector<os::UniqueFd> cgroup_join_;              // held until the branch's clone has joined
  os::UniqueFd cgroup_dir_;                            // v2: the group's directory, for the same clone
  boost::json::object enforcement_;                    // what is enforced, for box.started
  int64_t effective_memory_ = 0, effective_pids_ = 0;  // ceilings set (after capping below the box's)

  uv_loop_t* loop_;
  BoxOptions opts_;
  std::string id_;
  sandbox::HostCapabilities caps_;
  std::string state_home_;         // the user's state dir ("": none to be had)
  sandbox::NsInitBinary ns_init_;  // what every branch's ns-init runs (choose_ns_init)
  std::optional<std::vector<struct sock_filter>> seccomp_;
  std::unique_ptr<journal::Journal> journal_;
  HeapTrimmer heap_trimmer_{loop_};  // after loop_: it is initialized from it
  Reaper reaper_;
  std::unique_ptr<SignalSource> signals_;
  std::map<std::string, std::unique_ptr<Branch>> branches_;
  std::map<std::string, std::unique_ptr<Proc>> procs_;
  bool shutting_down_ = false;
  loop::UvHandle<uv_timer_t> kill_timer_;  // backstop when a branch outlives its grace period
  bool finished_ = false;
  int exit_status_ = 0;
  std::unique_ptr<EventsOutput> events_;  // --events
  std::string agent_cwd_;
  std::unique_ptr<Server> server_;
  HealthFileId health_id_;  // the health file this box wrote (health.hpp), removed at its end
  std::unique_ptr<MetricsTimer> metrics_;
  std::unique_ptr<BranchNetwork> network_;  // the main branch's network and credential broker

  // box-network.cpp: the network of a restored or forked copy (the checkpointer's hooks).
  /// Before a cold copy's launch: its network namespace and resolv.conf, as the original's.
  base::Result<void> prepare_copy_network(sandbox::BranchSpec& spec);
  /// Before a copy runs: loopback in its namespace and, for `proxy`, a broker of its own at the
  /// same in-namespace address and port as the original's (a restored agent's memory holds that
  /// URL), with the same allowlist and credentials; `env`, if given, gets the proxy variables.
  base::Result<void> attach_copy_network(Branch& b, std::vector<std::string>* env = nullptr);
  /// What a live snapshot's agent expects of its network (for the manifest: no secret in it).
  boost::json::object network_manifest() const override;
  /// The spec every branch is launched from (the box's main, and each cold copy): its dir under
  /// the state dir, and the masks of base_masks(). Network and policy are added by the caller.
  sandbox::BranchSpec branch_spec(const std::string& name) const;
  void choose_ns_init();
  /// The host paths masked in every branch's view: the box's own (token file, ...), its state
  /// dir, and the usual credential paths (policy.hpp: credential_paths).
  std::vector<std::string> base_masks() const;
  /// base_masks() and the credentials' source files of a network profile: every mask of a
  /// branch, each a mount point a live copy needs (the manifest lists them).
  std::vector<std::string> branch_masks() const override;
  std::map<std::string, std::unique_ptr<BranchNetwork>> copy_networks_;  // by branch

  // box-persist.cpp: the profile's `checkpoint` section (periodic snapshots, on_stop, on_idle,
  // the resume at start).
  /// Whether this start resumes the main branch from its own newest snapshot (an idle box too).
  bool resumes_at_start();
  /// Resumes the newest snapshot of the main branch, if the profile persists and there is one.
  /// `ended_seq`: the journal's last event of the run that ended.
  bool try_resume(uint64_t ended_seq);
  std::vector<boost::json::object> resume_candidates() const;
  void resume_from(std::vector<boost::json::object> candidates, size_t i, boost::json::array skipped,
                   uint64_t ended_seq, int64_t ended_ms);
  void start_persistence();
  /// A checkpoint of the main branch the box takes by itself, named `trigger`, then the pruning.
  void persist_checkpoint(const std::string& trigger, bool leave_running, std::function<void(bool)> done);
  /// on_stop: true when a checkpoint of the main branch goes first (shutdown follows it).
  bool stop_with_checkpoint(int64_t grace_ms);
  /// on_idle: true when the main branch hibernates instead of being ended.
  bool hibernate();
  /// STATE/persist.json: {"own": [the box's own snapshots, oldest first], "ended_seq": N}.
  boost::json::object persist_state() const;
  boost::json::array own_snapshots() const;
  void save_own_snapshots(const boost::json::array& own);
  /// A snapshot of the box's own was taken: recorded, then the oldest pruned to checkpoint.keep.
  void keep_own_snapshot(const boost::json::value& id);
  /// The main agent ended by itself (not by a stop, a checkpoint or a crash): no later start
  /// resumes a snapshot taken before now.
  void note_agent_end();
  loop::UvHandle<uv_timer_t> persist_timer_, stop_timer_;
  bool stopping_ = false;       // an on_stop or on_idle checkpoint is under way
  bool becoming_copy_ = false;  // an idle box's restore{snapshot, index} is under way
  bool hibernated_ = false;     // it succeeded: the box exits 0

  // box-checkpoint.cpp: checkpoint::Host, what the checkpointer reaches of the box.
  checkpoint::Settings checkpoint_settings() const;
  std::optional<std::string> criu_version() const override { return caps_.criu; }
  bool shutting_down() const override { return shutting_down_; }
  uint64_t last_seq() const override;
  uint64_t journal_room() const override;
  void continue_journal_after(uint64_t seq) override;
  void box_started() override { emit_started(); }
  void end_box(int status) override;
  void operation_done() override { maybe_finish(); }
  std::optional<checkpoint::BranchView> find_branch(const std::string& name) const override;
  std::vector<checkpoint::BranchView> branches() const override;
  void set_busy(const std::string& branch, bool busy) override;
  void ended_by_checkpoint(const std::string& branch) override;
  void watch_child(pid_t pid, std::function<void(pid_t, int)> on_exit) override;
  void channel_reply(const std::string& branch, const boost::json::object& msg) override;
  base::Result<void> copy_network_possible(const boost::json::object& manifest) const override;
  std::unique_ptr<checkpoint::Copy> new_copy(const checkpoint::CopySpec& spec) override;
  base::Result<void> mount_copy_workspace(checkpoint::Copy& copy, const std::string& dir) override;
  std::vector<os::UniqueFd> copy_cgroup(checkpoint::Copy& copy) override;
  std::vector<std::pair<std::string, std::string>> copy_cgroup_view(checkpoint::Copy& copy) override;
  base::Result<sandbox::BranchSpec> cold_copy_spec(checkpoint::Copy& copy) override;
  base::Result<void> start_cold_agent(checkpoint::Copy& copy, const std::vector<std::string>& extra_env) override;
  base::Result<void> attach_live_network(checkpoint::Copy& copy) override;
  void adopt_copy(std::unique_ptr<checkpoint::Copy> copy, bool running) override;
  void set_snapshot_of(const std::string& branch, const std::string& snapshot) override;
};

/// The exit status a shell would report for a wait status: the code, or 128 + signal.
int exit_status_of(int wait_status);

}  // namespace sbx::supervisor
