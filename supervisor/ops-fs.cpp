// The ops on a branch's files: fs.read, fs.write, fs.list, fs.stat, fs.remove, fs.mkdir, fs.rename,
// fs.symlink, fs.chmod
// (server-ops.hpp). Paths are resolved inside the branch's /workspace and /tmp by fs-ops.cpp.
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

#include "base/encoding.hpp"
#include "os/sys.hpp"
#include "protocol/protocol.hpp"
#include "supervisor/server-ops.hpp"

namespace sbx::supervisor {

using protocol::RequestError;

void op_fs_read(OpContext& ctx) {
  const auto& f = ctx.fields();
  uint32_t bid = ctx.binary_id("fs.read");
  auto path = protocol::need_path(f, "path");
  auto roots = ctx.roots();
  ctx.open_transfer();
  auto fd = fs_open_file(roots, path, O_RDONLY);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw RequestError("io_error", path + ": " + std::strerror(errno));
  uint64_t size = static_cast<uint64_t>(st.st_size);
  uint64_t offset = static_cast<uint64_t>(protocol::opt_int(f, "offset", 0, INT64_MAX).value_or(0));
  if (offset > size) offset = size;
  uint64_t length = static_cast<uint64_t>(protocol::opt_int(f, "length", 0, INT64_MAX).value_or(INT64_MAX));
  auto ok = ctx.ok();
  ok["size"] = size;
  ok["length"] = std::min(length, size - offset);
  ctx.reply(ok);
  // The content follows in binary frames with the request's id, written as the client takes them.
  ctx.client.downloads.push_back({ctx.req.id, bid, std::move(fd), offset, std::min(length, size - offset)});
  ctx.wake();
}

void op_fs_write(OpContext& ctx) {
  const auto& f = ctx.fields();
  Client& c = ctx.client;
  auto path = protocol::need_path(f, "path");
  auto roots = ctx.roots();
  auto given_mode = protocol::opt_int(f, "mode", 0, 07777);
  auto mode = static_cast<mode_t>(given_mode.value_or(0644));
  bool append = protocol::opt_bool(f, "append").value_or(false);
  bool atomic = protocol::opt_bool(f, "atomic").value_or(false);
  if (atomic && append) throw RequestError("bad_request", "field atomic: not with append (a replacement is whole)");
  std::optional<std::string> inline_data;
  if (auto d = protocol::opt_string(f, "data")) inline_data = *d;
  if (auto b = protocol::opt_string(f, "data_b64")) {
    std::string raw;
    if (!base::base64_decode(*b, raw)) throw RequestError("bad_request", "field data_b64: not valid base64");
    inline_data = std::move(raw);
  }
  uint32_t bid = 0;
  if (!inline_data) {
    bid = ctx.binary_id("fs.write");
    if (c.uploads.contains(bid))
      throw RequestError("bad_request", "an fs.write with id " + std::to_string(bid) + " is in progress");
    c.failed_uploads.insert(bid);  // until the open succeeds, its frames are dropped
  }
  if (!inline_data) ctx.open_transfer();
  bool created = false;
  MadeFile made;
  os::UniqueFd fd;
  if (atomic) {
    auto m = given_mode ? std::optional<mode_t>(static_cast<mode_t>(*given_mode)) : std::nullopt;
    fd = fs_open_replacement(roots, path, m, made);
  } else {
    fd = fs_open_file(roots, path, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), mode, &created);
    if (created) made = MadeFile::of(roots, path, fd.get());
  }
  if (inline_data) {
    if (auto w = os::write_all(fd.get(), *inline_data); !w)
      throw RequestError("io_error", "write " + path + ": " + w.error().message());
    if (auto e = made.commit()) throw RequestError("io_error", "replace " + path + ": " + *e);
    auto ok = ctx.ok();
    ok["size"] = inline_data->size();
    base::put_bytes_field(ok, "path", path);
    return ctx.reply(ok);
  }
  c.failed_uploads.erase(bid);
  Upload& u = c.uploads[bid] = Upload{std::move(fd), path, 0, ctx.req.id};
  u.made = std::move(made);
  // The reply comes with the last binary frame (Server::Impl::on_binary).
}

void op_fs_stat(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto st = fs_stat(ctx.roots(), protocol::need_path(f, "path"), protocol::opt_bool(f, "follow").value_or(true));
  auto ok = ctx.ok();
  for (auto& kv : st) ok[kv.key()] = kv.value();
  ctx.reply(ok);
}

// With `limit`, a page: the entries sorted by name (bytes), the first `limit` past `after` (a
// name, or its bytes in after_b64), and `more`; what was read for it serves the next page
// (ListWindows). Without it, the whole directory in one reply.
void op_fs_list(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto path = protocol::opt_path(f, "path").value_or("/workspace");
  auto limit = protocol::opt_int(f, "limit", 1, kMaxListLimit);
  auto after = protocol::opt_path(f, "after");
  if (after && !limit) throw RequestError("bad_request", "field after: only with limit (a page of the listing)");
  auto ok = ctx.ok();
  if (!limit) {
    ok["entries"] = fs_list(ctx.roots(), path);
  } else {
    auto page = ctx.list_page(path, static_cast<size_t>(*limit), after.value_or(""));
    ok["entries"] = std::move(page.entries);
    ok["more"] = page.more;
  }
  ctx.reply(ok);
}

void op_fs_remove(OpContext& ctx) {
  const auto& f = ctx.fields();
  fs_remove(ctx.roots(), protocol::need_path(f, "path"), protocol::opt_bool(f, "recursive").value_or(false));
  ctx.reply(ctx.ok());
}

void op_fs_mkdir(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto mode = static_cast<mode_t>(protocol::opt_int(f, "mode", 0, 07777).value_or(0755));
  fs_mkdir(ctx.roots(), protocol::need_path(f, "path"), mode);
  ctx.reply(ctx.ok());
}

void op_fs_symlink(OpContext& ctx) {
  const auto& f = ctx.fields();
  // The text as JSON text (UTF-8), or its bytes in target_b64 (as fs.list and fs.stat give a
  // text that is not UTF-8).
  fs_symlink(ctx.roots(), protocol::need_path(f, "path"), protocol::need_path(f, "target"));
  ctx.reply(ctx.ok());
}

void op_fs_chmod(OpContext& ctx) {
  const auto& f = ctx.fields();
  auto mode = protocol::opt_int(f, "mode", 0, 07777);
  if (!mode) throw RequestError("bad_request", "field mode: missing (the permission bits, 0 to 0o7777)");
  fs_chmod(ctx.roots(), protocol::need_path(f, "path"), static_cast<mode_t>(*mode));
  ctx.reply(ctx.ok());
}

void op_fs_rename(OpContext& ctx) {
  const auto& f = ctx.fields();
  fs_rename(ctx.roots(), protocol::need_path(f, "from"), protocol::need_path(f, "to"),
            protocol::opt_bool(f, "replace").value_or(false));
  ctx.reply(ctx.ok());
}

}  // namespace sbx::supervisor
