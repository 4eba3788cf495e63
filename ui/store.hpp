#pragma once
// The events the page sees, kept once in the CLI's process: the journal's lines as they came (from
// the box's subscription, or read from a state dir), each with the fields the page filters on.
// The page never holds them all: it asks for a range of the filtered list (events.range) and
// scrolls over it, which is what keeps a 100k-event timeline fast (docs/architecture.md, "Events").
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sbx::ui {

struct StoredEvent {
  uint64_t seq = 0;
  std::string type, branch, proc;
  std::string line;  ///< the event as the journal holds it: one JSON object
};

/// What the timeline shows: every field empty or absent matches everything.
struct Filter {
  std::string branch, proc;
  std::vector<std::string> types;
  bool matches(const StoredEvent& e) const;
};

class Store {
 public:
  /// Keeps `line` if it is a JSON object with a seq past the last one kept; false otherwise
  /// (a line already seen after a resume, or not an event).
  bool append(std::string_view line);
  size_t size() const { return events_.size(); }
  const StoredEvent& at(size_t i) const { return events_.at(i); }
  uint64_t last_seq() const { return events_.empty() ? 0 : events_.back().seq; }
  /// The index of the first event with seq > `since`.
  size_t first_after(uint64_t since) const;
  /// The indexes of the events `f` matches, in order.
  std::vector<size_t> matching(const Filter& f) const;
  /// A `box.exit` was kept: nothing follows.
  bool ended() const { return ended_; }

 private:
  std::vector<StoredEvent> events_;
  bool ended_ = false;
};

}  // namespace sbx::ui
