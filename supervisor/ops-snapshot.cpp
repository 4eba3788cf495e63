// The ops on checkpoints and snapshots: checkpoint, restore, fork, snapshot.list, snapshot.export,
// snapshot.import, snapshot.chunks, snapshot.lacks, snapshot.delete (server-ops.hpp). The Box (and checkpoint/ behind
// it) does the work and answers with {"ok": ..., ...} when done: those replies go through OpContext::later().
#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

#include "base/encoding.hpp"
#include "protocol/protocol.hpp"
#include "supervisor/server-ops.hpp"

namespace sbx::supervisor {

using protocol::RequestError;

void op_checkpoint(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto branch = protocol::opt_string(f, "branch").value_or("main");
  if (!ctx.box.has_branch(branch)) throw RequestError("no_such_branch", "no branch named " + branch);
  auto name = protocol::opt_string(f, "name").value_or("");
  // `hold_ms`: the tree stays stopped after the snapshot, until checkpoint.release or that long.
  if (auto hold = protocol::opt_int(f, "hold_ms", 1, 600000)) {
    if (f.contains("leave_running"))
      throw RequestError("bad_request", "hold_ms and leave_running exclude each other (release decides)");
    return ctx.box.checkpoint_held(branch, name, *hold, ctx.later());
  }
  ctx.box.checkpoint(branch, name, protocol::opt_bool(f, "leave_running").value_or(true), ctx.later());
}

void op_checkpoint_release(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto branch = protocol::opt_string(f, "branch").value_or("main");
  ctx.later()(ctx.box.checkpoint_release(branch, protocol::opt_bool(f, "end").value_or(false)));
}

namespace {

// A restore's `from`: told by the caller, so kept short and printable (it lands in the journal).
std::string restore_from(const boost::json::object& f) {
  auto from = protocol::opt_string(f, "from").value_or("");
  if (from.size() > 1024) throw RequestError("bad_request", "field from: longer than 1024 bytes");
  for (unsigned char c : from)
    if (c < 0x20 || c == 0x7f) throw RequestError("bad_request", "field from: a control character");
  return from;
}

}  // namespace

void op_restore(OpContext& ctx) {
  auto snap = protocol::need_string(ctx.fields(), "snapshot");
  // `index`: an idle box becomes that copy of the snapshot (fork and migrate onto new boxes);
  // `from`, where the caller says it came from (the source box's URL), is named in restore.done.
  if (auto index = protocol::opt_int(ctx.fields(), "index", 0, 1023))
    return ctx.box.restore_as_copy(snap, static_cast<int>(*index), ctx.later(), restore_from(ctx.fields()));
  if (ctx.fields().contains("from")) throw RequestError("bad_request", "field from: only with index");
  ctx.box.restore(snap, 1, false, ctx.later());
}

void op_fork(OpContext& ctx) {
  const auto& f = ctx.fields();
  int n = static_cast<int>(protocol::opt_int(f, "n", 1, 64).value_or(1));
  // `branch`: a live checkpoint of it and its copies at once, the copies started from the dump's
  // images before the archive is sealed; `snapshot`: copies of a snapshot the box has.
  if (auto branch = protocol::opt_string(f, "branch")) {
    if (f.contains("snapshot")) throw RequestError("bad_request", "fork takes a snapshot or a branch, not both");
    if (!ctx.box.has_branch(*branch)) throw RequestError("no_such_branch", "no branch named " + *branch);
    return ctx.box.fork_branch(*branch, protocol::opt_string(f, "name").value_or(""), n, ctx.later());
  }
  if (f.contains("name")) throw RequestError("bad_request", "field name: only with branch (it names the checkpoint)");
  ctx.box.restore(protocol::need_string(f, "snapshot"), n, true, ctx.later());
}

void op_snapshot_list(OpContext& ctx) {
  auto ok = ctx.ok();
  ok["snapshots"] = ctx.box.snapshot_list();
  ctx.reply(ok);
}

namespace {

// A base64 field of raw bytes (snapshot.lacks' hashes, snapshot.export's lacks): decoded, or a
// bad_request naming it.
std::optional<std::string> opt_base64(const boost::json::object& f, const char* name) {
  auto text = protocol::opt_string(f, name);
  if (!text) return std::nullopt;
  std::string raw;
  if (!base::base64_decode(*text, raw))
    throw RequestError("bad_request", std::string("field ") + name + ": not base64");
  if (raw.empty()) throw RequestError("bad_request", std::string("field ") + name + ": empty");
  return raw;
}

}  // namespace

void op_snapshot_export(OpContext& ctx) {
  uint32_t bid = ctx.binary_id("snapshot.export");
  ctx.open_transfer();
  auto snap = protocol::need_string(ctx.fields(), "snapshot");
  // `base`: only the chunks a box that has that snapshot lacks (a delta, checkpoint/README.md);
  // `lacks`: only the chunks a box said it lacks (snapshot.lacks' answer to snapshot.chunks').
  auto base = protocol::opt_string(ctx.fields(), "base").value_or("");
  auto lacks = opt_base64(ctx.fields(), "lacks").value_or("");
  if (!base.empty() && !lacks.empty()) throw RequestError("bad_request", "base and lacks exclude each other");
  // A snapshot kept in the chunk store has its archive written first, on the thread pool.
  ctx.box.snapshot_archive(
      snap,
      [snap, base, start = ctx.later_download(bid), refuse = ctx.later()](base::Result<std::string> path,
                                                                          bool temporary) {
        if (!path)
          return refuse({{"ok", false}, {"error", {{"code", path.error().code}, {"message", path.error().message}}}});
        os::UniqueFd fd(::open(path->c_str(), O_RDONLY | O_CLOEXEC));
        int err = errno;
        if (temporary) ::unlink(path->c_str());  // the open fd keeps it until the download ends
        struct stat st {};
        if (!fd || ::fstat(fd.get(), &st) != 0)
          return refuse(
              {{"ok", false}, {"error", {{"code", "io_error"}, {"message", *path + ": " + std::strerror(err)}}}});
        auto size = static_cast<uint64_t>(st.st_size);
        // The archive follows in binary frames with the request's id, the last one flagged.
        boost::json::object ok{{"ok", true}, {"snapshot", snap}, {"size", size}, {"length", size}};
        if (!base.empty()) ok["base"] = base;
        start(std::move(ok), std::move(fd), size);
      },
      base, lacks);
}

void op_snapshot_chunks(OpContext& ctx) {
  auto snap = protocol::need_string(ctx.fields(), "snapshot");
  auto from = protocol::opt_int(ctx.fields(), "from", 0, int64_t{1} << 40).value_or(0);
  ctx.box.snapshot_chunks(snap, static_cast<uint64_t>(from), ctx.later());
}

void op_snapshot_lacks(OpContext& ctx) {
  auto hashes = opt_base64(ctx.fields(), "hashes");
  if (!hashes) throw RequestError("bad_request", "snapshot.lacks needs hashes: base64 of raw 32-byte chunk hashes");
  ctx.box.snapshot_lacks(std::move(*hashes), ctx.later());
}

void op_snapshot_import(OpContext& ctx) {
  Client& c = ctx.client;
  uint32_t bid = ctx.binary_id("snapshot.import");
  if (c.uploads.contains(bid))
    throw RequestError("bad_request", "an upload with id " + std::to_string(bid) + " is in progress");
  auto size = protocol::opt_int(ctx.fields(), "size", 1, INT64_MAX);
  if (!size) throw RequestError("bad_request", "snapshot.import needs size: the archive's length in bytes (> 0)");
  c.failed_uploads.insert(bid);  // until the file is open, its frames are dropped
  ctx.open_transfer();
  TempPath tmp(ctx.box.snapshot_incoming_path());
  std::string dir = tmp.path.substr(0, tmp.path.rfind('/'));
  // The archive and its extraction, and after them the journal's room (issue 16: a snapshot never
  // takes the space the journal is promised).
  uint64_t room = ctx.box.journal_room_for_snapshots();
  auto space = os::free_room(dir);
  if (space && (static_cast<uint64_t>(*size) > (UINT64_MAX - room) / 2 ||  // no wrap: 2^63-1 once passed
                space->bytes < static_cast<uint64_t>(*size) * 2 + room))
    throw RequestError("no_space", "snapshot.import: " + std::to_string(*size) + " bytes announced, " +
                                       std::to_string(space->bytes) + " free in " + dir +
                                       " (the archive and its extraction need twice that, and " + std::to_string(room) +
                                       " are kept for the journal first)");
  os::UniqueFd fd(::open(tmp.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) throw RequestError("io_error", tmp.path + ": " + std::strerror(errno));
  c.failed_uploads.erase(bid);
  Upload u{std::move(fd), "snapshot", 0, ctx.req.id};
  u.archive = std::move(tmp);
  u.expected = static_cast<uint64_t>(*size);
  c.uploads[bid] = std::move(u);
  // The reply comes once the archive is checked and filed (Server::Impl::import_uploaded).
}

void op_snapshot_delete(OpContext& ctx) {
  // The snapshot is named by `snapshot`: a field `id` would be the request's own id.
  ctx.later()(ctx.box.snapshot_delete(protocol::need_string(ctx.fields(), "snapshot")));
}

}  // namespace sbx::supervisor
