#pragma once
// The events the page sees, kept once in the CLI's process: the journal's lines as they came (from
// the box's subscription, or read from a state dir), each with the fields the page filters on.
// The page never holds them all: it asks for a range of the filtered list (events.range) and
// scrolls over it, which is what keeps a 100k-event timeline fast (docs/architecture.md, "Events").
//
// A box that runs for days has more events than this process should hold: the lines go to a spool
// file of their own (unnamed, O_TMPFILE, mode 0600, in the directory given: the CLI's state dir)
// and the memory keeps an index of 32 bytes an event (its seq, where its line is, and the fields
// the page filters on, each name kept once). Where the spool cannot be made (the lines then stay
// in memory) or written (a full disk: they stay in memory until it can be written again, tried
// every 4 MiB), `warn` says so: nothing is lost.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "os/unique-fd.hpp"

namespace sbx::ui {

/// What the timeline shows: every field empty or absent matches everything.
struct Filter {
  std::string branch, proc;
  std::vector<std::string> types;
};

class Store {
 public:
  using WarnFn = std::function<void(const std::string&)>;
  /// `spool_dir`: where the lines are spooled; empty: they are kept in memory.
  explicit Store(std::string spool_dir = "", WarnFn warn = {});

  /// Keeps `line` if it is a JSON object with a seq past the last one kept; false otherwise
  /// (a line already seen after a resume, or not an event).
  bool append(std::string_view line);
  size_t size() const { return index_.size(); }
  uint64_t seq(size_t i) const { return index_.at(i).seq; }
  const std::string& type(size_t i) const { return names_[index_.at(i).type]; }
  const std::string& branch(size_t i) const { return names_[index_.at(i).branch]; }
  const std::string& proc(size_t i) const { return names_[index_.at(i).proc]; }
  /// The event as the journal holds it: one JSON object. Where the spool cannot be read back
  /// (said through `warn`), an object of type `ui.unreadable` with its seq and why.
  std::string line(size_t i) const;
  uint64_t last_seq() const { return index_.empty() ? 0 : index_.back().seq; }
  /// The index of the first event with seq > `since`.
  size_t first_after(uint64_t since) const;
  /// The indexes of the events `f` matches, in order.
  std::vector<size_t> matching(const Filter& f) const;
  /// A `box.exited` was kept: nothing follows.
  bool ended() const { return ended_; }
  /// The bytes of the lines held in memory (not yet written to the spool, or not writable there).
  size_t memory_bytes() const { return pending_.size(); }
  /// The bytes of the lines in the spool file.
  uint64_t spooled_bytes() const { return flushed_; }

 private:
  struct Entry {
    uint64_t seq;
    uint64_t offset;  ///< in the spool file and pending_ after it, as one sequence of bytes
    uint32_t length;
    uint32_t type, branch, proc;  ///< into names_
  };
  static_assert(sizeof(Entry) == 32);
  uint32_t name_id(std::string_view name);
  bool matches(const Entry& e, const Filter& f) const;
  void flush();
  void open_spool();

  std::vector<Entry> index_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, uint32_t> ids_;
  std::string spool_dir_;
  WarnFn warn_;
  os::UniqueFd spool_;
  bool spool_tried_ = false, spool_failing_ = false;
  uint64_t flushed_ = 0;           ///< bytes in the spool file
  std::string pending_;            ///< what follows them, in memory
  size_t next_flush_ = 256 << 10;  ///< pending_'s size at which it is written
  bool ended_ = false;
};

}  // namespace sbx::ui
