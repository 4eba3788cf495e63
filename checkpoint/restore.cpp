// Restore and fork: each copy of a snapshot a new branch of the box, restored cold (its files,
// the agent's command again) or live (criu restores its processes), then wired into the box
// through checkpoint::Host (host.hpp).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <utility>

#include "archive/archive.hpp"
#include "base/encoding.hpp"
#include "checkpoint/checkpointer.hpp"
#include "checkpoint/criu.hpp"
#include "checkpoint/internal.hpp"
#include "os/files.hpp"
#include "os/sys.hpp"
#include "sandbox/launcher.hpp"

namespace sbx::checkpoint {

namespace json = boost::json;
using namespace detail;

struct Checkpointer::RestoreOp {
  std::string snapshot;
  int n = 1;
  bool fork = false;
  Reply done;
  json::object manifest;
  std::string forced_name;       // --restore: the copy is "main"
  int first_index = 0;           // --restore-index: the copy's index among copies in boxes of their own
  bool live = false;             // criu restores it (a live snapshot a trusted key signed)
  std::string note;              // why a live snapshot is restored cold
  std::string from;              // where the caller says it came from (restore.done's `from`)
  bool cold_if_refused = false;  // restore cold what cannot be restored live (not refuse it)
  bool lazy = false;             // live copies restored with lazy pages (else lazy_why says why not)
  std::string lazy_why;
  int started = 0, running = 0;  // copies started, and those not yet done (bounded by cores)
  bool ksm = false;              // live copies' anonymous memory is marked mergeable
  double t0 = 0;
  bool counted = false;  // its copies count in copies_starting_ until each is done
  int pending = 0;
  json::array results;
  std::string src;                 // the snapshot's files and images: snapshots/<id>.d, or a fork's
  std::shared_ptr<ForkSeal> seal;  // fork_branch: the checkpoint sealed while the copies start
  std::shared_ptr<void> images;    // ... whose images (a linked tree) go with the last copy
  // The snapshot's id as events name it: null for a fork's copies until their snapshot is sealed.
  json::value snapshot_id() const {
    const std::string& id = seal && !seal->id.empty() ? seal->id : snapshot;
    return id.empty() ? json::value(nullptr) : json::value(id);
  }
};

// One copy of a restore, from its name to the box adopting it.
struct Checkpointer::CopyJob {
  std::shared_ptr<RestoreOp> op;
  CopySpec spec;                                // who the copy is
  std::string dir;                              // its layer: branches/<name>
  std::unique_ptr<Copy> copy;                   // the box's branch of it, until the box adopts it
  std::unique_ptr<sandbox::BranchPipes> pipes;  // a live copy's, until criu has restored it
  double t_start = 0, t_copied = 0, t_restored = 0;
  bool lazy = false;  // restored with lazy pages (else lazy_why says why not)
  std::string lazy_why;
  pid_t daemon = -1;          // its lazy-pages daemon, until reaped
  bool restored = false;      // criu's restore of it succeeded (restore.done was sent)
  bool memory_ended = false;  // its daemon has ended (status in memory_status)
  int memory_status = 0;
  json::object result;  // {"branch", "index"}, then what came of it
};

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

// Moves a checked extraction `tmp` (its manifest `m`, with "verified") to `dst` unless another
// extraction of the same archive got there first (then that one is the result).
base::Result<json::object> place_extraction(const std::string& tmp, json::object m, const std::string& dst) {
  auto bad = [&tmp](std::string msg) {
    os::remove_tree(tmp);
    return base::fail(std::move(msg), "bad_snapshot");
  };
  auto w = os::write_file_atomic(tmp + "/manifest.json", json::serialize(m) + "\n");
  if (w) w = os::write_file_atomic(tmp + "/.complete", "");
  if (!w) return bad("store the extracted snapshot: " + w.error().message());
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dst.c_str(), RENAME_NOREPLACE) == 0) return m;
    if (errno != EEXIST && errno != ENOTEMPTY) break;
    if (auto other = complete_manifest(dst)) {  // a concurrent extraction finished first
      os::remove_tree(tmp);
      return std::move(*other);
    }
    os::remove_tree(dst);  // a leftover of an extraction that never completed
  }
  return bad("store the extracted snapshot: " + std::string(std::strerror(errno)));
}

json::object with_verified(archive::Extracted& x) {
  json::object m = std::move(x.manifest);
  m["verified"] = x.trusted ? json::object{{"trusted", true}, {"key", x.signer}}
                            : json::object{{"trusted", false}, {"why", x.why_untrusted}};
  return m;
}

// Extracts and checks base.tar.zst into a directory of its own, then moves it to base.d
// (place_extraction): the manifest, with "verified". Errors have the code bad_snapshot, or
// untrusted.
// `chunks`: the snapshot is kept in the chunk store `store` (each chunk checked against its hash
// as it is read, the whole stream against the list's where it has one: format 2).
base::Result<json::object> extract_snapshot(const std::string& base, const std::string& id,
                                            const archive::ImportPolicy& policy,
                                            const std::optional<archive::ChunkList>& chunks, const std::string& store) {
  auto bad = [](std::string msg) { return base::fail(std::move(msg), "bad_snapshot"); };
  // The id names the content, and nothing extracted is used, or moved to base.d, unless it
  // matches: from format 3 on it is the hash of the manifest the extraction checks every entry
  // against; a format-2 archive is named by its file's hash, taken on a thread of its own while
  // the archive is extracted.
  std::future<base::Result<std::string>> sha;
  if (!chunks) {
    auto head = archive::read_manifest(base + ".tar.zst");
    if (!head) return head.error();
    if (!archive::named_by_manifest(head->format_version))
      sha = std::async(std::launch::async, [f = base + ".tar.zst"] { return archive::sha256_file(f); });
  }
  std::string tmp = base + ".d.tmp-" + os::random_hex(6);  // created by mkdir: one per extraction
  auto x = chunks ? archive::extract_chunks(store, *chunks, tmp, policy)
                  : archive::extract_archive(base + ".tar.zst", tmp, policy);
  std::string named;  // the hash that must name `id`
  if (sha.valid()) {
    auto got = sha.get();
    if (!got) {
      if (x) os::remove_tree(tmp);
      return bad(got.error().message);
    }
    named = *got;
  }
  if (!x) return x.error();
  bool by_manifest = archive::named_by_manifest(x->format_version);
  if (by_manifest) named = x->manifest_sha256;
  // A format-2 stream of the chunk store is named by its list's archive_sha256 (read_chunk_list).
  if ((by_manifest || !chunks) && archive::snapshot_id_of(named) != id) {
    os::remove_tree(tmp);
    return bad(std::string("the ") + (by_manifest ? "manifest" : "archive") + " of " + id +
               " is corrupted: its sha256 is " + named);
  }
  return place_extraction(tmp, with_verified(*x), base + ".d");
}

}  // namespace

namespace {
// Links the operator's archive `from` (--restore) into the store as `tmp` instead of copying it
// beside the extraction: only a regular file on the store's filesystem and mount that no one but
// the supervisor's own user can write; the very inode checked is linked (through its fd). The
// store takes a copy of its own once the restore is done (Checkpointer::unshare_archive), off the
// agent's path, so a later write into the operator's file (cp, curl -o) never reaches it.
// False: copy it now (another filesystem, another owner, a mode others can write).
bool link_operator_file(const std::string& from, const std::string& tmp) {
  os::UniqueFd fd(::open(from.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0 || !os::only_ours_to_write(st)) return false;
  if (::linkat(fd.get(), "", AT_FDCWD, tmp.c_str(), AT_EMPTY_PATH) == 0) return true;
  // AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH; the fd's /proc link does the same without it.
  return ::linkat(AT_FDCWD, os::FdPath(fd.get()).c_str(), AT_FDCWD, tmp.c_str(), AT_SYMLINK_FOLLOW) == 0;
}
}  // namespace

base::Result<detail::Filed> detail::extract_and_file(const std::string& tmp, const std::string& dir,
                                                     const archive::ImportPolicy& policy,
                                                     const std::string& operator_file) {
  // The id is the manifest's hash (format 3 on), which the extraction checks every entry against;
  // a format-2 archive's is the file's, taken beside the extraction (not in a pass of its own
  // before it). With `operator_file` (--restore), the file is linked into `tmp` where it may be
  // (link_operator_file), or else the extraction reads it while a second thread copies it into
  // `tmp` (and hashes the copy, for format 2); the file must not change meanwhile.
  const bool linked = !operator_file.empty() && link_operator_file(operator_file, tmp);
  if (linked)
    log()->info("{}: linked into the snapshot store, not copied (its own copy follows the restore)", operator_file);
  const std::string from = linked ? "" : operator_file;
  const std::string& read = from.empty() ? tmp : from;
  struct stat before {};
  if (::stat(read.c_str(), &before) != 0) return base::sys_fail("read " + read, errno, "bad_snapshot");
  auto head = archive::read_manifest(read);
  if (!head) return head.error();
  bool by_file = !archive::named_by_manifest(head->format_version);
  auto sha = std::async(std::launch::async, [tmp, from, by_file]() -> base::Result<std::string> {
    if (!from.empty())
      if (auto c = os::copy_tree(from, tmp); !c) return base::fail("copy " + from + ": " + c.error().message);
    return by_file ? archive::sha256_file(tmp) : std::string();
  });
  std::string xdir = dir + "/.import-" + os::random_hex(6) + ".d";
  auto x = archive::extract_archive(read, xdir, policy);
  auto got = sha.get();
  struct stat after {};
  if (got && !operator_file.empty() && (::stat(read.c_str(), &after) != 0 || !same_file(before, after)))
    got = base::fail(operator_file + " changed while it was read: restore from a file nothing writes to");
  if (!got) {
    if (x) os::remove_tree(xdir);
    return base::fail(got.error().message, "bad_snapshot");
  }
  if (!x) return x.error();
  Filed f;
  f.id = archive::snapshot_id_of(by_file ? *got : x->manifest_sha256);
  std::string base = dir + "/" + f.id;
  // Filed under its id without replacing anything: a second import of the same archive (even one
  // at the same moment) finds it there and says so.
  if (::link(tmp.c_str(), (base + ".tar.zst").c_str()) == 0) {
    ::unlink(tmp.c_str());
  } else if (errno == EEXIST) {
    f.existing = true;  // the same content is here already: its id says so
    ::unlink(tmp.c_str());
  } else {
    os::remove_tree(xdir);
    return base::fail("store the archive: " + std::string(std::strerror(errno)), "bad_snapshot");
  }
  auto m = place_extraction(xdir, with_verified(*x), base + ".d");
  if (!m) {
    if (!f.existing) ::unlink((base + ".tar.zst").c_str());
    return m.error();
  }
  f.manifest = std::move(*m);
  f.linked = linked && !f.existing && ::stat((base + ".tar.zst").c_str(), &f.linked_stat) == 0;
  return f;
}

void Checkpointer::with_extracted(const std::string& id, Extracted fn) {
  std::string base = snap_dir_ + "/" + id;
  if (auto m = complete_manifest(base + ".d")) return fn(std::move(*m));
  std::optional<archive::ChunkList> chunks;
  struct stat st {};
  if (auto list = chunk_list(id)) {
    if (!*list) return fn((*list).error());
    chunks = std::move(**list);
  } else if (::stat((base + ".tar.zst").c_str(), &st) != 0) {
    return fn(base::fail("no snapshot \"" + id + "\"", "bad_snapshot"));
  }
  auto policy = import_policy();
  if (!policy) return fn(policy.error());
  auto result = std::make_shared<base::Result<json::object>>(base::fail("", "bad_snapshot"));
  offload([base, id, result, policy = std::move(*policy), chunks = std::move(chunks),
           store = chunk_dir()] { *result = extract_snapshot(base, id, policy, chunks, store); },
          [result, fn] { fn(std::move(*result)); });
}

std::string Checkpointer::next_branch_name() {
  for (;;) {
    // Built by appending: GCC 12 at -O3 reports a false -Wrestrict on "f" + std::to_string(n).
    std::string n = "f";
    n.append(std::to_string(next_copy_++));
    std::string dir = settings_.state_dir;
    dir.append("/branches/").append(n);
    struct stat st {};
    if (!host_.has_branch(n) && ::stat(dir.c_str(), &st) != 0) return n;
  }
}

namespace {
// Why a live copy of a snapshot with this manifest cannot be restored here: a path the original's
// masks covered (its token file, state dir, keys) that is not here as the same kind of file. criu
// mounts the mask over it again and needs the mount point; without it the restore fails, and the
// first error of criu's log, the one reported, was an unrelated one (its kerndat's /dev/net/tun
// probe, under the copy's device rules). Those under /tmp are made in the copy's /tmp layer (copy_layer).
std::optional<std::string> missing_mask(const json::object& manifest) {
  auto* masks = manifest.if_contains("masks");
  if (!masks || !masks->is_array()) return std::nullopt;
  for (auto& v : masks->as_array()) {
    auto* o = v.if_object();
    auto* path = o ? o->if_contains("path") : nullptr;
    auto* dir = o ? o->if_contains("dir") : nullptr;
    if (!path || !path->is_string() || !dir || !dir->is_bool()) continue;
    std::string p(path->as_string());
    if (p.starts_with("/tmp/")) continue;
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0)
      return "the snapshot's masked path " + p + " is not here (" + std::strerror(errno) +
             "): a live copy mounts its mask over it again";
    if (S_ISDIR(st.st_mode) != dir->as_bool())
      return "the snapshot's masked path " + p + " is " + (dir->as_bool() ? "not a directory" : "a directory") +
             " here: a live copy mounts its mask over it again";
  }
  return std::nullopt;
}

// Why a live copy of a snapshot with this manifest cannot be restored here: a mount its agent saw
// beneath the host's directories whose mount point is not on this host (a container that ran
// beside the original box, a snap's revision since replaced). criu restores each where it was and
// fails on the first it cannot place ("Can't stat mountpoint" under a directory of its own).
std::optional<std::string> missing_host_mount(const json::object& manifest) {
  auto* mounts = manifest.if_contains("host_mounts");
  if (!mounts || !mounts->is_array()) return std::nullopt;
  for (auto& v : mounts->as_array()) {
    auto* o = v.if_object();
    auto* path = o ? o->if_contains("path") : nullptr;
    if (!path || !path->is_string()) continue;
    std::string p(path->as_string());
    struct stat st {};
    if (::lstat(p.c_str(), &st) == 0) continue;
    auto* type = o->if_contains("type");
    return "the snapshot's agent saw a mount at " + p +
           (type && type->is_string() ? " (" + std::string(type->as_string()) + ")" : std::string()) +
           " beneath the host's directories, and " + p + " is not on this host (" + std::strerror(errno) +
           "): a live copy has the mounts its original saw, each where it was; restore it on a host that has it";
  }
  return std::nullopt;
}

// The bytes of a snapshot's files (its manifest's sizes.fs), what each copy's branch dir gets.
uint64_t layer_bytes(const json::object& manifest) {
  auto* sizes = manifest.if_contains("sizes");
  auto* fs = sizes && sizes->is_object() ? sizes->as_object().if_contains("fs") : nullptr;
  return fs && fs->is_int64() && fs->as_int64() > 0 ? static_cast<uint64_t>(fs->as_int64()) : 0;
}
}  // namespace

void Checkpointer::restore(const std::string& snapshot, int n, bool fork, Reply done, const std::string& name,
                           int first_index, bool cold_if_refused, const std::string& from) {
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
  op->cold_if_refused = cold_if_refused;
  op->from = from;
  op->t0 = now_ms();
  if (host_.shutting_down()) return op->done(error_reply("shutting_down", "the box is shutting down"));
  // Every copy runs with the profile's full ceilings: the box runs at most resources.copies.
  // (A box's own start from an archive restores its main branch, no copy.)
  if (name != "main")
    if (auto refusal = copies_refusal("main", n)) return op->done(std::move(*refusal));
  op->counted = name != "main";
  if (op->counted) copies_starting_ += n;
  ++ops_;
  with_extracted(snapshot, [this, op](base::Result<json::object> m) {
    if (!m) {
      log()->error("restore {}: {}", op->snapshot, m.error().message);
      host_.emit("main", {{"type", "restore.failed"}, {"snapshot", op->snapshot}, {"error", m.error().message}});
      if (op->counted) copies_starting_ -= op->n;
      op->done(error_reply(m.error().code, m.error().message));
      return op_done();
    }
    op->manifest = std::move(*m);
    op->src = snap_dir_ + "/" + op->snapshot + ".d";
    begin_restore(op);
  });
}

namespace {

// What a copy reads of the manifest beside its files (restore_copy), checked before any copy
// starts: the box and branch it came from (restore.done names them), and the agent's command (a
// cold copy runs it again) and working directory. An archive has them when a box made it; one a
// client wrote (accepted unsigned under --allow-unsigned) may not. The reason, or nullopt.
std::optional<std::string> copy_fields_wrong(const json::object& m) {
  for (const char* k : {"box", "branch"})
    if (auto* v = m.if_contains(k); !v || !v->is_string())
      return std::string("its manifest has no ") + k + " (a string)";
  auto* agent = m.if_contains("agent");
  if (!agent || !agent->is_object()) return "its manifest has no agent (an object: the agent's argv and cwd)";
  try {
    (void)base::get_bytes_list(agent->as_object(), "argv");
    if (!base::get_bytes_field(agent->as_object(), "cwd")) return "its manifest has no agent.cwd";
  } catch (const std::exception& e) {
    return std::string("its manifest's agent.") + e.what();
  }
  return std::nullopt;
}

}  // namespace

// A restore whose snapshot is at hand (op->src, op->manifest): checked against this host, then
// its copies started.
void Checkpointer::begin_restore(std::shared_ptr<RestoreOp> op) {
  if (auto why = copy_fields_wrong(op->manifest)) {
    host_.emit("main", {{"type", "restore.failed"}, {"snapshot", op->snapshot_id()}, {"error", *why}});
    if (op->counted) copies_starting_ -= op->n;
    op->done(error_reply("bad_snapshot", "restore refused: " + *why));
    return op_done();
  }
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
  std::optional<std::string> refuse;
  auto live = mode == "live" ? live_possible() : base::Result<void>{};
  if (!live)
    refuse = "a live snapshot needs criu here: " + live.error().message;
  else if (auto r = archive::incompatibility(checked, host_.criu_version(), image_id_); !r)
    refuse = r.error().message;
  if (!refuse && mode == "live")
    if (auto r = host_.copy_network_possible(op->manifest); !r) refuse = r.error().message;
  if (!refuse && mode == "live") refuse = missing_mask(op->manifest);
  if (!refuse && mode == "live") refuse = missing_host_mount(op->manifest);
  // criu does not restore Landlock: a live copy in a box whose profile asks for it would run
  // without it. A cold copy gets it again.
  if (!refuse && mode == "live" && settings_.landlock)
    refuse = "a live snapshot restores without Landlock, and this box's profile asks for Landlock";
  if (refuse && op->cold_if_refused && op->live) {
    op->note = "restored cold, its criu images unused: " + *refuse;
    op->live = false;
    refuse.reset();
  }
  if (refuse) {
    host_.emit("main", {{"type", "restore.failed"}, {"snapshot", op->snapshot_id()}, {"error", *refuse}});
    if (op->counted) copies_starting_ -= op->n;
    op->done(error_reply("incompatible", *refuse));
    return op_done();
  }
  // Each copy gets the snapshot's files (its layer) in its own branch dir: they must fit beside
  // the journal's room, which comes first, as for a checkpoint or an import.
  if (auto why = room_refusal(layer_bytes(op->manifest) * static_cast<uint64_t>(op->n),
                              std::to_string(op->n) + (op->n == 1 ? " copy's files" : " copies' files"))) {
    host_.emit("main", {{"type", "restore.failed"}, {"snapshot", op->snapshot_id()}, {"error", *why}});
    if (op->counted) copies_starting_ -= op->n;
    op->done(error_reply("no_space", "restore refused: " + *why));
    return op_done();
  }
  op->pending = op->n;
  if (op->live) {
    auto lazy = lazy_pages_possible();
    op->lazy = static_cast<bool>(lazy);
    if (!lazy) op->lazy_why = lazy.error().message;
  }
  if (!op->live || !settings_.ksm) return start_more(op);
  // KSM: the snapshot's anonymous private mappings are marked mergeable once, in its extracted
  // images (checked when extracted; the archive itself is unchanged), before any copy of it runs.
  std::string img = op->src + "/criu";
  auto err = std::make_shared<std::string>();
  offload(
      [img, err] {
        struct stat st {};
        if (::stat((img + "/.mergeable").c_str(), &st) == 0) return;
        auto m = mark_mergeable(img);
        if (!m)
          *err = m.error().message;
        else if (auto w = os::write_file_atomic(img + "/.mergeable", std::to_string(*m) + "\n"); !w)
          *err = w.error().message();
      },
      [this, op, err] {
        op->ksm = err->empty();
        if (!err->empty()) log()->warn("restore {}: copies not mergeable: {}", op->snapshot, *err);
        start_more(op);
      });
}

void Checkpointer::start_more(std::shared_ptr<RestoreOp> op) {
  // Copies restore side by side, four times as many at once as there are cores: criu's restore
  // and its lazy-pages daemon wait on the kernel for much of their time. A fork of 8 on 2 cores,
  // to fork.created: 553 ms with 2 at once, 364-384 with 4, 311-326 with 8 (50 MB agent); 508-571
  // with 4 and 304-328 with 8 (1 GiB agent, lazy copies). More only wait for CPU.
  long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  int bound = 4 * (cores > 0 ? static_cast<int>(cores) : 1);
  while (op->started < op->n && op->running < bound) {
    ++op->running;
    restore_copy(op, op->started++);
  }
}

namespace {

// Copies an extracted snapshot's layer (src/fs/...) into a copy's dir. The workspace is there
// already, mounted with the parent's disk ceiling and owner. Hard links and holes are kept as the
// checkpoint's copy kept them, each copy within `bound` (leaving the state dir's room, where no
// ceiling's filesystems hold the copy). Runs on the thread pool.
base::Result<void> copy_layer(const std::string& src, const std::string& dir, const json::array& masks, bool live,
                              os::CopyBound bound) {
  if (auto r = os::make_dirs(dir, 0755); !r) return base::fail("create " + dir + ": " + r.error().message());
  // The snapshot's /tmp is the upper layer of the copy's /tmp overlay, a cold copy's (launcher.cpp)
  // as a live one's (CriuRun::tmp_overlay). A cold copy's launch falls back to tmp/ where overlay
  // cannot be had, so it gets the files there too; a live copy's tmp/ stays empty, the mount point
  // of its overlay, or of a bind of tmp-upper/ where no overlay can be mounted.
  for (const char* d : sandbox::kLayerDirs) {
    struct stat st {};
    if (::lstat((src + "/fs/" + d).c_str(), &st) != 0) continue;
    std::string_view name(d);
    auto copy = [&](const std::string& from, const std::string& to) -> base::Result<void> {
      auto r = name == "workspace" ? os::copy_tree_into(from, to, bound) : os::copy_tree(from, to, bound);
      if (!r) return r.error();
      return {};
    };
    if (name == "tmp")
      if (auto r = copy(src + "/fs/tmp", dir + "/tmp-upper"); !r) return r.error();
    if (name != "tmp" || !live)
      if (auto r = copy(src + "/fs/" + d, dir + "/" + d); !r) return r.error();
  }
  auto top = os::open_dir(dir);
  if (!top) return base::fail("open " + dir + ": " + top.error().message());
  for (const char* sub : {"tmp", "tmp-upper", "tmp-work"}) {
    auto d = os::make_dirs_at(top->get(), sub, 0755);
    if (!d) return base::fail("create " + dir + "/" + sub + ": " + d.error().message());
    if (std::string_view(sub) != "tmp-work" && ::fchmod(d->get(), 01777) != 0)
      return base::sys_fail("chmod " + dir + "/" + sub, errno);
  }
  // The mount points of the masks criu restores below /tmp, in the overlay's upper layer: the
  // host's /tmp may no longer have them, and a /tmp of the copy's own never does.
  for (auto& v : masks) {
    if (!v.is_object()) continue;
    std::string path(v.at("path").as_string());
    if (!path.starts_with("/tmp/")) continue;
    // The copy's tmp-upper/ came from the agent's files: nothing in it is followed.
    std::string rel = "tmp-upper" + path.substr(4);
    if (v.at("dir").as_bool()) {
      if (auto r = os::make_dirs_at(top->get(), rel, 0755); !r)
        log()->warn("create the mount point {} in {}: {}", path, dir, r.error().message());
    } else if (auto p = os::make_dirs_at(top->get(), rel.substr(0, rel.rfind('/')), 0755); !p) {
      log()->warn("create the mount point {} in {}: {}", path, dir, p.error().message());
    } else if (auto r = os::write_file_atomic_at(p->get(), rel.substr(rel.rfind('/') + 1), ""); !r) {
      log()->warn("create the mount point {} in {}: {}", path, dir, r.error().message());
    }
  }
  return {};
}

}  // namespace

void Checkpointer::restore_copy(std::shared_ptr<RestoreOp> op, int index) {
  auto job = std::make_shared<CopyJob>();
  job->op = op;
  CopySpec& spec = job->spec;
  spec.name = op->forced_name.empty() ? next_branch_name() : op->forced_name;
  spec.main_proc = spec.name == "main" ? "main" : "main@" + spec.name;
  spec.lineage.mode = op->live ? "live" : "cold";
  spec.lineage.parent = std::string(op->manifest.at("branch").as_string());
  spec.lineage.snapshot = op->snapshot;  // a fork's copy gets it once sealed (its `tell`)
  spec.lineage.index = op->first_index + index;
  const auto& agent = op->manifest.at("agent").as_object();
  spec.argv = base::get_bytes_list(agent, "argv").value_or(std::vector<std::string>{});
  spec.cwd = base::get_bytes_field(agent, "cwd").value_or("");
  job->dir = settings_.state_dir + "/branches/" + spec.name;
  job->result = {{"branch", spec.name}, {"index", spec.lineage.index}};
  // A copy gets exactly its parent's policy (the box's new_copy): Landlock (a cold copy's agent
  // gets it again; a live one is refused above where the profile asks for it), and the
  // workspace's disk ceiling and owner, mounted before the snapshot's files are copied into it.
  job->copy = host_.new_copy(spec);
  auto err = std::make_shared<std::string>();
  if (auto r = os::make_dirs(job->dir + "/workspace", 0755); !r)
    *err = "create " + job->dir + "/workspace: " + r.error().message();
  else if (auto ws = host_.mount_copy_workspace(*job->copy, job->dir); !ws)
    *err = "the copy's workspace: " + ws.error().message;
  job->t_start = now_ms();
  json::array masks;
  if (auto* m = op->manifest.if_contains("masks"); m && m->is_array()) masks = m->as_array();
  std::string src = op->src;
  // Under a disk ceiling the copy's dir and workspace are filesystems of that size; else its
  // files go to the state dir's, which keeps the journal's room.
  os::CopyBound bound = settings_.disk_bytes ? os::CopyBound{} : room_bound();
  offload(
      [src, dir = job->dir, err, masks, live = op->live, bound] {
        if (!err->empty()) return;
        if (auto r = copy_layer(src, dir, masks, live, bound); !r) *err = r.error().message;
      },
      [this, job, err] {
        job->t_copied = now_ms();
        if (!err->empty()) return copy_failed(job, "copy the snapshot's files: " + *err);
        if (job->op->live) return start_live_copy(job);
        write_branch_json(settings_.box_id, job->spec.name, job->spec.lineage, job->dir);
        start_cold_copy(job);
      });
}

void Checkpointer::start_cold_copy(std::shared_ptr<CopyJob> job) {
  // Cold restart: the agent's command again, on the snapshot's files.
  auto spec = host_.cold_copy_spec(*job->copy);
  if (!spec) return copy_failed(job, spec.error().message);
  // The cold copy's agent gets the profile's process policy (caps, rlimits, seccomp, Landlock) as
  // the original's did, and a cgroup of its own with the original's ceilings.
  auto cg = host_.copy_cgroup(*job->copy);
  for (auto& fd : cg) spec->cgroup_join.push_back(fd.get());
  spec->cgroup_view = host_.copy_cgroup_view(*job->copy);
  auto lb = sandbox::launch_branch(*spec);
  cg.clear();
  if (!lb) return copy_failed(job, "start the copy: " + lb.error().message);
  pid_t ns_init = lb->pid;
  job->copy->launched() = std::move(*lb);
  if (auto r = host_.start_cold_agent(*job->copy, {"SANDBOXER_RESUMED=1", "SANDBOXER_SNAPSHOT=" + job->op->snapshot});
      !r) {
    ::kill(ns_init, SIGKILL);  // its ns-init still waits for its config
    return copy_failed(job, r.error().message);
  }
  const CopySpec& s = job->spec;
  host_.adopt_copy(std::move(job->copy), false);
  auto w = identity(settings_.box_id, s.name, s.lineage);
  w["type"] = "whoami";
  host_.channel_reply(s.name, w);
  auto& res = job->result;
  res["mode"] = "cold";
  res["proc"] = s.main_proc;
  res["timings_ms"] = {{"copy", round_ms(job->t_copied - job->t_start)},
                       {"restore", round_ms(now_ms() - job->t_copied)}};
  copy_done(job->op, std::move(res));
}

void Checkpointer::start_live_copy(std::shared_ptr<CopyJob> job) {
  when_kdat_ready([this, job](base::Result<void> ready) {
    if (!ready) return copy_failed(job, ready.error().message);
    (void)os::make_dirs(job->dir + "/.criu", 0700);
    job->lazy = job->op->lazy;
    job->lazy_why = job->op->lazy_why;
    if (job->lazy) return start_lazy_daemon(job);
    spawn_live_restore(job);
  });
}

namespace {

// Why a copy's lazy-pages daemon failed: its log's error, or what it printed where it failed
// before it opened its log.
std::string lazy_daemon_error(const std::string& dir) {
  struct stat st {};
  bool log = ::stat((dir + "/.criu/lazy-pages.log").c_str(), &st) == 0 && st.st_size > 0;
  return criu_error_from_log(dir + (log ? "/.criu/lazy-pages.log" : "/.criu/lazy-pages.out"));
}

}  // namespace

void Checkpointer::start_lazy_daemon(std::shared_ptr<CopyJob> job) {
  // One daemon per copy serves the snapshot's page images to that copy's userfaultfd: pages
  // the copy touches first, then the rest in the background; it ends when all have arrived.
  // It and the restore meet at a socket in the copy's criu work dir.
  auto eager = [this, job](std::string why) {
    job->lazy = false;
    job->lazy_why = std::move(why);
    spawn_live_restore(job);
  };
  auto status = os::make_pipe();
  if (!status) return eager("its lazy-pages daemon: " + status.error().message());
  CriuRun run;
  run.args = {"lazy-pages",     "--images-dir",      job->op->src + "/criu",
              "--work-dir",     job->dir + "/.criu", "--log-file",
              "lazy-pages.log", "--status-fd",       std::to_string(kCriuFirstFd)};
  run.fds = {status->write.get()};
  run.output = job->dir + "/.criu/lazy-pages.out";
  auto pid = start_criu(std::move(run));
  status->write.reset();
  if (!pid) return eager("its lazy-pages daemon: " + pid.error().message);
  job->daemon = *pid;
  lazy_daemons_.push_back(*pid);
  host_.watch_child(*pid, [this, job](pid_t p, int st) {
    std::erase(lazy_daemons_, p);
    job->daemon = -1;
    job->memory_ended = true;
    job->memory_status = st;
    if (job->restored) lazy_daemon_ended(job);
  });
  // The daemon writes one byte to its status fd once its socket listens (or exits first).
  auto ready = std::make_shared<bool>(false);
  auto rd = std::make_shared<os::UniqueFd>(std::move(status->read));
  offload(
      [rd, ready] {
        struct pollfd p {
          rd->get(), POLLIN, 0
        };
        char c = 0;
        *ready = ::poll(&p, 1, 10000) == 1 && ::read(rd->get(), &c, 1) == 1;
      },
      [this, job, ready, eager] {
        if (*ready) return spawn_live_restore(job);
        if (job->daemon > 0) ::kill(job->daemon, SIGKILL);
        eager("its lazy-pages daemon did not start: " + lazy_daemon_error(job->dir));
      });
}

void Checkpointer::lazy_daemon_ended(std::shared_ptr<CopyJob> job) {
  int st = job->memory_status;
  json::object ev{{"type", "restore.memory_complete"},
                  {"snapshot", job->op->snapshot_id()},
                  {"index", job->spec.lineage.index},
                  {"ok", WIFEXITED(st) && WEXITSTATUS(st) == 0},
                  {"ms", round_ms(now_ms() - job->t_restored)}};
  if (!ev["ok"].as_bool())
    ev["error"] = WIFSIGNALED(st)
                      ? std::string("the lazy-pages daemon was killed by SIG") + os::signal_name(WTERMSIG(st))
                      : "the lazy-pages daemon failed: " + lazy_daemon_error(job->dir);
  host_.emit(job->spec.name, ev);
}

// The copy's /sys/fs/cgroup shows its own groups where the original's were (the manifest's
// cgroup_view, dumped as the external mounts cg-N, checkpointer.cpp); a name the copy has no
// group for (a box without cgroups) gets an empty directory.
void Checkpointer::cgroup_mounts(std::shared_ptr<CopyJob> job, CriuRun& run) {
  auto* names = job->op->manifest.if_contains("cgroup_view");
  if (!names || !names->is_array()) return;
  auto view = host_.copy_cgroup_view(*job->copy);
  for (size_t i = 0; i < names->as_array().size(); ++i) {
    std::string dir;
    for (auto& [name, d] : view)
      if (names->as_array()[i].is_string() && names->as_array()[i].as_string() == name) dir = d;
    if (dir.empty()) {
      dir = job->dir + "/.criu/no-cgroup";
      (void)os::make_dirs(dir, 0555);
    }
    run.args.insert(run.args.end(), {"--external", "mnt[" + kCgroupKey + std::to_string(i) + "]:" + dir});
  }
}

void Checkpointer::spawn_live_restore(std::shared_ptr<CopyJob> job) {
  const std::string& dir = job->dir;
  auto pipes = sandbox::make_branch_pipes(true);
  if (!pipes) return copy_failed(job, "make its pipes and network namespace: " + pipes.error().message());
  job->pipes = std::make_unique<sandbox::BranchPipes>(std::move(*pipes));
  CriuRun run;
  run.args = {"restore",
              "--images-dir",
              job->op->src + "/criu",
              "--work-dir",
              dir + "/.criu",
              "--log-file",
              "restore.log",
              "--root",
              dir + "/root",
              "--restore-sibling",
              "--restore-detached",
              "--manage-cgroups=ignore",
              "--tcp-close",
              "--file-locks",
              "--ext-mount-map",
              "auto",
              "--external",
              "mnt[workspace]:" + dir + "/workspace",
              "--external",
              "mnt[tmp]:" + dir + "/tmp",
              "--external",
              "mnt[run]:" + dir + "/run",
              "--external",
              "mnt[machine-id]:" + dir + "/" + sandbox::kMachineIdFile,
              "--pidfile",
              dir + "/.criu/pid"};
  auto ends = job->pipes->child_ends();
  auto& old = job->op->manifest.at("pipes").as_object();
  const json::array no_sockets;
  auto* sk = job->op->manifest.if_contains("sockets");
  const json::array& sockets = sk && sk->is_array() ? sk->as_array() : no_sockets;
  for (size_t i = 0; i < 7; ++i) {
    run.fds.push_back(ends[i]);
    auto* ino = old.if_contains(kPipeRoles[i]);
    if (!ino || !ino->is_number()) continue;
    bool socket = std::find(sockets.begin(), sockets.end(), json::value(kPipeRoles[i])) != sockets.end();
    run.args.push_back("--inherit-fd");
    run.args.push_back("fd[" + std::to_string(kCriuFirstFd + static_cast<int>(i)) +
                       "]:" + (socket ? "socket:[" : "pipe:[") + std::to_string(ino->to_number<uint64_t>()) + "]");
  }
  // A tree that had a network namespace of its own goes into the copy's (criu runs in it too,
  // for a tree that had the host's).
  if (auto* ino = job->op->manifest.if_contains("netns_inode"); ino && ino->is_number()) {
    run.fds.push_back(job->pipes->netns.get());
    run.args.push_back("--inherit-fd");
    run.args.push_back("fd[" + std::to_string(kCriuFirstFd + static_cast<int>(run.fds.size()) - 1) + "]:" + kNetnsKey);
  }
  if (job->lazy) run.args.push_back("--lazy-pages");
  run.netns = job->pipes->netns.get();
  run.writable_proc_sys = true;
  run.tmp_overlay = dir;
  run.hostname = job->spec.name + "." + settings_.box_id;
  sandbox::ensure_machine_id(dir);  // a new one: the copy is another running system
  run.output = dir + "/.criu/restore.out";
  // Its own cgroup, with the original's ceilings: criu joins it, and so does all it restores.
  auto cg = host_.copy_cgroup(*job->copy);
  for (auto& fd : cg) run.cgroup_join.push_back(fd.get());
  run.cgroup_ns = true;  // as ns-init makes one for a branch it starts (sandbox/ns-init.cpp)
  cgroup_mounts(job, run);
  auto pid = start_criu(std::move(run));
  cg.clear();
  if (!pid) return copy_failed(job, pid.error().message);
  host_.watch_child(*pid, [this, job](pid_t, int st) { live_copy_restored(job, st); });
}

void Checkpointer::live_copy_restored(std::shared_ptr<CopyJob> job, int st) {
  const std::string& dir = job->dir;
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    job->pipes.reset();
    if (job->daemon > 0) ::kill(job->daemon, SIGKILL);  // it has no copy to serve
    return copy_failed(job, "criu restore failed: " + criu_error_from_log(dir + "/.criu/restore.log"));
  }
  auto text = os::read_file(dir + "/.criu/pid");
  pid_t root = text ? static_cast<pid_t>(std::atoi(text->c_str())) : -1;
  if (root <= 0) {
    job->pipes.reset();
    return copy_failed(job, "criu restore left no pid file");
  }
  sandbox::LaunchedBranch& launched = job->copy->launched();
  launched.pid = root;
  launched.namespaced = true;
  launched.take(*job->pipes);
  job->pipes.reset();  // closes the copy's ends: the restored tree holds them now
  // A snapshot from before the network namespace was dumped as external has criu make the
  // copy's own: that one is the copy's, for its broker.
  struct stat mine {
  }, theirs{};
  std::string path = "/proc/" + std::to_string(root) + "/ns/net";
  if (::stat(path.c_str(), &theirs) == 0 &&
      (!launched.netns || ::fstat(launched.netns.get(), &mine) != 0 || mine.st_ino != theirs.st_ino))
    launched.netns.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  launched.in.reset();
  // Its network before it runs: the copy's own broker where the agent expects it.
  if (auto r = host_.attach_live_network(*job->copy); !r) {
    ::kill(root, SIGKILL);
    return copy_failed(job, r.error().message);
  }
  const CopySpec& s = job->spec;
  // The copy's identity replaces the snapshot's branch.json only now, restored and still stopped:
  // a descriptor the agent held on it at the dump was checked by criu against the file it saw
  // (its size), and keeps that file (unlinked now), as a fork(2)'s child keeps its parent's.
  write_branch_json(settings_.box_id, s.name, s.lineage, dir);
  host_.adopt_copy(std::move(job->copy), true);
  // The tree was dumped stopped, so criu restored it stopped: it runs from here.
  auto added = host_.find_branch(s.name);
  continue_tree(root, added ? added->pidfd : -1);
  // The copy's first line on its channel says who it is; a channel request the original was
  // waiting on at the dump gets its answer in the copy too. A fork's copy that runs before its
  // snapshot is sealed gets both once it is (fork_sealed), and its lineage then names the
  // snapshot (whoami, branch.json): its agent goes on knowing it.
  std::optional<int64_t> request;
  if (auto* cr = job->op->manifest.if_contains("channel_request"); cr && cr->is_int64()) request = cr->as_int64();
  auto tell = [this, name = s.name, lineage = s.lineage, request](const std::string& id) {
    Lineage l = lineage;
    if (!id.empty() && id != l.snapshot) {
      l.snapshot = id;
      host_.set_snapshot_of(name, id);
    }
    auto w = identity(settings_.box_id, name, l);
    w["type"] = "whoami";
    host_.channel_reply(name, w);
    if (request)
      host_.channel_reply(name, {{"id", *request},
                                 {"ok", true},
                                 {"snapshot", w.at("snapshot")},
                                 {"copy", true},
                                 {"branch", name},
                                 {"index", l.index},
                                 {"mode", "live"}});
  };
  if (job->op->seal && !job->op->seal->sealed)
    job->op->seal->tell.push_back(std::move(tell));
  else
    tell(job->op->seal ? job->op->seal->id : job->op->snapshot);
  auto& res = job->result;
  res["mode"] = "live";
  res["proc"] = s.main_proc;
  res["pid"] = root;
  job->t_restored = now_ms();
  res["timings_ms"] = {{"copy", round_ms(job->t_copied - job->t_start)},
                       {"restore", round_ms(job->t_restored - job->t_copied)},
                       {"criu", criu_stats(dir + "/.criu/stats-restore")}};
  res["lazy"] = job->lazy;
  res["ksm"] = job->op->ksm;
  if (!job->lazy) res["lazy_why"] = job->lazy_why;
  job->restored = true;
  copy_done(job->op, std::move(res));
  // Its memory may have arrived before criu's restore ended (a small copy).
  if (job->lazy && job->memory_ended) lazy_daemon_ended(job);
}

void Checkpointer::copy_failed(std::shared_ptr<CopyJob> job, std::string error) {
  job->copy.reset();  // the box's branch of it: its mounts and cgroup go before its dir does
  job->result["error"] = std::move(error);
  copy_done(job->op, std::move(job->result));
}

void Checkpointer::copy_done(std::shared_ptr<RestoreOp> op, json::object res) {
  std::string branch(res.at("branch").as_string());
  json::object ev{{"type", "restore.done"},
                  {"snapshot", op->snapshot_id()},
                  {"parent", op->manifest.at("branch")},
                  {"parent_box", op->manifest.at("box")},
                  {"index", res.at("index")},
                  {"of", op->n}};
  if (!op->from.empty()) ev["from"] = op->from;
  if (op->counted) --copies_starting_;
  if (res.contains("error")) {
    // Nothing half-restored stays behind: the copy's directory goes with its failure (its
    // mounts went with its Copy, copy_failed).
    if (!host_.has_branch(branch)) os::remove_tree(settings_.state_dir + "/branches/" + branch);
    ev["type"] = "restore.failed";
    ev["error"] = res.at("error");
    log()->error("restore {} as {}: {}", op->snapshot, branch, res.at("error").as_string());
    host_.emit(branch, ev);
  } else {
    ev["mode"] = res.at("mode");
    if (!op->note.empty()) ev["note"] = res["note"] = op->note;
    ev["proc"] = res.at("proc");
    ev["timings_ms"] = res.at("timings_ms");
    if (auto* lazy = res.if_contains("lazy")) ev["lazy"] = *lazy;
    if (auto* why = res.if_contains("lazy_why")) ev["lazy_why"] = *why;
    if (auto* ksm = res.if_contains("ksm")) ev["ksm"] = *ksm;
    host_.emit(branch, ev);
  }
  op->results.emplace_back(std::move(res));
  --op->running;
  start_more(op);
  if (--op->pending > 0) return;
  bool all_ok = true;
  for (auto& r : op->results) {
    all_ok &= !r.as_object().contains("error");
  }
  double total = round_ms(now_ms() - op->t0);
  // A fork of a live branch says fork.created once its snapshot is sealed too (fork_finish).
  if (op->fork && !op->seal) {
    host_.emit("main", {{"type", "fork.created"},
                        {"snapshot", op->snapshot},
                        {"n", op->n},
                        {"copies", op->results},
                        {"timings_ms", {{"total", total}}}});
  }
  json::object reply{
      {"ok", all_ok}, {"snapshot", op->snapshot_id()}, {"copies", op->results}, {"timings_ms", {{"total", total}}}};
  if (!all_ok) reply["error"] = {{"code", "restore_failed"}, {"message", "some copies could not be restored"}};
  op->done(std::move(reply));
  op_done();
}

// ---- fork of a live branch ----

void Checkpointer::fork_branch(const std::string& branch, const std::string& name, int n, bool leave_running,
                               Reply done, const std::string& by, bool chunked) {
  if (n < 1 || n > 64) return done(error_reply("bad_request", "n must be 1..64"));
  if (host_.shutting_down()) return done(error_reply("shutting_down", "the box is shutting down"));
  // Refused before the checkpoint is taken: a fork past resources.copies makes no snapshot. Its
  // copies count from here, as a restore's do.
  if (auto refusal = copies_refusal(branch, n)) return done(std::move(*refusal));
  auto fs = std::make_shared<ForkSeal>();
  fs->n = n;
  fs->done = std::move(done);
  fs->t0 = now_ms();
  copies_starting_ += n;
  start_checkpoint(
      branch, name, leave_running, [this, fs](json::object r) { fork_sealed(fs, std::move(r)); }, by, chunked, 0, fs);
}

void Checkpointer::fork_copies(std::shared_ptr<ForkSeal> fs, const std::string& dir, json::object manifest) {
  fs->early = true;
  auto op = std::make_shared<RestoreOp>();
  op->n = fs->n;
  op->fork = true;
  op->seal = fs;
  op->src = dir;
  op->images = std::shared_ptr<void>(nullptr, [dir](void*) { os::remove_tree(dir); });
  op->manifest = std::move(manifest);
  op->t0 = fs->t0;
  op->counted = true;  // since fork_branch
  op->done = [this, fs](json::object r) {
    fs->t_running = now_ms();
    fs->forked = std::move(r);
    fork_finish(fs);
  };
  ++ops_;
  begin_restore(op);
}

void Checkpointer::fork_sealed(std::shared_ptr<ForkSeal> fs, json::object r) {
  auto* ok = r.if_contains("ok");
  if (ok && ok->is_bool() && ok->as_bool()) fs->id = std::string(r.at("snapshot").as_string());
  fs->sealed = std::move(r);
  // The copies running already learn their snapshot, hear who they are and the answer to the
  // fork (snapshot null if it was not kept); the others do as they are adopted.
  for (auto& tell : std::exchange(fs->tell, {})) tell(fs->id);
  if (fs->early) return fork_finish(fs);
  // Not begun from the images (a files-only checkpoint, a box that signs nothing, or the images
  // could not be linked): the copies restore from the stored snapshot, as a fork of it does.
  copies_starting_ -= fs->n;
  if (fs->id.empty()) return fs->done(std::move(*fs->sealed));
  restore(fs->id, fs->n, true, [fs](json::object fr) {
    auto* t = fs->sealed->if_contains("timings_ms");
    if (t && fr.contains("timings_ms")) fr["timings_ms"].as_object()["checkpoint"] = *t;
    fs->done(std::move(fr));
  });
}

void Checkpointer::fork_finish(std::shared_ptr<ForkSeal> fs) {
  if (!fs->sealed || !fs->forked) return;
  json::object reply = std::move(*fs->forked);
  const json::object& cp = *fs->sealed;
  reply["snapshot"] = fs->id.empty() ? json::value(nullptr) : json::value(fs->id);
  json::object timings{{"total", round_ms(now_ms() - fs->t0)}, {"running", round_ms(fs->t_running - fs->t0)}};
  if (auto* t = cp.if_contains("timings_ms")) timings["checkpoint"] = *t;
  reply["timings_ms"] = timings;
  if (fs->id.empty()) {
    auto* e = cp.if_contains("error");
    auto* m = e && e->is_object() ? e->as_object().if_contains("message") : nullptr;
    reply["note"] = "the copies run, but their snapshot was not kept: " +
                    (m && m->is_string() ? std::string(m->as_string()) : std::string("the checkpoint failed"));
  }
  json::value copies = reply.contains("copies") ? reply.at("copies") : json::value(json::array{});
  host_.emit("main", {{"type", "fork.created"},
                      {"snapshot", reply.at("snapshot")},
                      {"n", fs->n},
                      {"copies", copies},
                      {"early", true},
                      {"timings_ms", timings}});
  fs->done(std::move(reply));
}

void Checkpointer::restore_main(const std::string& snapshot, int index, Reply done, const std::string& from) {
  // Continue the parent's numbering (restore refuses an id that is not one).
  if (archive::valid_snapshot_id(snapshot))
    if (auto text = os::read_file(snap_dir_ + "/" + snapshot + ".json")) {
      boost::system::error_code ec;
      json::value m = json::parse(*text, ec);
      if (!ec && m.is_object())
        if (auto* ls = m.as_object().if_contains("last_seq"); ls && ls->is_number())
          host_.continue_journal_after(ls->to_number<uint64_t>());
    }
  restore(snapshot, 1, false, std::move(done), "main", index, false, from);
}

void Checkpointer::start_from_archive(const std::string& path) {
  ++ops_;
  auto err = std::make_shared<std::string>();
  auto real = std::make_shared<std::string>();
  auto delta = std::make_shared<bool>(false);
  std::string tmp = incoming_path();
  offload(
      [path, tmp, err, real, delta] {
        // The operator's path may be a symlink (copy_tree follows none): resolved here.
        std::unique_ptr<char, decltype(&std::free)> r(::realpath(path.c_str(), nullptr), &std::free);
        *real = r ? r.get() : path;
        // An archive is one regular file: a directory would be copied whole into the store and
        // left there, a FIFO waited on.
        struct stat st {};
        if (::stat(real->c_str(), &st) != 0) {
          *err = std::strerror(errno);
        } else if (!S_ISREG(st.st_mode)) {
          *err = std::string(S_ISDIR(st.st_mode) ? "a directory" : "not a regular file") + ", not an archive";
        } else if ((*delta = archive::is_delta(*real))) {
          // A delta goes through the chunk store: copied first, as an upload is.
          if (auto c = os::copy_tree(*real, tmp); !c) *err = c.error().message;
        }
      },
      [this, err, tmp, path, real, delta] {
        auto fail = [this](const std::string& msg) {
          log()->critical("restore from archive: {}", msg);
          host_.box_started();
          host_.emit("main", {{"type", "restore.failed"}, {"error", msg}});
          host_.end_box(125);
          op_done();
        };
        if (!err->empty()) {
          ::unlink(tmp.c_str());
          return fail(path + ": " + *err);
        }
        // An archive is extracted from the operator's file while it is copied into the store.
        import_archive(
            tmp,
            [this, fail, path](json::object r) {
              if (!r.at("ok").as_bool())
                return fail(path + ": " + std::string(r.at("error").at("message").as_string()));
              restore_main(
                  std::string(r.at("snapshot").as_string()), settings_.restore_index,
                  [this](json::object r2) {
                    host_.box_started();
                    if (!r2.at("ok").as_bool()) host_.end_box(125);
                  },
                  path);
              op_done();
            },
            false, *delta ? std::string() : *real);
      });
}

}  // namespace sbx::checkpoint
