// The snapshot store (snapshots/ under the state dir): the list, deletion, import and export, the
// box's bounds (resources.snapshots, resources.copies) and the agent channel's reach
// (checkpoint/README.md, "The agent channel's reach").
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <unordered_set>

#include "archive/archive.hpp"
#include "base/encoding.hpp"
#include "checkpoint/checkpointer.hpp"
#include "checkpoint/internal.hpp"
#include "os/files.hpp"
#include "os/sys.hpp"

namespace sbx::checkpoint {

namespace json = boost::json;
using namespace detail;

namespace {
// The ids of the snapshots that have a file <id><suffix> in `dir`, sorted.
std::vector<std::string> ids_with(const std::string& dir, std::string_view suffix) {
  std::vector<std::string> ids;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return ids;
  while (auto* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n.size() > suffix.size() && n.ends_with(suffix) &&
        archive::valid_snapshot_id(n.substr(0, n.size() - suffix.size())))
      ids.emplace_back(n.substr(0, n.size() - suffix.size()));
  }
  ::closedir(d);
  std::sort(ids.begin(), ids.end());
  return ids;
}
}  // namespace

// ---- bounds and the agent channel's reach ----

size_t Checkpointer::stored_snapshots() const { return ids_with(snap_dir_, ".json").size(); }

json::object Checkpointer::limit_refusal(const std::string& branch, const char* limit, int64_t value, int64_t ceiling,
                                         const std::string& msg) {
  auto b = host_.find_branch(branch);
  host_.emit(branch, {{"type", "limit.hit"},
                      {"limit", limit},
                      {"value", value},
                      {"ceiling", ceiling},
                      {"proc", b ? json::value(b->main_proc) : json::value(nullptr)}});
  return error_reply("limit", msg);
}

std::optional<json::object> Checkpointer::snapshots_refusal(const std::string& branch) {
  int64_t ceiling = settings_.max_snapshots;
  auto value = static_cast<int64_t>(stored_snapshots()) + checkpoints_ + 1;
  if (value <= ceiling) return std::nullopt;
  return limit_refusal(branch, "snapshots", value, ceiling,
                       "resources.snapshots: this box keeps at most " + std::to_string(ceiling) + " snapshots (" +
                           std::to_string(value - 1) + " kept or being taken); delete one first");
}

std::optional<std::string> Checkpointer::room_refusal(uint64_t needed, const std::string& what) const {
  auto space = os::free_room(snap_dir_);
  if (!space) return std::nullopt;  // unknown: the write says
  uint64_t free = space->bytes;
  uint64_t room = host_.journal_room();
  if (free >= room && free - room >= needed) return std::nullopt;
  return "the state dir's filesystem has " + std::to_string(free) + " bytes free, less than " +
         (needed ? std::to_string(needed) + " for " + what + " and " : std::string("the ")) + std::to_string(room) +
         " kept for the journal first (what journal.disk_cap still allows it, or 16 MiB without a cap): "
         "delete snapshots, lower checkpoint.keep, or give the state dir more space";
}

os::CopyBound Checkpointer::room_bound(bool journal) const {
  os::CopyBound b{.keep_inodes = kJournalInodes,
                  .inodes_what = "the inodes the state dir's filesystem keeps free for the journal"};
  if (!journal) {
    b.keep_bytes = 0;
    b.keep_what = "the state dir's free space (a checkpoint that ends its agent may take the journal's room, not more)";
    return b;
  }
  b.keep_bytes = host_.journal_room();
  b.keep_what = "the room kept for the journal (what journal.disk_cap still allows it, or 16 MiB without a cap)";
  return b;
}

std::optional<uint64_t> Checkpointer::ghost_room(bool journal) const {
  auto space = os::free_room(snap_dir_);
  if (!space) return std::nullopt;
  uint64_t keep = room_bound(journal).keep_bytes.value_or(0);
  return space->bytes > keep ? space->bytes - keep : 0;
}

int64_t Checkpointer::live_copies() const {
  int64_t n = copies_starting_;
  for (auto& b : host_.branches())
    if (b.name != "main" && !b.ended) ++n;
  return n;
}

std::optional<json::object> Checkpointer::copies_refusal(const std::string& branch, int n) {
  int64_t ceiling = settings_.max_copies;
  int64_t value = live_copies() + n;
  if (value <= ceiling) return std::nullopt;
  return limit_refusal(branch, "copies", value, ceiling,
                       "resources.copies: at most " + std::to_string(ceiling) +
                           " copies may run at once in this box (" + std::to_string(value - n) +
                           " running or starting, " + std::to_string(n) + " asked for)");
}

std::optional<json::object> Checkpointer::channel_refusal(const std::string& branch, const Lineage& lineage,
                                                          const std::string& id, bool to_delete) const {
  if (!archive::valid_snapshot_id(id)) return std::nullopt;  // the operation itself says what is wrong
  auto text = os::read_file(snap_dir_ + "/" + id + ".json");
  if (!text) return std::nullopt;  // no such snapshot: the operation says so
  boost::system::error_code ec;
  auto v = json::parse(*text, ec);
  const json::object* origin = nullptr;
  if (!ec && v.is_object())
    if (auto* o = v.as_object().if_contains("origin"); o && o->is_object()) origin = &o->as_object();
  auto field = [&](const char* k) {
    auto* v = origin ? origin->if_contains(k) : nullptr;
    return v && v->is_string() ? std::string(v->as_string()) : std::string();
  };
  bool own = field("by") == "channel" && field("branch") == branch;
  if (own) return std::nullopt;
  // The snapshot a copy was made from is its own past: it may make more copies of it, not delete it.
  if (!to_delete && id == lineage.snapshot) return std::nullopt;
  std::string whose = field("by") != "channel" ? std::string("the operator's") : "branch " + field("branch") + "'s";
  return error_reply("forbidden", "snapshot " + id + " is " + whose + ": the agent channel of branch " + branch +
                                      " may " + (to_delete ? "delete" : "restore or fork") +
                                      " only the snapshots it took itself" +
                                      (to_delete ? "" : " and the one it was restored from"));
}

json::array Checkpointer::list_for(const std::string& branch, const Lineage& lineage) const {
  json::array out;
  for (auto& v : list())
    if (!channel_refusal(branch, lineage, std::string(v.as_object().at("id").as_string()), false)) out.push_back(v);
  return out;
}

// ---- the store ----

json::array Checkpointer::list() const {
  json::array out;
  for (auto& id : ids_with(snap_dir_, ".json")) {
    auto text = os::read_file(snap_dir_ + "/" + id + ".json");
    boost::system::error_code ec;
    if (!text) continue;
    auto v = json::parse(*text, ec);
    if (ec || !v.is_object()) continue;
    auto& o = v.as_object();
    o.erase("files");
    o.erase("files_b64");
    out.push_back(std::move(v));
  }
  return out;
}

json::object Checkpointer::remove(const std::string& id) {
  if (!archive::valid_snapshot_id(id)) return error_reply("bad_request", "\"" + id + "\" is not a snapshot id");
  std::string base = snap_dir_ + "/" + id;
  struct stat st {};
  if (::stat((base + ".json").c_str(), &st) != 0 && ::stat((base + ".tar.zst").c_str(), &st) != 0)
    return error_reply("not_found", "no snapshot \"" + id + "\"");
  ::unlink((base + ".json").c_str());
  ::unlink((base + ".tar.zst").c_str());
  bool chunked = ::unlink((base + ".chunks").c_str()) == 0;
  os::remove_tree(base + ".d");
  host_.emit("main", {{"type", "snapshot.deleted"}, {"snapshot", id}});
  // Its chunks that no other snapshot shares go with it.
  if (chunked) collect_chunks();
  return {{"ok", true}};
}

// ---- the chunk store ----

namespace {
// The chunk list DIR/<id>.chunks, checked against the id (its manifest's hash; a format-2
// snapshot's archive's); nullopt when the snapshot has none.
std::optional<base::Result<archive::ChunkList>> read_chunk_list(const std::string& dir, const std::string& id) {
  auto text = os::read_file(dir + "/" + id + ".chunks");
  if (!text) return std::nullopt;
  boost::system::error_code ec;
  auto v = json::parse(*text, ec);
  if (ec)
    return base::Result<archive::ChunkList>(base::fail("the chunk list of " + id + " is not JSON", "bad_snapshot"));
  auto l = archive::chunk_list_from_json(v);
  if (l && archive::snapshot_id_of(l->id_sha256()) != id)
    return base::Result<archive::ChunkList>(
        base::fail("the chunk list of " + id + " is of another snapshot (" + l->id_sha256() + ")", "bad_snapshot"));
  return l;
}
}  // namespace

std::optional<base::Result<archive::ChunkList>> Checkpointer::chunk_list(const std::string& id) const {
  return read_chunk_list(snap_dir_, id);
}

void Checkpointer::collect_chunks() {
  if (chunk_writers_ > 0) {
    gc_pending_ = true;
    return;
  }
  gc_pending_ = false;
  std::unordered_set<std::string> live;
  DIR* d = ::opendir(snap_dir_.c_str());
  if (!d) return;
  std::vector<std::string> ids;
  while (auto* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n.size() > 7 && n.ends_with(".chunks")) ids.emplace_back(n.substr(0, n.size() - 7));
  }
  ::closedir(d);
  for (auto& id : ids) {
    auto l = chunk_list(id);
    // A list that cannot be read keeps the whole store: nothing is deleted on a guess.
    if (!l || !*l) {
      log()->warn("chunk store: not collected: {}", l ? (*l).error().message : id + ": unreadable");
      return;
    }
    for (auto& c : (*l)->chunks) live.insert(c.sha256);
  }
  // No store yet (a box that never kept a snapshot of its own): nothing to collect, nothing to say.
  if (struct stat st{}; ::stat(chunk_dir().c_str(), &st) != 0 && errno == ENOENT) return;
  auto r = archive::collect_garbage(chunk_dir(), live);
  if (!r) {
    log()->warn("chunk store: {}", r.error().message);
    return;
  }
  if (r->first.chunks > 0)
    log()->info("chunk store: {} chunks ({} bytes) freed, {} chunks ({} bytes) kept", r->first.chunks, r->first.bytes,
                r->second.chunks, r->second.bytes);
}

void Checkpointer::chunk_writer_done() {
  if (--chunk_writers_ == 0 && gc_pending_) collect_chunks();
}

archive::StoreUsage Checkpointer::chunk_usage() const { return archive::store_usage(chunk_dir()); }

void Checkpointer::export_archive(const std::string& id, ArchiveReady ready, const std::string& base,
                                  const std::string& lacks) {
  if (!archive::valid_snapshot_id(id))
    return ready(base::fail("\"" + id + "\" is not a snapshot id (s- and 16 hex digits)", "bad_request"), false);
  if (!base.empty() || !lacks.empty()) return export_delta(id, base, lacks, std::move(ready));
  std::string path = snap_dir_ + "/" + id + ".tar.zst";
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return ready(path, false);
  auto list = chunk_list(id);
  if (!list) return ready(base::fail("no snapshot \"" + id + "\"", "not_found"), false);
  if (!*list) return ready((*list).error(), false);
  // Kept as chunks: the archive is written anew from them (checked on the way), for this export.
  ++ops_;
  auto out = std::make_shared<base::Result<archive::ArchiveInfo>>(base::fail(""));
  std::string tmp = snap_dir_ + "/.export-" + os::random_hex(6);
  offload([out, tmp, store = chunk_dir(), l = std::move(**list)] { *out = archive::rebuild_archive(store, l, tmp, 3); },
          [this, out, tmp, ready = std::move(ready)] {
            if (*out)
              ready(tmp, true);
            else
              ready(base::fail("export: " + out->error().message, out->error().code), false);
            op_done();
          });
}

std::string Checkpointer::incoming_path() const {
  (void)os::make_dirs(snap_dir_, 0700);
  return snap_dir_ + "/.import-" + os::random_hex(6);
}

void Checkpointer::import_archive(const std::string& tmp, Reply done, bool announce, const std::string& from) {
  // An import is one more snapshot kept (not a box's own start from an archive: its store is new).
  if (announce)
    if (auto refusal = snapshots_refusal("main")) {
      ::unlink(tmp.c_str());
      return done(std::move(*refusal));
    }
  // A delta (snapshot.export with a base) goes into the chunk store beside its base.
  if (from.empty() && archive::is_delta(tmp)) return import_delta(tmp, std::move(done), announce);
  auto policy = import_policy();
  if (!policy) {
    ::unlink(tmp.c_str());
    return done(error_reply(policy.error().code, policy.error().message));
  }
  ++ops_;
  struct State {
    base::Result<Filed> filed = base::fail("", "bad_snapshot");
    uint64_t bytes = 0;
  };
  auto st = std::make_shared<State>();
  offload(
      [tmp, from, dir = snap_dir_, st, policy = std::move(*policy)] {
        struct stat sb {};
        if (::stat((from.empty() ? tmp : from).c_str(), &sb) == 0) st->bytes = static_cast<uint64_t>(sb.st_size);
        // Verified whole here (its signature, every entry against the manifest, the format
        // version), so an untrusted, corrupted or truncated upload is refused now and not at its
        // first restore; the extraction stays for that restore.
        st->filed = extract_and_file(tmp, dir, policy, from);
      },
      [this, tmp, st, announce, done = std::move(done)] {
        if (!st->filed) {
          ::unlink(tmp.c_str());
          const std::string& e = st->filed.error().message;
          log()->warn("import refused: {}", e);
          done(error_reply(st->filed.error().code,
                           e.starts_with("the archive is refused") ? e : "the archive is refused: " + e));
          return op_done();
        }
        Filed& f = *st->filed;
        std::string base = snap_dir_ + "/" + f.id;
        if (f.linked) unshare_archive(base + ".tar.zst", f.linked_stat);
        json::object index = std::move(f.manifest);
        index["archive"] = {{"path", base + ".tar.zst"}, {"bytes", st->bytes}};
        imported(f.id, std::move(index), {{"bytes", st->bytes}, {"existing", f.existing}}, announce, done);
      });
}

void Checkpointer::unshare_archive(const std::string& path, const struct stat& filed) {
  ++ops_;
  auto why = std::make_shared<std::string>();
  offload(
      [path, filed, why, tmp = snap_dir_ + "/.work-own-" + os::random_hex(6)] {
        auto unchanged = [&] {
          struct stat now {};
          return ::stat(path.c_str(), &now) == 0 && same_file(now, filed);
        };
        auto c = os::copy_tree(path, tmp);
        if (c && unchanged() && ::rename(tmp.c_str(), path.c_str()) == 0) return;
        *why = c ? "the operator's file changed after it was restored" : c.error().message;
        ::unlink(tmp.c_str());
        if (!unchanged()) ::unlink(path.c_str());  // not what was checked: no archive rather than a wrong one
      },
      [this, path, why] {
        if (!why->empty()) log()->warn("{}: the store's own copy was not made: {}", path, *why);
        op_done();
      });
}

void Checkpointer::imported(const std::string& id, json::object index, json::object what, bool announce,
                            const Reply& done) {
  std::string base = snap_dir_ + "/" + id;
  bool existing = what.at("existing").as_bool();
  index["id"] = id;
  index.erase("files");
  index.erase("files_b64");
  index["imported"] = base::rfc3339_now();
  if (!existing) (void)os::write_file_atomic(base + ".json", json::serialize(index) + "\n");
  auto* v = index.if_contains("verified");
  json::value trusted = v && v->is_object() && v->as_object().contains("trusted") ? v->at("trusted") : false;
  json::value signer = v && v->is_object() && v->as_object().contains("key") ? v->at("key") : nullptr;
  json::object r{{"ok", true}, {"snapshot", id}, {"trusted", trusted}, {"signed_by", signer}};
  for (auto& kv : what) r[kv.key()] = kv.value();
  if (announce) {
    // `box` is the importing box's, as on every event; the snapshot's own box is `from_box`.
    json::object ev{{"type", "snapshot.imported"},
                    {"from_box", index.contains("box") ? index.at("box") : json::value(nullptr)}};
    for (auto& kv : r)
      if (kv.key() != "ok") ev[kv.key()] = kv.value();
    host_.emit("main", std::move(ev));
  }
  r["mode"] = index.contains("mode") ? index.at("mode") : json::value(nullptr);
  if (trusted != true) r["note"] = "untrusted, accepted under --allow-unsigned: it restores cold, files only";
  done(std::move(r));
  op_done();
}

// ---- deltas ----

namespace {

// The chunk list of snapshot `id` of the store `dir`: its own, or (a snapshot kept as an archive)
// the archive cut into chunks now and listed beside it. On the thread pool, counted as a writer.
base::Result<archive::ChunkList> chunks_of(const std::string& dir, const std::string& id) {
  std::string base = dir + "/" + id;
  if (auto l = read_chunk_list(dir, id)) return std::move(*l);
  struct stat st {};
  if (::stat((base + ".tar.zst").c_str(), &st) != 0) return base::fail("no snapshot \"" + id + "\"", "not_found");
  auto l = archive::chunk_archive(base + ".tar.zst", dir + "/chunks");
  if (!l) return l.error();
  if (auto w = os::write_file_atomic(base + ".chunks", json::serialize(archive::to_json(*l))); !w)
    return base::fail("store the chunk list of " + id + ": " + w.error().message());
  return l;
}

}  // namespace

void Checkpointer::export_delta(const std::string& id, const std::string& base, const std::string& lacks,
                                ArchiveReady ready) {
  if (!base.empty() && !lacks.empty())
    return ready(base::fail("base and lacks exclude each other", "bad_request"), false);
  if (lacks.empty() && !archive::valid_snapshot_id(base))
    return ready(base::fail("base \"" + base + "\" is not a snapshot id (s- and 16 hex digits)", "bad_request"), false);
  ++ops_;
  ++chunk_writers_;
  auto out = std::make_shared<base::Result<uint64_t>>(base::fail(""));
  std::string tmp = snap_dir_ + "/.export-" + os::random_hex(6);
  offload(
      [out, tmp, id, base, lacks, dir = snap_dir_, store = chunk_dir()] {
        auto mine = chunks_of(dir, id);
        if (mine && !lacks.empty()) {
          *out = archive::write_delta_for(store, id, *mine, lacks, tmp);
          return;
        }
        auto theirs = mine ? chunks_of(dir, base) : mine;
        if (!mine || !theirs) {
          base::Error e = !mine ? mine.error() : theirs.error();
          *out = base::fail(e.message, e.code);
          return;
        }
        *out = archive::write_delta(store, id, *mine, base, *theirs, tmp);
      },
      [this, out, tmp, ready = std::move(ready)] {
        chunk_writer_done();
        if (*out)
          ready(tmp, true);
        else
          ready(base::fail("export: " + out->error().message, out->error().code), false);
        op_done();
      });
}

namespace {
// The size of snapshot `id`'s archive in `dir` when it has no chunk list yet (cutting it into the
// store takes about as much again), else 0.
uint64_t uncut_bytes(const std::string& dir, const std::string& id) {
  struct stat st {};
  if (::stat((dir + "/" + id + ".chunks").c_str(), &st) == 0) return 0;
  return ::stat((dir + "/" + id + ".tar.zst").c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}
}  // namespace

void Checkpointer::chunk_page(const std::string& id, uint64_t from, Reply done) {
  if (!archive::valid_snapshot_id(id))
    return done(error_reply("bad_request", "\"" + id + "\" is not a snapshot id (s- and 16 hex digits)"));
  if (auto why = room_refusal(uncut_bytes(snap_dir_, id), "cutting " + id + " into chunks"))
    return done(error_reply("no_space", "snapshot.chunks refused: " + *why));
  ++ops_;
  ++chunk_writers_;
  auto out = std::make_shared<base::Result<archive::ChunkList>>(base::fail(""));
  offload([out, id, dir = snap_dir_] { *out = chunks_of(dir, id); },
          [this, out, id, from, done = std::move(done)] {
            chunk_writer_done();
            op_done();
            if (!*out) return done(error_reply(out->error().code, out->error().message));
            uint64_t n = (*out)->chunks.size();
            if (from > n)
              return done(error_reply("bad_request", "from " + std::to_string(from) + " is past snapshot " + id +
                                                         "'s " + std::to_string(n) + " chunks"));
            uint64_t count = std::min<uint64_t>(kChunkPage, n - from);
            json::value next = from + count < n ? json::value(from + count) : json::value(nullptr);
            done({{"ok", true},
                  {"snapshot", id},
                  {"chunks", n},
                  {"from", from},
                  {"count", count},
                  {"hashes", base::base64_encode(archive::raw_hashes(**out, from, count))},
                  {"next", next}});
          });
}

void Checkpointer::lacks(std::string hashes, Reply done) {
  // A snapshot kept here as an archive has chunks too: cut into the store once (a delta against it
  // would do the same), they count as had; unless that would take the journal's room, when the
  // answer is the store's as it is (the sender then sends more).
  std::vector<std::string> ids;
  uint64_t needed = 0;
  for (auto& id : ids_with(snap_dir_, ".tar.zst"))
    if (uint64_t b = uncut_bytes(snap_dir_, id)) {
      needed += b;
      ids.push_back(id);
    }
  if (auto why = ids.empty() ? std::nullopt : room_refusal(needed, "cutting archived snapshots into chunks")) {
    log()->info("snapshot.lacks: {} archived snapshots not counted: {}", ids.size(), *why);
    ids.clear();
  }
  ++ops_;
  ++chunk_writers_;
  auto out = std::make_shared<base::Result<archive::Lacking>>(base::fail(""));
  uint64_t count = hashes.size() / archive::kRawHash;
  offload(
      [out, hashes = std::move(hashes), ids = std::move(ids), dir = snap_dir_, store = chunk_dir()] {
        for (auto& id : ids)
          if (auto l = chunks_of(dir, id); !l) log()->warn("snapshot.lacks: {} not counted: {}", id, l.error().message);
        *out = archive::lacking(store, hashes);
      },
      [this, out, count, done = std::move(done)] {
        chunk_writer_done();
        op_done();
        if (!*out) return done(error_reply(out->error().code, out->error().message));
        done(
            {{"ok", true}, {"count", count}, {"lacking", (*out)->count}, {"lacks", base::base64_encode((*out)->bits)}});
      });
}

void Checkpointer::import_delta(const std::string& tmp, Reply done, bool announce) {
  ++ops_;
  ++chunk_writers_;
  struct State {
    base::Error err{"", ""};
    std::string id, base;
    archive::ChunkList list;
    uint64_t bytes = 0, added = 0;
    bool existing = false;
  };
  auto st = std::make_shared<State>();
  offload(
      [tmp, st, dir = snap_dir_, store = chunk_dir()] {
        struct stat sb {};
        if (::stat(tmp.c_str(), &sb) == 0) st->bytes = static_cast<uint64_t>(sb.st_size);
        auto h = archive::read_delta_header(tmp);
        if (!h) return void(st->err = h.error());
        // A delta of no base leaves out the chunks this box said it had (snapshot.lacks).
        if (!archive::valid_snapshot_id(h->snapshot) || (!h->base.empty() && !archive::valid_snapshot_id(h->base)))
          return void(st->err = base::fail("the delta is refused: its snapshot or base is not an id", "bad_snapshot"));
        st->base = h->base;
        // A base kept here as an archive is cut into chunks first: the delta names its chunks.
        struct stat bs {};
        if (!h->base.empty() && ::stat((dir + "/" + h->base + ".json").c_str(), &bs) == 0)
          if (auto b = chunks_of(dir, h->base); !b) return void(st->err = b.error());
        auto added = archive::store_delta_chunks(tmp, *h, store);
        if (!added) return void(st->err = added.error());
        st->added = *added;
        // The id: the hash of the manifest these chunks begin with, checked as they are extracted
        // (below); a format-2 snapshot's, the archive they make, hashed as an export writes it.
        if (archive::snapshot_id_of(h->list.id_sha256()) != h->snapshot)
          return void(st->err = base::fail("the delta is refused: its list names snapshot " +
                                               archive::snapshot_id_of(h->list.id_sha256()) + ", not " + h->snapshot,
                                           "bad_snapshot"));
        if (h->list.manifest_sha256.empty()) {
          auto a = archive::rebuild_archive(store, h->list, "", 3);
          if (!a) return void(st->err = a.error());
          if (archive::snapshot_id_of(a->sha256) != h->snapshot)
            return void(st->err = base::fail("the delta is refused: its chunks make snapshot " +
                                                 archive::snapshot_id_of(a->sha256) + ", not " + h->snapshot,
                                             "bad_snapshot"));
        }
        st->id = h->snapshot;
        st->list = std::move(h->list);
        st->existing = ::stat((dir + "/" + st->id + ".json").c_str(), &bs) == 0;
        if (!st->existing)
          if (auto w =
                  os::write_file_atomic(dir + "/" + st->id + ".chunks", json::serialize(archive::to_json(st->list)));
              !w)
            st->err = base::fail("store the chunk list: " + w.error().message());
      },
      [this, tmp, st, announce, done = std::move(done)] {
        chunk_writer_done();
        ::unlink(tmp.c_str());
        auto refuse = [this, st, done](const base::Error& e) {
          if (!st->existing && !st->id.empty()) ::unlink((snap_dir_ + "/" + st->id + ".chunks").c_str());
          collect_chunks();
          log()->warn("import refused: {}", e.message);
          done(error_reply(e.code, e.message));
          op_done();
        };
        if (!st->err.message.empty()) return refuse(st->err);
        // Checked whole as an archive is (signature, every entry against the manifest).
        with_extracted(st->id, [this, st, announce, done, refuse](base::Result<json::object> m) {
          if (!m) return refuse(base::fail("the delta is refused: " + m.error().message, m.error().code));
          json::object index = *m;
          index["archive"] = {{"stored", "chunks"},
                              {st->list.manifest_sha256.empty() ? "sha256" : "manifest_sha256", st->list.id_sha256()},
                              {"bytes", st->list.stored_bytes},
                              {"chunks", st->list.chunks.size()}};
          if (!st->list.sha256.empty()) index["archive"].as_object()["tar_sha256"] = st->list.sha256;
          imported(st->id, std::move(index),
                   {{"bytes", st->bytes},
                    {"existing", st->existing},
                    {"base", st->base.empty() ? json::value(nullptr) : json::value(st->base)},
                    {"added_bytes", st->added}},
                   announce, done);
        });
      });
}

}  // namespace sbx::checkpoint
