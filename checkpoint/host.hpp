#pragma once
// What the checkpointer needs of the box it works in, and nothing more: the box (supervisor/)
// implements checkpoint::Host, and the checkpointer reaches the box only through it, so this layer
// includes nothing of the supervisor (docs/architecture.md, the layers). Everything here is called
// on the box's loop.
#include <sys/types.h>

#include <array>
#include <boost/json.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "archive/archive.hpp"
#include "base/result.hpp"
#include "os/unique-fd.hpp"
#include "sandbox/launcher.hpp"

namespace sbx::checkpoint {

/// How a branch came to run: the checkpoint layer's part of a branch, which the box keeps with
/// it (also in the branch's /run/sandboxer/branch.json, see identity()).
struct Lineage {
  std::string mode = "original";  // original, live, cold
  std::string parent;             // the branch its snapshot was taken of; "" for an original
  std::string snapshot;           // the snapshot it was restored from; "" for an original
  int index = 0;                  // which copy it is (among the copies of one restore or fork)
};

/// Who a branch is: {box, branch, parent, snapshot, index, mode}.
boost::json::object identity(const std::string& box, const std::string& branch, const Lineage& lineage);
/// Writes identity() to DIR/run/sandboxer/branch.json (the branch's /run/sandboxer/branch.json).
void write_branch_json(const std::string& box, const std::string& branch, const Lineage& lineage,
                       const std::string& dir);

/// The box's settings the checkpointer reads, fixed once the box has started.
struct Settings {
  std::string box_id;
  std::string state_dir;             // snapshots/ and branches/ below it
  std::string profile_name;          // for the manifest
  std::string profile_doc;           // the profile's JSON, overrides merged (the manifest's `profile_doc`)
  int64_t max_snapshots = 0;         // resources.snapshots: snapshots kept (checkpoints under way count)
  int64_t max_copies = 0;            // resources.copies: copies running at once
  bool landlock = false;             // the profile asks for Landlock, which criu does not restore
  int restore_index = 0;             // --restore-index: which copy a box started from an archive is
  bool ksm = true;                   // resources.ksm: live copies' anonymous memory is marked mergeable
  int64_t probe_timeout_ms = 10000;  // checkpoint.probe_timeout: criu's kernel probe, at most
  // resources.disk: a branch's workspace, and its dir (its /tmp, /run and the root's top), are each
  // a filesystem of this size (Box::mount_workspace); 0 where the profile sets no ceiling. A
  // checkpoint's copy of the layer writes no more than they can hold.
  uint64_t disk_bytes = 0;
  // Signed archives: what this box signs with and what it trusts (its own key's public half among
  // them), read at the first checkpoint, import or restore (null: it signs nothing, trusts none);
  // --allow-unsigned; the bound on one archive's expansion.
  std::shared_ptr<const archive::ArchiveKeys> keys;
  bool allow_unsigned = false;
  uint64_t max_archive_bytes = archive::kDefaultMaxArchiveBytes;
};

/// A branch as the checkpointer sees it: what it reads to stop, dump and describe its tree.
struct BranchView {
  std::string name;
  std::string main_proc;  // the id of its agent's process
  Lineage lineage;
  bool ended = false;       // its ns-init has been reaped
  bool running = false;     // its ns-init and its agent's process are both alive
  bool busy = false;        // a checkpoint of it is under way
  bool starting = false;    // its agent is not started yet: ns-init holds a socket criu refuses
  bool namespaced = false;  // its own pid and mount namespace (else why_not says why)
  std::string why_not;
  bool landlocked = false;                // its agent is confined by Landlock
  pid_t ns_init_pid = -1;                 // the root of its tree, in the supervisor's pid namespace
  int pidfd = -1;                         // borrowed: ns-init's pidfd, -1 if none
  std::array<uint64_t, 7> pipe_inodes{};  // sandbox::BranchPipes::inodes
  uint64_t netns_inode = 0;               // its own network namespace (BranchPipes::netns), or 0
  std::vector<std::string> cgroup_view;   // the names under its /sys/fs/cgroup (BranchSpec::cgroup_view)
  std::vector<std::string> argv;          // the agent's command
  std::string cwd;
  int64_t channel_request = -1;  // the id of an agent channel request being served, else -1
};

/// What a restored copy is, before it runs: the box makes a branch of it (Host::new_copy).
struct CopySpec {
  std::string name;
  std::string main_proc;
  Lineage lineage;
  std::vector<std::string> argv;  // the original agent's command and working directory
  std::string cwd;
};

/// A copy being restored: a branch of the box that is not in the box yet. Made by the box
/// (Host::new_copy) and handed back to it (Host::adopt_copy) once its tree runs; dropped before
/// that, it is undone (its cgroup goes).
class Copy {
 public:
  virtual ~Copy() = default;
  /// Its ns-init and pipes: a cold copy's from sandbox::launch_branch, a live copy's as criu
  /// restored them.
  virtual sandbox::LaunchedBranch& launched() = 0;
};

class Host {
 public:
  // ---- the box's state ----
  /// The criu version this host has (read while the box starts), or nullopt.
  virtual std::optional<std::string> criu_version() const = 0;
  virtual bool shutting_down() const = 0;

  // ---- events and the journal ----
  /// Appends an event of `branch` to the journal; returns its seq.
  virtual uint64_t emit(const std::string& branch, boost::json::object ev) = 0;
  virtual uint64_t last_seq() const = 0;
  /// The room (bytes) the state dir's filesystem keeps free for the journal: what
  /// journal.disk_cap still allows it, or a floor where it has no cap. Snapshots come after it.
  virtual uint64_t journal_room() const = 0;
  /// A box started from an archive continues its parent's numbering after `seq`.
  virtual void continue_journal_after(uint64_t seq) = 0;
  /// A box started from an archive: its box.started goes out (held until the restore is done or
  /// failed) and its server starts.
  virtual void box_started() = 0;
  /// Ends the box with `status` (a box whose start from an archive failed: 125).
  virtual void end_box(int status) = 0;
  /// A snapshot operation has ended: the box may end now if it was waiting for it.
  virtual void operation_done() = 0;

  // ---- the branches ----
  virtual bool has_branch(const std::string& name) const = 0;
  virtual std::optional<BranchView> find_branch(const std::string& name) const = 0;
  virtual std::vector<BranchView> branches() const = 0;
  /// Marks a branch as being checkpointed (no second checkpoint of it starts meanwhile).
  virtual void set_busy(const std::string& branch, bool busy) = 0;
  /// The branch's tree is about to be killed because a checkpoint ends it (leave_running false):
  /// its end says so.
  virtual void ended_by_checkpoint(const std::string& branch) = 0;
  /// Calls `on_exit(pid, wait_status)` when the child `pid` (criu) exits; the box's reaper
  /// collects it.
  virtual void watch_child(pid_t pid, std::function<void(pid_t, int)> on_exit) = 0;
  /// Replies on a branch's agent channel (a JSON line).
  virtual void channel_reply(const std::string& branch, const boost::json::object& msg) = 0;

  // ---- what a live snapshot records of the box ----
  /// Every host path masked in a branch's view, each a mount point a live copy needs.
  virtual std::vector<std::string> branch_masks() const = 0;
  /// What a live snapshot's agent expects of its network (no secret in it).
  virtual boost::json::object network_manifest() const = 0;
  /// Whether this box can give a live copy of `manifest` the network its agent expects.
  virtual base::Result<void> copy_network_possible(const boost::json::object& manifest) const = 0;

  // ---- the wiring of a restored copy ----
  virtual std::unique_ptr<Copy> new_copy(const CopySpec& spec) = 0;
  /// The copy's workspace DIR/workspace (existing), mounted with the original's disk ceiling and
  /// owner before the snapshot's files are copied into it.
  virtual base::Result<void> mount_copy_workspace(Copy& copy, const std::string& dir) = 0;
  /// The copy's own cgroup with the original's ceilings: its cgroup.procs fds, which its first
  /// process joins. Empty where there is none (the copy then runs without).
  virtual std::vector<os::UniqueFd> copy_cgroup(Copy& copy) = 0;
  /// The copy's groups (made by copy_cgroup) as its /sys/fs/cgroup shows them
  /// (sandbox::BranchSpec::cgroup_view); empty without.
  virtual std::vector<std::pair<std::string, std::string>> copy_cgroup_view(Copy& copy) = 0;
  /// The spec a cold copy is launched from: its dir and masks, and a network namespace as the
  /// original's.
  virtual base::Result<sandbox::BranchSpec> cold_copy_spec(Copy& copy) = 0;
  /// A launched cold copy: its network attached (a broker of its own), then ns-init's config sent
  /// (sandbox::ns_init_config): the agent's command again, its environment with `extra_env`.
  virtual base::Result<void> start_cold_agent(Copy& copy, const std::vector<std::string>& extra_env) = 0;
  /// A live copy restored by criu, before it runs: its network attached (a broker of its own at
  /// the address its agent's memory holds).
  virtual base::Result<void> attach_live_network(Copy& copy) = 0;
  /// Takes the copy into the box, as a branch: watches its ns-init, its reports, its channel, its
  /// ceilings, and (`running`: a live copy, whose agent runs already) its agent's output.
  virtual void adopt_copy(std::unique_ptr<Copy> copy, bool running) = 0;
  /// A fork's copy learns the snapshot it came from once that is sealed (fork_branch): its
  /// lineage, and its /run/sandboxer/branch.json.
  virtual void set_snapshot_of(const std::string& branch, const std::string& snapshot) = 0;

 protected:
  ~Host() = default;
};

}  // namespace sbx::checkpoint
