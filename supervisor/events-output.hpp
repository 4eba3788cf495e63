#pragma once
// The copy of the journal that `--events PATH|-` asks for: a file, a pipe (`sandboxer run` reads
// the box's events from one), a FIFO or a socket.
//
// A pipe, FIFO or socket is written without blocking: a reader that stops (a pager, a terminal
// on hold, `sandboxer run ... | less`) never holds the loop, so the agent's output, the API,
// signals and ceilings go on. What the reader has not taken waits in memory up to kBehindBytes;
// past that the output is "behind": nothing more is queued, and once the queue is read the rest
// comes from the journal's files (Journal::read, as a WebSocket client's replay), batch by batch,
// until it has caught up and follows the events live again: every event once, in order, with
// memory bounded. At the box's end finish() writes what is left, waiting for the reader. A file
// or terminal is written as before, in the loop's turn.
#include <uv.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "journal/journal.hpp"
#include "loop/uv-handle.hpp"
#include "os/unique-fd.hpp"

namespace sbx::supervisor {

class EventsOutput {
 public:
  static constexpr size_t kBehindBytes = 4u << 20;
  static constexpr size_t kBatchBytes = 1u << 20;

  /// `fd` is the open output; `journal_dir` is where the events it falls behind on are read.
  EventsOutput(uv_loop_t* loop, os::UniqueFd fd, std::string journal_dir);
  EventsOutput(const EventsOutput&) = delete;
  EventsOutput& operator=(const EventsOutput&) = delete;

  /// Opens what `--events` names: "-" (our stdout: a pipe is opened anew through /proc, so that
  /// its own description, not the one our parent shares, is the non-blocking one) or a path
  /// (created 0640; a FIFO no process reads is refused at once, ENXIO, rather than waited on).
  static base::Result<os::UniqueFd> open(const std::string& path);

  /// A journal event (journal::Journal's listener).
  void on_event(uint64_t seq, std::string_view line);
  /// At the box's end: writes everything left, waiting for the reader as long as it takes.
  void finish();

 private:
  void pump();
  size_t write_direct(std::string_view line);
  bool write_queue();
  bool read_behind();
  void stop(const std::string& why);
  static void on_writable(uv_poll_t* p, int status, int events) noexcept;

  os::UniqueFd fd_;
  std::string journal_dir_;
  bool nonblocking_ = false;  // a pipe, FIFO or socket
  bool socket_ = false;       // written with send(MSG_DONTWAIT)
  loop::UvHandle<uv_poll_t> poll_;
  bool polling_ = false;
  std::string queue_;
  size_t off_ = 0;
  uint64_t last_ = 0;               // the seq of the last event queued or written
  uint64_t seen_ = 0;               // the seq of the last event on_event was given
  std::optional<std::string> box_;  // the box's id, from its first event
  bool behind_ = false;
  journal::Journal::ReadPos pos_;
};

}  // namespace sbx::supervisor
