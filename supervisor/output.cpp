#include "supervisor/output.hpp"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>

#include "base/encoding.hpp"
#include "protocol/protocol.hpp"

namespace sbx::supervisor {

namespace {
constexpr int kPipeBytes = 1 << 20;
// One read is one proc.output event: at most 6 JSON bytes per byte read (\u00XX escapes), so
// 128 KiB keeps every event under the protocol's 1 MiB text frame (protocol::kMaxTextFrame).
constexpr size_t kReadBytes = 128u << 10;
static_assert(kReadBytes * 6 + 4096 < protocol::kMaxTextFrame);
}  // namespace

void OutputDecoder::feed(std::string_view bytes) {
  std::string joined;
  if (!carry_.empty()) {
    joined = std::move(carry_);
    carry_.clear();
    joined.append(bytes);
    bytes = joined;
  }
  // Hold back a trailing, still incomplete character (at most 3 bytes) for the next read.
  size_t valid = base::utf8_valid_prefix(bytes);
  size_t rest = bytes.size() - valid;
  size_t keep = rest > 0 && rest <= 3 && base::utf8_incomplete_tail(bytes) == rest ? rest : 0;
  std::string_view now = bytes.substr(0, bytes.size() - keep);
  if (!now.empty()) {
    boost::json::object ev{{"type", "proc.output"}, {"stream", stream_}};
    protocol::put_bytes(ev, now, valid >= now.size());
    emit_(std::move(ev));
    if (messages_) scan_lines(now);
  }
  carry_.assign(bytes.substr(bytes.size() - keep));
}

void OutputDecoder::finish() {
  if (!carry_.empty()) {
    boost::json::object ev{{"type", "proc.output"}, {"stream", stream_}};
    protocol::put_bytes(ev, carry_);
    emit_(std::move(ev));
    if (messages_) scan_lines(carry_);
    carry_.clear();
  }
  // A last line without a newline still counts as a line.
  if (messages_ && !line_.empty()) scan_lines("\n");
}

void OutputDecoder::scan_lines(std::string_view bytes) {
  while (!bytes.empty()) {
    size_t nl = bytes.find('\n');
    std::string_view part = bytes.substr(0, nl);
    if (!line_too_long_) {
      if (line_.size() + part.size() > kMaxMessageLine) {
        line_too_long_ = true;
        line_.clear();
      } else {
        line_.append(part);
      }
    }
    if (nl == std::string_view::npos) return;
    bytes.remove_prefix(nl + 1);
    if (!line_too_long_) {
      std::string_view l = line_;
      if (l.ends_with('\r')) l.remove_suffix(1);
      size_t first = l.find_first_not_of(" \t");
      if (first != std::string_view::npos && l[first] == '{') {
        boost::system::error_code ec;
        auto v = boost::json::parse(l, ec);
        if (!ec && v.is_object()) emit_({{"type", "proc.message"}, {"message", std::move(v)}});
      }
    }
    line_.clear();
    line_too_long_ = false;
  }
}

OutputReader::OutputReader(uv_loop_t* loop, os::UniqueFd fd, OutputDecoder decoder, std::function<void()> on_eof)
    : pipe_(loop::UvHandle<uv_pipe_t>::make(loop, uv_pipe_init, 0).value()),
      decoder_(std::move(decoder)),
      on_eof_(std::move(on_eof)) {
  pipe_->data = this;
  // A larger pipe lets a burst of output be taken in a few large reads (one event each) instead
  // of many 64 KiB ones; where the kernel refuses (a pty, a lower pipe-max-size) it stays as is.
  ::fcntl(fd.get(), F_SETPIPE_SZ, kPipeBytes);
  tty_ = ::isatty(fd.get()) == 1;
  if (int rc = uv_pipe_open(pipe_.get(), fd.release()); rc != 0) {
    spdlog::error("watch output pipe: {}", uv_strerror(rc));
    done_ = true;
    return;
  }
  buf_ = std::make_unique_for_overwrite<char[]>(kReadBytes);
  uv_read_start(pipe_.stream(), on_alloc, on_read);
}

void OutputReader::close() {
  if (done_) return;
  uv_read_stop(pipe_.stream());
  done_ = true;
  decoder_.finish();
  if (on_eof_) on_eof_();
}

void OutputReader::pause(bool on) {
  if (done_ || paused_ == on) return;
  paused_ = on;
  if (on)
    uv_read_stop(pipe_.stream());
  else
    uv_read_start(pipe_.stream(), on_alloc, on_read);
}

// libuv ends a stream at POLLHUP after a read shorter than its buffer, without reading again
// (uv__stream_io): right for a pipe, whose one buffer that read emptied. A pty's master gives at
// most the line discipline's buffer (4 KiB) per read while the rest of what the terminal's side
// wrote waits in the tty's flip buffers, so what a process wrote just before it closed its
// terminal was lost (an exec's last lines). Read here until the kernel has nothing left: EIO
// once the other side is closed (after it has flushed those buffers), EAGAIN while it is open.
void OutputReader::drain_tty() {
  uv_os_fd_t fd;
  if (done_ || uv_fileno(pipe_.handle(), &fd) != 0) return;
  for (int reads = 0; reads < 4096;) {  // a pty holds ~70 KiB at most: a few dozen reads
    ssize_t n = ::read(fd, buf_.get(), kReadBytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    decoder_.feed({buf_.get(), static_cast<size_t>(n)});
    ++reads;
  }
}

void OutputReader::on_alloc(uv_handle_t* h, size_t, uv_buf_t* b) noexcept {
  auto* self = static_cast<OutputReader*>(h->data);
  *b = uv_buf_init(self->buf_.get(), static_cast<unsigned>(kReadBytes));
}

void OutputReader::on_read(uv_stream_t* s, ssize_t n, const uv_buf_t* b) noexcept {
  auto* self = static_cast<OutputReader*>(s->data);
  if (!self) return;
  try {
    if (n > 0) {
      self->decoder_.feed({b->base, static_cast<size_t>(n)});
    } else if (n < 0) {
      if (self->tty_) self->drain_tty();
      self->close();
    }
  } catch (const std::exception& e) {
    spdlog::error("read output: {}", e.what());
  }
}

}  // namespace sbx::supervisor
