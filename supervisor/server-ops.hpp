#pragma once
// Internal to the WebSocket server: the ops of the protocol (tests/protocol/README.md), one small
// function each, in files by area:
//
//   ops-box.cpp       auth, ping, subscribe, unsubscribe, stats, shutdown
//   ops-proc.cpp      exec, stdin, signal, resize
//   ops-fs.cpp        fs.read, fs.write, fs.list, fs.stat, fs.remove, fs.mkdir, fs.rename,
//                     fs.symlink, fs.chmod
//   ops-snapshot.cpp  checkpoint, restore, fork, snapshot.list/export/import/delete
//
// server.cpp holds the table (op name -> function) and the one boundary that runs an op: an op
// throws protocol::RequestError to refuse a request (the reply is that error, with the request's
// id) and anything else escaping it becomes an `internal` reply (docs/errors.md, section 3).
#include <boost/json.hpp>
#include <cstdint>
#include <functional>
#include <string_view>

#include "protocol/protocol.hpp"
#include "supervisor/box.hpp"
#include "supervisor/fs-ops.hpp"
#include "supervisor/server-client.hpp"
#include "supervisor/server.hpp"

namespace sbx::supervisor {

/// What an op works on: the box, the client that asked, its request, and the ways to answer.
/// Lives for one call of the op; what must outlive it (an answer given later) goes through
/// later() or sender(), which find the client again by id and drop the answer if it has gone.
struct OpContext {
  Server::Impl& server;
  Box& box;
  Client& client;
  const protocol::Request& req;

  const boost::json::object& fields() const { return req.fields; }
  /// {"id": <the request's id>, "ok": true}, for the op to add to.
  boost::json::object ok() const { return protocol::ok_reply(req.id); }
  /// Sends a frame to the client now.
  void reply(const boost::json::object& frame);
  /// Answers later with the body the Box gives ({"ok": ..., ...}, "ok" true unless it says).
  Box::Reply later();
  /// Starts a download later, if the client is still connected: the reply `ok` (a success
  /// with the request's id), then `fd`'s `size` bytes in binary frames with id `bid`.
  std::function<void(boost::json::object ok, os::UniqueFd fd, uint64_t size)> later_download(uint32_t bid);
  /// Sends a whole frame later, if the client is still connected.
  std::function<void(const boost::json::object&)> sender();
  /// Asks libwebsockets for a writable callback: queued downloads and replays go out from there.
  void wake();
  bool token_ok(std::string_view token) const;
  /// The directories of the branch named by the request's `branch` (default main).
  FsRoots roots() const;
  /// A page of fs.list, through the server's ListWindows.
  ListPage list_page(const std::string& path, size_t limit, const std::string& after);
  /// The request's id as the u32 of binary frames; refuses any other id (`op` names the op).
  uint32_t binary_id(const char* op) const;
  /// Refuses (`limit`) a new transfer (fs.read, fs.write, snapshot.import, snapshot.export) past
  /// kMaxTransfers open on this connection, or past a quarter of RLIMIT_NOFILE on all of them:
  /// each holds an fd or two until its last frame.
  void open_transfer() const;
};

inline constexpr size_t kMaxTransfers = 256;

using OpFn = void (*)(OpContext&);

// The ops, named op_<op> with '.' as '_'.
// ops-box.cpp
void op_auth(OpContext& ctx);
void op_ping(OpContext& ctx);
void op_subscribe(OpContext& ctx);
void op_unsubscribe(OpContext& ctx);
void op_stats(OpContext& ctx);
void op_shutdown(OpContext& ctx);
// ops-proc.cpp
void op_exec(OpContext& ctx);
void op_stdin(OpContext& ctx);
void op_signal(OpContext& ctx);
void op_resize(OpContext& ctx);
// ops-fs.cpp
void op_fs_read(OpContext& ctx);
void op_fs_write(OpContext& ctx);
void op_fs_list(OpContext& ctx);
void op_fs_stat(OpContext& ctx);
void op_fs_remove(OpContext& ctx);
void op_fs_mkdir(OpContext& ctx);
void op_fs_rename(OpContext& ctx);
void op_fs_symlink(OpContext& ctx);
void op_fs_chmod(OpContext& ctx);
// ops-snapshot.cpp
void op_checkpoint(OpContext& ctx);
void op_checkpoint_release(OpContext& ctx);
void op_restore(OpContext& ctx);
void op_fork(OpContext& ctx);
void op_snapshot_list(OpContext& ctx);
void op_snapshot_export(OpContext& ctx);
void op_snapshot_import(OpContext& ctx);
void op_snapshot_chunks(OpContext& ctx);
void op_snapshot_lacks(OpContext& ctx);
void op_snapshot_delete(OpContext& ctx);

}  // namespace sbx::supervisor
