#pragma once
// One snapshot moved from a source box into N target boxes over the box API, read from the
// source once (issue 17: fork and migrate on any host, no filesystem shared with the boxes).
//
// - The source's snapshot.export arrives in binary frames, each written to a spool file here and
//   hashed as it comes; every target's snapshot.import is fed from the spool at that target's own
//   pace (one 1 MiB frame at a time, written as its socket takes it), so a slow target holds back
//   neither the source nor the others and memory stays flat whatever the archive's size.
// - The connections are Boost.Beast's, on an io_context the relay runs on a thread of its own
//   (sdk/cpp's beast.hpp says why not libwebsockets' client); the caller's libuv loop learns the
//   outcome through a uv_async handle (on_done).
// - Targets may join while the archive is still arriving (boxes that are still starting).
// - A target gets the frame that ends its upload only once the whole archive has arrived and
//   hashes to the snapshot's id. A source that fails or is cut off leaves every target with an
//   upload that never ended: the box discards it when the connection closes (server.cpp), so a
//   partial archive is never imported.
// - Each outcome is reported: the source's (the export's reply, or why it failed) and each
//   target's (its snapshot.import reply, or why it failed). One target's failure is its own.
// - With a DeltaPlan (plan_delta), the export is a delta: only the chunks the targets said they
//   lack (snapshot.lacks), or, from a box without that op, the chunks a snapshot every target has
//   lacks (checkpoint/README.md, "Deltas"); each target checks the manifest its chunks begin with
//   against the snapshot's id, and every entry against it, as it does for a whole archive.
#include <uv.h>

#include <boost/json.hpp>
#include <functional>
#include <memory>
#include <sandboxer/client.hpp>
#include <string>
#include <vector>

#include "base/result.hpp"

namespace sbx::cli {

/// A target's error code where the archive did not arrive whole from the source.
inline constexpr const char* kSourceFailed = "source";
/// The source's error code where every target failed first (each says why).
inline constexpr const char* kNoTarget = "no_target";

/// What an export leaves out. Neither field: the whole archive.
struct DeltaPlan {
  std::string base;     // a snapshot every target has (boxes without snapshot.lacks)
  std::string lacks;    // one bit per chunk of the snapshot, set where some target lacks it
  uint64_t chunks = 0;  // with lacks: the snapshot's chunks, and how many bits are set
  uint64_t lacking = 0;
  bool delta() const { return !base.empty() || !lacks.empty(); }
  /// ", a delta ..." for the CLI's summary lines, or "".
  std::string describe() const;
};

class Relay {
 public:
  /// On `loop` (run by the caller). The archive is spooled in a file of its own in the CLI's
  /// state dir (tokens.hpp), removed with the Relay.
  Relay(uv_loop_t* loop, sdk::Endpoint source, std::string snapshot, DeltaPlan plan = {});
  ~Relay();
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;

  /// Starts the export. Fails only when the spool file cannot be created.
  base::Result<void> start();
  /// A target box; returns its index in targets(). Any time before seal().
  size_t add_target(sdk::Endpoint target);
  /// No more targets: done() once every one has an outcome.
  void seal();
  /// Ends everything now: the source's and every unfinished target's outcome is `why`.
  void abort(const std::string& why);
  /// Called once, when the source and every target have an outcome (after seal()).
  void on_done(std::function<void()> fn) { on_done_ = std::move(fn); }

  bool done() const;
  /// The export's reply ({"ok": true, "snapshot", "size"}), or why the archive did not arrive whole.
  const base::Result<boost::json::object>& source() const;
  /// Per target: its snapshot.import reply ({"ok": true, "snapshot", ...}), or why it failed; the
  /// code kSourceFailed where it failed because the source did (source() says why).
  std::vector<base::Result<boost::json::object>> targets() const;
  /// Bytes sent: the archive's, or the delta's with a base.
  uint64_t size() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  std::function<void()> on_done_;
};

class Session;

/// What to send of `snap` to `targets`: when every target has some snapshot, the source lists
/// the snapshot's chunks (snapshot.chunks, page by page) and each target says which it lacks
/// (snapshot.lacks); only those go. Where a box has no such op, the newest snapshot of the source
/// every target has is the base. The whole archive when they lack every chunk, when a target has
/// no snapshot, or when a list fails (the failure then shows where it matters).
DeltaPlan plan_delta(Session& s, const std::vector<sdk::Endpoint>& targets, const std::string& snap);

}  // namespace sbx::cli
