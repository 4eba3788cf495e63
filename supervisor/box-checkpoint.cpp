// The box as the checkpointer's host (checkpoint/host.hpp): what checkpoint, restore and fork
// read of the box and ask of it. The checkpointer reaches the box only through these.
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include "sandbox/ns-init.hpp"
#include "supervisor/box.hpp"

namespace sbx::supervisor {

namespace {

// A copy being restored: the box's branch of it, not in the box until adopt_copy.
class BranchCopy final : public checkpoint::Copy {
 public:
  explicit BranchCopy(std::unique_ptr<Branch> b) : branch(std::move(b)) {}
  sandbox::LaunchedBranch& launched() override { return branch->launched; }
  std::unique_ptr<Branch> branch;
};

// Every Copy the checkpointer hands back is one the box made (new_copy).
Branch& branch_of(checkpoint::Copy& copy) { return *static_cast<BranchCopy&>(copy).branch; }

checkpoint::BranchView view_of(const Branch& b, const std::map<std::string, std::unique_ptr<Proc>>& procs) {
  checkpoint::BranchView v;
  v.name = b.name;
  v.main_proc = b.main_proc;
  v.lineage = b.lineage;
  v.ended = b.ns_init_reaped;
  auto p = procs.find(Box::proc_key(b.name, b.main_proc));
  v.running = !b.ns_init_reaped && p != procs.end() && !p->second->status_known;
  v.busy = b.busy;
  v.starting = b.starting;
  v.namespaced = b.launched.namespaced;
  v.why_not = b.launched.why_not;
  v.landlocked = b.landlocked;
  v.ns_init_pid = b.launched.pid;
  v.pidfd = b.pidfd ? b.pidfd.get() : -1;
  v.pipe_inodes = b.launched.pipe_inodes;
  for (auto& [name, dir] : Box::cgroup_view(b)) v.cgroup_view.push_back(name);
  struct stat ns {};
  if (b.launched.netns && ::fstat(b.launched.netns.get(), &ns) == 0) v.netns_inode = ns.st_ino;
  v.argv = b.argv;
  v.cwd = b.cwd;
  v.channel_request = b.chan_inflight;
  return v;
}

}  // namespace

checkpoint::Settings Box::checkpoint_settings() const {
  checkpoint::Settings s;
  s.box_id = id_;
  s.state_dir = opts_.state_dir;
  s.profile_name = opts_.profile.name;
  s.profile_doc = opts_.profile.document;
  s.max_snapshots = opts_.profile.resources.snapshots;
  s.max_copies = opts_.profile.resources.copies;
  s.landlock = opts_.profile.isolation.landlock.has_value();
  s.restore_index = opts_.restore_index;
  s.ksm = opts_.profile.resources.ksm;
  s.probe_timeout_ms = opts_.profile.checkpoint.probe_timeout_ms;
  s.disk_bytes = opts_.profile.resources.disk > 0 ? static_cast<uint64_t>(opts_.profile.resources.disk) : 0;
  s.keys = opts_.keys;
  s.allow_unsigned = opts_.allow_unsigned;
  s.max_archive_bytes = opts_.max_archive_bytes;
  return s;
}

uint64_t Box::last_seq() const { return journal_->last_seq(); }

uint64_t Box::journal_room() const {
  // Without a cap the journal grows as the agent writes: a floor of 16 MiB is kept for it (and a
  // full disk after that is journal.degraded's, not lost events).
  constexpr uint64_t kUncappedRoom = 16u << 20;
  uint64_t cap = journal_->options().disk_cap;
  if (!cap) return kUncappedRoom;
  uint64_t used = journal_->disk_bytes();
  return used < cap ? cap - used : 0;
}

void Box::continue_journal_after(uint64_t seq) { journal_->skip_to(seq); }

void Box::end_box(int status) {
  exit_status_ = status;
  finish(status, "failed");
}

std::optional<checkpoint::BranchView> Box::find_branch(const std::string& name) const {
  auto it = branches_.find(name);
  if (it == branches_.end()) return std::nullopt;
  return view_of(*it->second, procs_);
}

std::vector<checkpoint::BranchView> Box::branches() const {
  std::vector<checkpoint::BranchView> out;
  for (auto& [name, b] : branches_) out.push_back(view_of(*b, procs_));
  return out;
}

void Box::set_busy(const std::string& branch, bool busy) {
  auto it = branches_.find(branch);
  if (it == branches_.end() || it->second->busy == busy) return;
  Branch& b = *it->second;
  b.busy = busy;
  // Stopped by its checkpoint (the dump, or a hold until release): its clocks stand still.
  if (b.limits) busy ? b.limits->pause() : b.limits->resume();
}

void Box::ended_by_checkpoint(const std::string& branch) {
  if (auto it = branches_.find(branch); it != branches_.end()) it->second->ended_by = "checkpoint";
}

void Box::watch_child(pid_t pid, std::function<void(pid_t, int)> on_exit) { reaper_.watch(pid, std::move(on_exit)); }

void Box::channel_reply(const std::string& branch, const boost::json::object& msg) {
  if (auto it = branches_.find(branch); it != branches_.end()) channel_reply(*it->second, msg);
}

std::unique_ptr<checkpoint::Copy> Box::new_copy(const checkpoint::CopySpec& spec) {
  auto b = std::make_unique<Branch>();
  b->name = spec.name;
  b->main_proc = spec.main_proc;
  b->lineage = spec.lineage;
  b->argv = spec.argv;
  b->cwd = spec.cwd;
  // A copy gets exactly its parent's policy: Landlock (a cold copy's agent gets it again; a live
  // one is refused where the profile asks for it).
  b->landlocked = opts_.profile.isolation.landlock.has_value();
  return std::make_unique<BranchCopy>(std::move(b));
}

base::Result<void> Box::mount_copy_workspace(checkpoint::Copy& copy, const std::string& dir) {
  if (auto ws = mount_workspace(branch_of(copy), dir); !ws) return base::fail("not enforced: " + ws.error().message);
  return {};
}

std::vector<os::UniqueFd> Box::copy_cgroup(checkpoint::Copy& copy) { return prepare_copy_cgroup(branch_of(copy)); }

std::vector<std::pair<std::string, std::string>> Box::copy_cgroup_view(checkpoint::Copy& copy) {
  return cgroup_view(branch_of(copy));
}

base::Result<sandbox::BranchSpec> Box::cold_copy_spec(checkpoint::Copy& copy) {
  sandbox::BranchSpec spec = branch_spec(branch_of(copy).name);
  spec.cgroup_self_join = cgroup_host().version == "v1";  // as copy_cgroup's group will be
  if (auto e = prepare_copy_network(spec); !e) return e.error();
  return spec;
}

base::Result<void> Box::start_cold_agent(checkpoint::Copy& copy, const std::vector<std::string>& extra_env) {
  Branch& b = branch_of(copy);
  std::string dir = opts_.state_dir + "/branches/" + b.name;  // not yet in branches_ (branch_dir)
  std::string cwd = b.launched.namespaced ? b.cwd : dir + "/workspace";
  auto env = agent_env(b, dir);
  for (auto& kv : extra_env) env.emplace_back(kv);
  if (auto e = attach_copy_network(b, &env); !e) return e;
  const std::vector<struct sock_filter>* seccomp = nullptr;
  try {
    seccomp = &seccomp_program();  // built here for a box that started idle or from a restore
  } catch (const std::exception& e) {
    return base::fail(std::string("build the seccomp program: ") + e.what());
  }
  send_request(b, sandbox::ns_init_config(b.argv, std::move(env), cwd, opts_.profile, caps_.landlock_abi,
                                          b.launched.namespaced, *seccomp));
  b.launched.in.reset();
  return {};
}

base::Result<void> Box::attach_live_network(checkpoint::Copy& copy) { return attach_copy_network(branch_of(copy)); }

void Box::adopt_copy(std::unique_ptr<checkpoint::Copy> copy, bool running) {
  Branch& added = add_branch(std::move(static_cast<BranchCopy&>(*copy).branch), running);
  start_watcher(added);
}

void Box::set_snapshot_of(const std::string& branch, const std::string& snapshot) {
  auto it = branches_.find(branch);
  if (it == branches_.end()) return;
  Branch& b = *it->second;
  b.lineage.snapshot = snapshot;
  checkpoint::write_branch_json(id_, b.name, b.lineage, opts_.state_dir + "/branches/" + b.name);
}

}  // namespace sbx::supervisor
