#pragma once
// Reads one output pipe of a process on the loop and turns it into events: `proc.output` for
// every byte (text when valid UTF-8, base64 otherwise; a multi-byte character split across two
// reads is held back and joined), and for stdout, `proc.message` for each line that is a JSON
// object of at most 64 KiB.
#include <uv.h>

#include <boost/json.hpp>
#include <functional>
#include <memory>
#include <string>

#include "loop/uv-handle.hpp"
#include "os/unique-fd.hpp"

namespace sbx::supervisor {

inline constexpr size_t kMaxMessageLine = 64 * 1024;

/// Pure part, testable without a loop: feeds bytes, calls `emit` with finished event bodies.
class OutputDecoder {
 public:
  using Emit = std::function<void(boost::json::object)>;
  OutputDecoder(std::string stream, bool messages, Emit emit)
      : stream_(std::move(stream)), messages_(messages), emit_(std::move(emit)) {}
  void feed(std::string_view bytes);
  void finish();  // EOF: flush what is held back

 private:
  void scan_lines(std::string_view bytes);
  std::string stream_;
  bool messages_;
  Emit emit_;
  std::string carry_;  // an incomplete UTF-8 sequence from the previous read
  std::string line_;   // the stdout line being assembled, for proc.message
  bool line_too_long_ = false;
};

class OutputReader {
 public:
  OutputReader(uv_loop_t* loop, os::UniqueFd fd, OutputDecoder decoder, std::function<void()> on_eof);
  OutputReader(const OutputReader&) = delete;
  OutputReader& operator=(const OutputReader&) = delete;
  bool done() const noexcept { return done_; }
  /// Stops reading and flushes (used when a process group is gone but a straggler holds the pipe).
  void close();
  /// Stops reading for now (the writer blocks once the pipe is full), or reads again.
  void pause(bool on);

 private:
  static void on_alloc(uv_handle_t*, size_t, uv_buf_t*) noexcept;
  static void on_read(uv_stream_t*, ssize_t, const uv_buf_t*) noexcept;
  void drain_tty();
  loop::UvHandle<uv_pipe_t> pipe_;
  OutputDecoder decoder_;
  std::function<void()> on_eof_;
  // Not zeroed: malloc takes a buffer this large from fresh pages, and the kernel backs each only
  // when a read first fills it (an agent that writes little costs a page, not 128 KiB).
  std::unique_ptr<char[]> buf_;
  bool done_ = false;
  bool paused_ = false;
  bool tty_ = false;  // a pty's master: read to the end at libuv's EOF (drain_tty)
};

}  // namespace sbx::supervisor
