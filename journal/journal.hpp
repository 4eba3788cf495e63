#pragma once
// The journal: every event of a box, seq-numbered, on disk before anyone sees it.
//
// Layout under DIR: one file per segment, named by the first seq it holds (20 digits). The active
// segment is plain JSON lines (`N.jsonl`), appended with write(2) per event; a sealed segment is
// compressed on the loop's thread pool to `N.jsonl.zst` once the journal is quiet (see
// JournalOptions::compress_quiet_ms) and the plain file removed. A reader
// prefers the .zst of a segment when both exist (the rename happened, the unlink did not).
#include <uv.h>

#include <boost/json.hpp>
#include <boost/system/result.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "loop/uv-handle.hpp"
#include "os/unique-fd.hpp"

namespace sbx::journal {

/// An event's line as the journal wrote it: `JournalOptions::headroom` bytes (room for a
/// transport's frame header), then the serialized object without its newline. Shared with the
/// listeners that keep it (a WebSocket queue sends it in place); never changed once shown.
using LineBuf = std::shared_ptr<std::string>;

/// A journal event once written: what listeners receive.
struct Event {
  uint64_t seq;
  const boost::json::object& obj;
  std::string_view line;  // the serialized object, no trailing newline
  const LineBuf& buf;     // `headroom` bytes, then `line`
  size_t headroom;
};

// The `branch` of the journal's own events (journal.recovered, .truncated, .degraded,
// .unreadable): every event has one, and the box's are its first branch's.
inline constexpr const char* kOwnBranch = "main";

struct JournalOptions {
  std::string dir;
  std::string box;
  uint64_t segment_bytes = 16u << 20;
  uint64_t disk_cap = 0;  // 0: unlimited
  // While the disk refuses writes (full, quota, I/O error): the bytes of events kept in memory
  // before the journal asks for the agent to be stopped (see Journal::on_pressure).
  uint64_t queue_bytes = 4u << 20;
  // Space held in a file of its own (`reserve`) and given back on the first failed write, so
  // that `journal.degraded` itself reaches the disk and the clients. 0: none. A new journal makes
  // it with its first segment, at the first event: not on a box's start before its agent runs.
  uint64_t reserve_bytes = 64u << 10;
  // How often a degraded journal tries the disk again.
  uint64_t retry_ms = 200;
  // Sealed segments are compressed once a turn of this many ms passes with no event appended (or
  // at once past kDeferredSegments of them): not on the cores a burst of output is using. 0: at
  // once.
  uint64_t compress_quiet_ms = 100;
  // Bytes kept free before each event's line in its buffer (Event::buf): a listener that frames
  // the line (the WebSocket server: LWS_PRE) sends it from there, with no copy.
  size_t headroom = 0;
};

class Journal {
 public:
  using Listener = std::function<void(const Event&)>;

  /// Opens (creating or recovering) the journal. Recovery drops a torn last line of the active
  /// segment, and its whole lines that are damaged (a line that does not parse, or whose seq breaks
  /// the sequence that the lines around it keep), and remembers what it dropped, so the first
  /// append after open is a `journal.recovered` event.
  static boost::system::result<std::unique_ptr<Journal>> open(uv_loop_t* loop, JournalOptions opts);
  ~Journal();

  /// Assigns seq, ts and box; writes the line; then tells every listener. `ev` must hold "type".
  /// Returns the seq. Written before shown, always: when a write fails (ENOSPC, EDQUOT, EIO) the
  /// segment is cut back to its last whole line, `journal.degraded` is written in the space the
  /// reserve gave back, and events wait in memory, unseen, until a retry writes them in order
  /// (then `journal.recovered`). Past `queue_bytes` waiting, on_pressure(true) asks the owner to
  /// stop the producers; on_pressure(false) when the queue has drained.
  uint64_t append(boost::json::object ev);

  using PressureFn = std::function<void(bool stop)>;
  void on_pressure(PressureFn fn) { pressure_ = std::move(fn); }
  /// Whether events are waiting in memory for the disk.
  bool degraded() const noexcept { return degraded_; }

  uint64_t last_seq() const noexcept { return last_seq_; }
  /// The bytes its segments take on disk now.
  uint64_t disk_bytes() const;
  const JournalOptions& options() const noexcept { return opts_; }
  /// Continues numbering after `seq` (a box restored from an archive continues its parent's).
  void skip_to(uint64_t seq) noexcept {
    if (seq > last_seq_) last_seq_ = seq;
  }
  const std::string& dir() const noexcept { return opts_.dir; }

  int add_listener(Listener l);
  void remove_listener(int id);

  /// Waits for compressions under way (used at shutdown), running the loop if it must.
  void flush();

  /// Where a read stopped in a segment, so that the next read from there need not scan the
  /// segment from its start (a client catching up reads it often).
  struct ReadPos {
    uint64_t segment = 0;  // the segment's first seq; 0: no position
    uint64_t offset = 0;   // plain: just past the last line given to fn; .zst: its frame's offset
    bool zst = false;
  };

  /// Whether `dir` holds a journal: its seq.hwm or a segment. Any other directory, read, gives
  /// nothing and no error.
  static bool holds_journal(const std::string& dir);

  /// A segment a read could not read to its end (damaged on disk: a zstd frame that does not
  /// decode or whose checksum is wrong, a file cut short; an I/O error): the seqs after the read's
  /// `since` that it holds and the read did not give, from `first` to `last` (the seq before the
  /// next segment's first; 0 for the newest segment, whose last seq only its own lines tell), the
  /// segment's file name and why.
  struct Gap {
    uint64_t first = 0;
    uint64_t last = 0;
    std::string segment;
    boost::system::error_code error;
    /// Its last seq, or (the newest segment's, whose end the read does not know) `known_end`:
    /// where the caller knows the journal to end. Below `first`: nothing of it was handed out.
    uint64_t last_or(uint64_t known_end) const noexcept { return last ? last : known_end; }
  };
  using GapFn = std::function<bool(const Gap&)>;

  /// Calls `fn(seq, line)` for every event with seq > since, in order, from the files under
  /// `dir`. Stops early when fn returns false. Works on a journal another process is writing.
  /// With `pos`, starts where the last read with it stopped (when `since` is where it stopped:
  /// the last seq given to fn, or later) and records where this one stops. A segment it cannot
  /// read ends the read with that error; with `gap`, the read tells `gap` instead and goes on
  /// with the next segment (false from `gap` stops it), so that one damaged segment does not
  /// hide every event after it.
  static boost::system::result<void> read(const std::string& dir, uint64_t since,
                                          const std::function<bool(uint64_t, std::string_view)>& fn,
                                          ReadPos* pos = nullptr, const GapFn& gap = {});

  /// "segment NAME cannot be read (WHY): seqs FIRST to LAST skipped", for a log or stderr.
  static std::string describe(const Gap& gap);
  /// The same from its parts: a box's `journal.unreadable` event read by a client (its error as
  /// text). `last` 0: not known (the newest segment's).
  static std::string describe(std::string_view segment, std::string_view error, uint64_t first, uint64_t last);

  /// The event a reader sends a client in place of a gap's events (the WebSocket replay,
  /// `--events`, the live view): `journal.unreadable {first_seq, last_seq, segment, error}`, with
  /// `last` (the gap's last seq, or where the caller knows the journal to end) as its seq, so
  /// that a client that resumes after it does not ask for them again; `box` where given. Readers
  /// make it; it is never in the journal.
  static std::string unreadable_event(const Gap& gap, uint64_t last, std::string_view box);

  /// The last event's line in the journal under `dir` (read from its newest segment that holds
  /// one); nullopt where it holds none.
  static std::optional<std::string> last_line(const std::string& dir);

 private:
  // An event that could not be written yet: neither on disk nor shown.
  struct Waiting {
    uint64_t seq;
    boost::json::object obj;
    LineBuf line;  // headroom, then the line (no newline)
  };
  // What a degraded spell has cost so far (journal.recovered reports it).
  struct Spell {
    std::chrono::steady_clock::time_point since, stopped_at;
    std::string reason;
    uint64_t events = 0, bytes = 0;
    bool stopped = false;
    int64_t stopped_ms = 0;
  };

  Journal(uv_loop_t* loop, JournalOptions opts);
  boost::system::result<void> recover();
  boost::system::result<void> recover_active(const std::string& path, uint64_t first);
  void continue_after_unreadable(const std::string& path, uint64_t first, uint64_t read,
                                 const boost::system::error_code& ec);
  bool resume_clean(const std::string& path, uint64_t first);
  void write_clean_mark();
  boost::json::object stamp(uint64_t seq, boost::json::object fields) const;
  LineBuf serialize(const boost::json::object& ev) const;
  size_t line_size(const LineBuf& b) const noexcept { return b->size() - opts_.headroom; }
  boost::system::result<void> write_line(uint64_t seq, const LineBuf& buf);
  void publish(uint64_t seq, const boost::json::object& obj, const LineBuf& buf);
  uint64_t degrade(const boost::system::error_code& ec, uint64_t seq, boost::json::object ev);
  void enqueue(uint64_t seq, boost::json::object obj, LineBuf line);
  void retry(bool insist = false);
  void make_reserve();
  void release_reserve();
  void persist_high_water(uint64_t seq);
  void open_segment(uint64_t first_seq);
  void seal_active();
  void compress(std::string plain);  // on the loop's thread pool
  void compress_deferred();
  void on_quiet_tick();
  void enforce_cap();

  uv_loop_t* loop_;
  JournalOptions opts_;
  uint64_t last_seq_ = 0;
  os::UniqueFd active_;
  uint64_t active_first_ = 0;
  uint64_t active_bytes_ = 0;
  int pending_compressions_ = 0;
  std::vector<std::string> deferred_;  // sealed segments waiting for a quiet turn
  uint64_t seq_at_tick_ = 0;           // last_seq_ at the quiet timer's last turn
  loop::UvHandle<uv_timer_t> quiet_timer_;
  std::map<int, Listener> listeners_;
  int next_listener_ = 1;
  boost::json::object recovered_;  // non-empty: report it with the first append
  bool in_append_ = false;
  bool reserve_pending_ = false;  // a new journal: the reserve comes with the first segment
  // Degraded: events wait here, in seq order, until the disk takes them.
  bool degraded_ = false;
  std::deque<Waiting> waiting_;
  uint64_t waiting_bytes_ = 0;
  Spell spell_;
  loop::UvHandle<uv_timer_t> retry_timer_;
  PressureFn pressure_;
  // `seq.hwm`: a seq no later run may reuse (the highest handed out while events waited in
  // memory), rewritten in place so that it needs no new block on a full disk.
  os::UniqueFd hwm_fd_;
  uint64_t hwm_ = 0;
  static constexpr int kHwmLine = 21;  // seq.hwm's first line: 20 digits and a newline
  std::string clean_note_;             // the last run's note of its clean end (write_clean_mark), or ""
};

/// Compresses `src` to `dst` (zstd, streaming); used by the journal and by tests.
boost::system::result<void> zstd_compress_file(const std::string& src, const std::string& dst, int level = 3);

}  // namespace sbx::journal
