#pragma once
// One snapshot moved from a source box into N target boxes over the box API, read from the
// source once (issue 17: fork and migrate on any host, no filesystem shared with the boxes).
//
// - The source's snapshot.export arrives in binary frames, each written to a spool file here and
//   hashed as it comes; every target's snapshot.import is fed from the spool at that target's own
//   pace (at most 8 MiB waiting per connection), so a slow target holds back neither the source
//   nor the others and memory stays flat whatever the archive's size.
// - Targets may join while the archive is still arriving (boxes that are still starting).
// - A target gets the frame that ends its upload only once the whole archive has arrived and
//   hashes to the snapshot's id. A source that fails or is cut off leaves every target with an
//   upload that never ended: the box discards it when the connection closes (server.cpp), so a
//   partial archive is never imported.
// - Each outcome is reported: the source's (the export's reply, or why it failed) and each
//   target's (its snapshot.import reply, or why it failed). One target's failure is its own.
// - With a base (common_base: a snapshot every target already has), the export is a delta, only
//   the chunks the base lacks (checkpoint/README.md, "Deltas"); each target checks that the archive
//   those chunks make hashes to the snapshot's id, as the relay does for a whole archive.
#include <uv.h>

#include <boost/json.hpp>
#include <functional>
#include <memory>
#include <sandboxer/client.hpp>
#include <string>
#include <vector>

#include "base/result.hpp"

namespace sbx::cli {

class Relay {
 public:
  /// On `loop` (run by the caller). The archive is spooled in a file of its own in the CLI's
  /// state dir (tokens.hpp), removed with the Relay.
  Relay(uv_loop_t* loop, sdk::Endpoint source, std::string snapshot, std::string base = {});
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
  /// Per target: its snapshot.import reply ({"ok": true, "snapshot", ...}), or why it failed.
  std::vector<base::Result<boost::json::object>> targets() const;
  /// Bytes sent: the archive's, or the delta's with a base.
  uint64_t size() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  std::function<void()> on_done_;
};

class Session;

/// The newest snapshot of the source other than `snap` that every target has, "" when there is
/// none (or a list fails: the whole archive then goes, and the failure shows where it matters).
std::string common_base(Session& s, const std::vector<sdk::Endpoint>& targets, const std::string& snap);

}  // namespace sbx::cli
