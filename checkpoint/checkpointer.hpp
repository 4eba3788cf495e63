#pragma once
// Checkpoint, restore and fork of a box's branches: criu for memory and processes, a copy of
// the branch's writable layer for files, taken while the tree is stopped so both agree; one
// archive per checkpoint (archive.hpp). Owned by the box, which it reaches through
// checkpoint::Host (host.hpp); everything runs on the box's loop, with criu as a child the box's
// reaper collects and the heavy copying on libuv's thread pool.
//
// The files: checkpointer.cpp (checkpoint: stop, dump, copy the layer, write the archive),
// restore.cpp (restore and fork: a cold copy, a live copy, and their wiring into the box),
// store.cpp (the snapshot store: list, delete, the bounds and the agent channel's reach, import,
// export).
//
// Layout under the state dir:
//   snapshots/<id>.tar.zst  the archive (the id is "s-" + the first 16 hex of the sha256 of its
//                           manifest.json; of the archive file itself for format 2)
//   snapshots/<id>.chunks   or, for a snapshot kept in the chunk store, its chunk list (the id is
//                           the same: its manifest's hash, which the list carries)
//   snapshots/chunks/       the chunk store (archive/chunks.hpp)
//   snapshots/<id>.json     its index entry: the manifest plus the archive's size and hash
//   snapshots/<id>.d/       the archive extracted and verified (criu/, fs/, and manifest.json with
//                           "verified": whether a trusted key signed it), reused by forks
//   branches/<name>/        each branch's layer: root/, workspace/, tmp/, run/
#include <uv.h>

#include <atomic>
#include <boost/json.hpp>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "archive/archive.hpp"
#include "base/result.hpp"
#include "checkpoint/criu.hpp"
#include "checkpoint/host.hpp"
#include "loop/uv-handle.hpp"
#include "os/files.hpp"
#include "os/unique-fd.hpp"

namespace sbx::checkpoint {

class Checkpointer {
 public:
  using Reply = std::function<void(boost::json::object)>;

  /// `loop`: the box's, whose thread pool does the copying and compressing.
  Checkpointer(uv_loop_t* loop, Host& host, Settings settings);
  ~Checkpointer();
  /// Makes the snapshots dir, removes what a supervisor killed mid-checkpoint left there and
  /// collects unreferenced chunks: before the first request is served, not before the agent's
  /// start (a box's start calls it once its agent's config is sent).
  void open_store();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  /// Whether an operation is under way (the box does not end before it is done).
  bool busy() const noexcept { return ops_ > 0; }
  /// Whether this host can checkpoint a live tree at all (criu >= 4.2 present); the error says
  /// why not.
  base::Result<void> live_possible() const;
  /// The criu it runs: the first `criu` on PATH at its construction, if any.
  const std::optional<std::string>& criu() const { return criu_; }

  /// `by`: the branch whose agent channel asks, recorded in the snapshot's index (`origin`); ""
  /// for the operator. `chunked`: the snapshot is kept in the chunk store (shared with the box's
  /// other chunked snapshots, extracted when restored) instead of as an archive file.
  void checkpoint(const std::string& branch, const std::string& name, bool leave_running, Reply done,
                  const std::string& by = "", bool chunked = false);
  /// A checkpoint after which the tree stays stopped, neither continued nor ended, until
  /// release(): what a move to another box needs (the snapshot restored there first, then the
  /// original ended; or, if that failed, continued as if nothing happened). Not released within
  /// `hold_ms`, it is continued (`checkpoint.released` says why). The branch stays busy meanwhile.
  void checkpoint_held(const std::string& branch, const std::string& name, int64_t hold_ms, Reply done);
  /// Ends (`end`) or continues a tree checkpoint_held() left stopped; an error reply when
  /// `branch` holds none.
  boost::json::object release(const std::string& branch, bool end, const std::string& why);
  /// A live checkpoint of `branch` (left running, or ended: `leave_running`) and `n` copies of
  /// it, each a new branch: the copies restore from the dump's images (linked, not copied) as soon
  /// as the dump and the layer copy end, while the archive is compressed, hashed and signed. Until
  /// that ends their `snapshot` is null (restore.done, whoami); `fork.created` and the reply name
  /// it, with the copies and `timings_ms.running` (all copies running). A files-only checkpoint
  /// (no criu, no namespaces, no signing key) forks once it is stored, as restore() does.
  /// `by` and `chunked`: as for checkpoint().
  void fork_branch(const std::string& branch, const std::string& name, int n, bool leave_running, Reply done,
                   const std::string& by = "", bool chunked = false);
  /// Restores `snapshot` n times, each copy a new branch (fork: `fork.created` too).
  /// `name` (n = 1 only) names the copy instead of the next "fN"; `first_index` is the first
  /// copy's index (a copy in a box of its own, fork onto other boxes, says which it is).
  /// `cold_if_refused`: a live snapshot this box cannot restore live (criu, image, network,
  /// Landlock) is restored cold instead, the reason in the copy's note (the resume of a box
  /// whose profile persists its agent).
  void restore(const std::string& snapshot, int n, bool fork, Reply done, const std::string& name = "",
               int first_index = 0, bool cold_if_refused = false, const std::string& from = "");
  /// Restores `snapshot` as the box's own agent (branch main, copy `index`), its journal
  /// continuing the snapshot's: how a box started from an archive (`--restore`) or an idle box
  /// asked to become a copy (`restore{snapshot, index}`) begins.
  /// `from`: where the caller says the snapshot came from (a box's URL, an archive's path), named
  /// in restore.done as told.
  void restore_main(const std::string& snapshot, int index, Reply done, const std::string& from = "");
  boost::json::array list() const;
  /// The snapshots the agent channel of `branch` may see (channel_refusal with to_delete false).
  boost::json::array list_for(const std::string& branch, const Lineage& lineage) const;
  /// Why the agent channel of `branch` may not restore or fork (or, `to_delete`, delete) snapshot
  /// `id`: the channel reaches the snapshots its own branch took, and restores the one it came
  /// from (`lineage.snapshot`); a {"ok": false, "error": {"code": "forbidden", ...}} reply, or
  /// nullopt.
  std::optional<boost::json::object> channel_refusal(const std::string& branch, const Lineage& lineage,
                                                     const std::string& id, bool to_delete) const;
  /// A restore or fork of `n` more copies past resources.copies: the refusal (code "limit") after
  /// a `limit.hit` event on `branch`, or nullopt.
  std::optional<boost::json::object> copies_refusal(const std::string& branch, int n);
  /// The box is shutting down: a dump under way is abandoned and its tree continues at once.
  void on_shutdown();
  /// Fills criu's kerndat cache (KdatCache) `delay_ms` from now, off the agent's path, with a
  /// `criu check` of one cheap feature: the box's first dump (inside the agent's pause) and first
  /// restore then load the cache instead of probing the kernel (~50 ms of the first checkpoint's
  /// pause here). That criu is PID 1 of a pid namespace of its own (KdatCache says why). Nothing
  /// where live checkpoints are impossible, or once the cache is filled.
  void warm_up(uint64_t delay_ms);
  boost::json::object remove(const std::string& id);
  /// The archive file of snapshot `id`, for snapshot.export, or why there is none: its own file,
  /// or (`temporary` true: the caller removes it) one written from the chunk store.
  /// With `base`: a delta (archive/chunks.hpp) holding only the chunks of `id` that `base` lacks,
  /// for a box that has `base`; snapshot.import takes either.
  /// With `lacks` (one bit per chunk of `id`, as snapshot.lacks answered a receiver): a delta of
  /// the chunks whose bit is set, for that receiver.
  using ArchiveReady = std::function<void(base::Result<std::string> path, bool temporary)>;
  void export_archive(const std::string& id, ArchiveReady ready, const std::string& base = "",
                      const std::string& lacks = "");
  /// snapshot.chunks: page `from` of snapshot `id`'s chunk hashes (kChunkPage at most; a snapshot
  /// kept as an archive is cut into chunks first). Replies {"ok", "snapshot", "chunks" (all of
  /// them), "from", "count", "hashes" (base64 of count raw 32-byte hashes), "next" (the next
  /// page's from, or null)}.
  static constexpr size_t kChunkPage = 16384;
  void chunk_page(const std::string& id, uint64_t from, Reply done);
  /// snapshot.lacks: which of `hashes` (raw, 32 bytes each) this box lacks, every snapshot it
  /// keeps as an archive counted (cut into chunks first). Replies {"ok", "count", "lacking",
  /// "lacks" (base64 of one bit per hash, least significant bit first, set where it lacks it)}.
  void lacks(std::string hashes, Reply done);
  /// What the chunk store holds (chunks and their bytes).
  archive::StoreUsage chunk_usage() const;
  /// A new temporary file name in the snapshot store (same filesystem), for an incoming archive.
  std::string incoming_path() const;
  /// Takes an archive written to `tmp` (incoming_path()): checks it whole (content hash, its
  /// signature, every entry against the manifest, the format version) and files it under its id;
  /// `tmp` is gone afterwards either way. Replies {"ok", "snapshot", "existing", "bytes",
  /// "trusted", "signed_by"} or an error (code "untrusted" when no trusted key signed it);
  /// `announce`: a `snapshot.imported` event (not for a box's own start from an archive, whose
  /// journal begins with restore.done).
  /// `from`: the archive is that file, copied into `tmp` while it is extracted (--restore).
  void import_archive(const std::string& tmp, Reply done, bool announce = true, const std::string& from = {});
  /// `sandboxer-init --restore FILE`: imports the archive and restores it as branch "main".
  void start_from_archive(const std::string& path);

 private:
  struct CheckpointOp;
  struct RestoreOp;
  struct CopyJob;
  // fork_branch: a checkpoint whose copies restore from its images while its archive is sealed.
  struct ForkSeal {
    int n = 0;
    Reply done;  // the requester's, once the copies run and the archive is sealed
    double t0 = 0, t_running = 0;
    bool early = false;                         // the copies began from the images, before the seal
    std::string id;                             // the snapshot, once sealed and kept
    std::optional<boost::json::object> sealed;  // the checkpoint's reply
    std::optional<boost::json::object> forked;  // the copies' (the restore's reply)
    // The copies' lineage and their channel's first lines (identity, the fork's answer), given
    // once the seal ends.
    std::vector<std::function<void(const std::string& id)>> tell;
  };
  void fork_early(std::shared_ptr<CheckpointOp> op);
  void fork_copies(std::shared_ptr<ForkSeal> fs, const std::string& dir, boost::json::object manifest);
  void fork_sealed(std::shared_ptr<ForkSeal> fs, boost::json::object checkpoint_reply);
  void fork_finish(std::shared_ptr<ForkSeal> fs);
  void begin_restore(std::shared_ptr<RestoreOp> op);
  /// Runs `work` on the loop's thread pool, then `after` on the loop, unless this checkpointer is
  /// gone by then (the box ended while the work ran): `after` is then dropped unrun.
  void offload(std::function<void()> work, std::function<void()> after);
  void cgroup_mounts(std::shared_ptr<CopyJob> job, CriuRun& run);
  void checkpoint_failed(std::shared_ptr<CheckpointOp> op, const std::string& code, const std::string& msg);
  void start_checkpoint(const std::string& branch, const std::string& name, bool leave_running, Reply done,
                        const std::string& by, bool chunked, int64_t hold_ms, std::shared_ptr<ForkSeal> fork = nullptr,
                        int64_t waited_ms = 0);
  // Work run once after a delay, on the loop (a checkpoint waiting for its branch's agent to start).
  struct Deferred {
    loop::UvHandle<uv_timer_t> timer;
    std::function<void()> run;
  };
  std::list<Deferred> deferred_;
  void defer(uint64_t ms, std::function<void()> run);
  void hold_tree(CheckpointOp& op);
  boost::json::object manifest_of(const BranchView& b, const CheckpointOp& op) const;
  // Trees a checkpoint_held() left stopped, by branch: the pidfd they are continued or ended
  // through, and which hold it is (the deferred release that ends its hold acts on that one only).
  struct Held {
    pid_t pid = -1;
    os::UniqueFd fd;
    std::string snapshot;
    uint64_t hold = 0;
  };
  std::map<std::string, Held> held_;
  uint64_t holds_ = 0;
  /// Continues the op's tree if it is stopped (every path of a checkpoint ends here).
  void continue_op(CheckpointOp& op);
  std::optional<boost::json::object> snapshots_refusal(const std::string& branch);
  /// Why a snapshot may not be stored now (or `needed` bytes of `what` written): the state dir's
  /// filesystem has less free than that and the room kept for the journal (Host::journal_room);
  /// nullopt when it may.
  std::optional<std::string> room_refusal(uint64_t needed = 0, const std::string& what = "") const;
  /// What a copy into the state dir leaves free as it writes: the room kept for the journal (none
  /// with `journal` false: a checkpoint that ends its agent keeps its snapshot whatever it takes),
  /// read from the filesystem before each extent; and kJournalInodes of its inodes. Code no_space.
  os::CopyBound room_bound(bool journal = true) const;
  static constexpr uint64_t kJournalInodes = 1024;
  /// The room room_bound(journal) leaves now for the files, held open after their last link went,
  /// criu carries in a dump's images (their sum; criu's --ghost-limit, a file's, is this or its own
  /// 1 MiB, whichever is larger); nullopt where the state dir's free space cannot be read.
  std::optional<uint64_t> ghost_room(bool journal) const;
  static constexpr uint64_t kCriuGhostLimit = 1u << 20;
  boost::json::object limit_refusal(const std::string& branch, const char* limit, int64_t value, int64_t ceiling,
                                    const std::string& msg);
  size_t stored_snapshots() const;
  int64_t live_copies() const;
  void snapshot_layer(std::shared_ptr<CheckpointOp> op);
  /// Copies the branch's layer into the op's payload while its agent still runs, recording what
  /// it read, then calls `next`: once the tree is stopped, snapshot_layer copies only what changed
  /// (os::sync_tree). A checkpoint that leaves its agent running pauses it for that, not for a
  /// copy of the whole layer.
  void precopy(std::shared_ptr<CheckpointOp> op, std::function<void()> next);
  static boost::json::object sizes_of(const CheckpointOp& op);
  /// The dump's timings (ms) for the manifest: the pause's phases, the probe's wait, criu's own.
  static boost::json::object dump_timings(const CheckpointOp& op);
  std::string chunk_dir() const { return snap_dir_ + "/chunks"; }
  /// The chunk list of a snapshot kept in the chunk store, nullopt for one that is not, or why it
  /// cannot be read.
  std::optional<base::Result<archive::ChunkList>> chunk_list(const std::string& id) const;
  /// Deletes the chunks no snapshot's list names; deferred while a writer is adding chunks.
  void collect_chunks();
  void chunk_writer_done();
  /// Starts criu for `run` with the box's kerndat cache on its /run (KdatCache). Every criu of the
  /// box that touches a tree starts here, from a `then` of when_kdat_ready.
  base::Result<pid_t> start_criu(CriuRun run);
  /// The criu that fills the kerndat cache: `criu check` of one cheap feature, in a pid namespace
  /// of its own.
  CriuRun kdat_fill();
  /// The box's kerndat cache holds criu.kdat.
  bool kdat_cached();
  /// Runs `then` once criu may start beside the agent: at once where the kerndat cache is filled
  /// (or where criu runs unprotected, see kdat_unprotected); else once the warm-up's criu, or a
  /// probe of its own, has filled it. The loop serves on meanwhile; waiters share one probe. An
  /// error (a probe that cannot start at a pids or memory ceiling, does not end within
  /// checkpoint.probe_timeout (10 s by default), or
  /// writes no cache; the box shutting down) means no criu may start now; the next one tries
  /// again. Where the probe cannot run in a pid namespace of its own at all, criu starts
  /// unprotected, as before (logged once).
  void when_kdat_ready(std::function<void(base::Result<void>)> then);
  /// Waits on the warm-up's criu, or (`own`) on a probe started here, for at most
  /// checkpoint.probe_timeout.
  void kdat_probe(bool own);
  void kdat_probe_ended(pid_t pid, int status);
  void kdat_settled(const base::Result<void>& r);
  /// The live part of a checkpoint, once criu may start: the tree stopped, criu dump.
  void dump_live(std::shared_ptr<CheckpointOp> op);
  void kdat_unprotected(const std::string& why);
  void export_delta(const std::string& id, const std::string& base, const std::string& lacks, ArchiveReady ready);
  /// The store's archive `path` is still the operator's file (linked by --restore): replaced by a
  /// copy of its own, unless the file changed since `filed` (then the store drops it: the snapshot
  /// stays restorable from its extraction, and an export of it is refused). On the thread pool.
  void unshare_archive(const std::string& path, const struct stat& filed);
  void import_delta(const std::string& tmp, Reply done, bool announce);
  /// An import checked and filed: its index written (unless `existing`), snapshot.imported, and
  /// the reply, with `what` (bytes, existing, ...) in both.
  void imported(const std::string& id, boost::json::object index, boost::json::object what, bool announce,
                const Reply& done);
  void compress(std::shared_ptr<CheckpointOp> op);
  /// `fn`: the snapshot's manifest (with "verified"), else why not (code bad_snapshot, untrusted).
  using Extracted = std::function<void(base::Result<boost::json::object>)>;
  void with_extracted(const std::string& id, Extracted fn);
  // restore.cpp: one copy of a restore, in three parts.
  void restore_copy(std::shared_ptr<RestoreOp> op, int index);
  void start_cold_copy(std::shared_ptr<CopyJob> job);
  void start_live_copy(std::shared_ptr<CopyJob> job);
  void live_copy_restored(std::shared_ptr<CopyJob> job, int wait_status);
  // Lazy pages: a copy's `criu lazy-pages` daemon, then its restore with --lazy-pages (or
  // eagerly, when the daemon did not start), then the event that its memory is complete.
  void start_lazy_daemon(std::shared_ptr<CopyJob> job);
  void spawn_live_restore(std::shared_ptr<CopyJob> job);
  void lazy_daemon_ended(std::shared_ptr<CopyJob> job);
  /// Starts the next copies of `op`, at most as many at once as the host has cores.
  void start_more(std::shared_ptr<RestoreOp> op);
  void copy_done(std::shared_ptr<RestoreOp> op, boost::json::object result);
  void copy_failed(std::shared_ptr<CopyJob> job, std::string error);
  std::string next_branch_name();
  void op_done();

  uv_loop_t* loop_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // false once destroyed (offload)
  Host& host_;
  Settings settings_;
  std::string snap_dir_;
  std::optional<std::string> criu_;
  KdatCache kdat_;                         // criu's kerndat cache for restores (criu.hpp)
  loop::UvHandle<uv_timer_t> warm_timer_;  // warm_up's delay
  pid_t warming_ = -1;                     // its criu, until reaped
  bool kdat_warned_ = false;               // kdat_unprotected has logged
  /// when_kdat_ready's, until the probe they wait for ends or times out.
  std::vector<std::function<void(base::Result<void>)>> kdat_waiters_;
  pid_t kdat_waiting_on_ = -1;             // that probe
  bool kdat_own_ = false;                  // started by them (not the warm-up's)
  loop::UvHandle<uv_timer_t> kdat_timer_;  // its checkpoint.probe_timeout
  std::optional<std::string> image_id_;    // /etc/sandboxer/image.json's id, in an image
  // Set at the box's shutdown: a layer copy on the thread pool stops (os::CopyBound::cancel).
  std::shared_ptr<std::atomic<bool>> cancel_copies_ = std::make_shared<std::atomic<bool>>(false);
  /// The import policy: the box's trusted keys (read on the first call), --allow-unsigned, the
  /// size bound; or why a key could not be read.
  base::Result<archive::ImportPolicy> import_policy() const;
  int ops_ = 0;
  int next_copy_ = 1;
  int64_t checkpoints_ = 0;                             // checkpoints under way (counted against resources.snapshots)
  int64_t copies_starting_ = 0;                         // copies being restored (counted against resources.copies)
  std::vector<std::shared_ptr<CheckpointOp>> dumping_;  // checkpoints under way
  std::vector<pid_t> lazy_daemons_;                     // lazy-pages daemons not yet reaped
  int chunk_writers_ = 0;                               // checkpoints adding chunks to the store
  bool gc_pending_ = false;                             // collect_chunks waits for them
};

}  // namespace sbx::checkpoint
