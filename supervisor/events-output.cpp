#include "supervisor/events-output.hpp"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <boost/json.hpp>

#include <cerrno>
#include <cstring>

#include "os/sys.hpp"

namespace sbx::supervisor {

namespace {

auto log() {
  static auto l = spdlog::default_logger()->clone("events");
  return l;
}

// The box's id, from one of its events' lines ("" where it names none).
std::string box_of(std::string_view line) {
  boost::system::error_code ec;
  auto v = boost::json::parse(line, ec);
  const auto* b = !ec && v.is_object() ? v.as_object().if_contains("box") : nullptr;
  return b && b->is_string() ? std::string(b->as_string()) : std::string();
}

}  // namespace

base::Result<os::UniqueFd> EventsOutput::open(const std::string& path) {
  if (path == "-") {
    struct stat st {};
    // A pipe opened anew: a description of our own, made non-blocking without touching the one
    // our parent (and whoever else) shares. Anything else is our stdout as it is.
    if (::fstat(1, &st) == 0 && S_ISFIFO(st.st_mode)) {
      os::UniqueFd fd(::open("/proc/self/fd/1", O_WRONLY | O_NONBLOCK | O_CLOEXEC));
      if (fd) return fd;
    }
    os::UniqueFd fd(::fcntl(1, F_DUPFD_CLOEXEC, 3));
    if (!fd) return base::sys_fail("--events -: duplicate stdout", errno);
    return fd;
  }
  os::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK, 0640));
  if (!fd && errno == ENXIO)
    return base::fail("open --events " + path + ": a FIFO that no process reads (start its reader first)");
  if (!fd) return base::sys_fail("open --events " + path, errno);
  return fd;
}

EventsOutput::EventsOutput(uv_loop_t* loop, os::UniqueFd fd, std::string journal_dir)
    : fd_(std::move(fd)), journal_dir_(std::move(journal_dir)) {
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) return;
  socket_ = S_ISSOCK(st.st_mode);
  int flags = ::fcntl(fd_.get(), F_GETFL);
  nonblocking_ = socket_ || (S_ISFIFO(st.st_mode) && flags >= 0 && (flags & O_NONBLOCK));
  if (!nonblocking_) return;
  if (auto poll = loop::UvHandle<uv_poll_t>::make(loop, uv_poll_init, fd_.get())) {
    poll_ = std::move(*poll);
    poll_->data = this;
  } else {
    log()->warn("watch --events for writing: {}; written in the loop's turn", poll.error().message);
    if (!socket_) (void)os::set_nonblocking(fd_.get(), false);
    nonblocking_ = false;
  }
}

void EventsOutput::on_event(uint64_t seq, std::string_view line) {
  seen_ = seq;
  if (!box_) box_ = box_of(line);
  if (!fd_ || behind_) return;  // gone; or the journal's files will give it
  if (queue_.size() - off_ > kBehindBytes) {
    behind_ = true;
    log()->debug("--events: the reader is {} bytes behind; the rest comes from the journal", queue_.size() - off_);
    return;
  }
  last_ = seq;
  if (queue_.empty() && !polling_) {
    // The usual case: the line and its newline in one writev, no copy; what the reader could
    // not take yet is queued.
    size_t done = write_direct(line);
    if (done == line.size() + 1 || !fd_) return;
    if (done < line.size()) queue_.append(line.substr(done));
    queue_.push_back('\n');
    pump();
    return;
  }
  queue_.append(line);
  queue_.push_back('\n');
  if (!polling_) pump();
}

// Writes `line` and a newline as far as the output takes them now; the bytes written (all of
// them, line.size() + 1, when it took everything). A failure stops the output.
size_t EventsOutput::write_direct(std::string_view line) {
  char nl = '\n';
  iovec iov[2] = {{const_cast<char*>(line.data()), line.size()}, {&nl, 1}};
  msghdr m{};
  m.msg_iov = iov;
  m.msg_iovlen = 2;
  for (;;) {
    ssize_t n = socket_ ? ::sendmsg(fd_.get(), &m, MSG_DONTWAIT | MSG_NOSIGNAL) : ::writev(fd_.get(), iov, 2);
    if (n >= 0) return static_cast<size_t>(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    stop(std::strerror(errno));
    return 0;
  }
}

void EventsOutput::pump() {
  while (fd_) {
    if (!write_queue()) return;  // the reader is full (we wait to be told) or gone
    if (!behind_ || !read_behind()) break;
  }
  if (polling_) {
    polling_ = false;
    uv_poll_stop(poll_.get());
  }
}

// Writes the queue out; false while the reader cannot take more (a poll started) or once the
// output has failed.
bool EventsOutput::write_queue() {
  while (off_ < queue_.size()) {
    const char* p = queue_.data() + off_;
    size_t len = queue_.size() - off_;
    ssize_t n = socket_ ? ::send(fd_.get(), p, len, MSG_DONTWAIT | MSG_NOSIGNAL) : ::write(fd_.get(), p, len);
    if (n > 0) {
      off_ += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && poll_) {
      if (!polling_) {
        polling_ = true;
        uv_poll_start(poll_.get(), UV_WRITABLE, on_writable);
      }
      return false;
    }
    stop(n < 0 ? std::strerror(errno) : "wrote nothing");
    return false;
  }
  queue_.clear();
  off_ = 0;
  return true;
}

// The next batch after `last_` from the journal's files into the queue; false when there was
// none: caught up, the output follows the events live again.
bool EventsOutput::read_behind() {
  size_t got = 0;
  auto put = [&](uint64_t seq, std::string_view line) {
    queue_.append(line);
    queue_.push_back('\n');
    last_ = seq;
    got += line.size() + 1;
    return got < kBatchBytes;
  };
  auto r = journal::Journal::read(journal_dir_, last_, put, &pos_, [&](const journal::Journal::Gap& g) {
    // A segment damaged on disk: in its events' place, the event that says so (as a WebSocket
    // client's replay has it), and on after them. The newest segment ends at the last event seen.
    uint64_t last = g.last_or(seen_);
    if (last < g.first) return true;
    log()->error("--events: read the journal to catch up: {}", journal::Journal::describe(g));
    return put(last, journal::Journal::unreadable_event(g, last, box_.value_or("")));
  });
  if (!r) {
    stop("read the journal to catch up: " + r.error().message());
    return false;
  }
  if (got == 0) {
    behind_ = false;
    log()->debug("--events: caught up at seq {}", last_);
  }
  return got > 0;
}

void EventsOutput::finish() {
  if (!fd_) return;
  if (polling_) {
    polling_ = false;
    uv_poll_stop(poll_.get());
  }
  poll_.reset();
  // From here every write waits for the reader: the box is ending, and its last events are
  // what a reader (`sandboxer run`) waits for.
  // A pipe's or FIFO's description is ours alone (open()); a socket was never made non-blocking.
  if (nonblocking_ && !socket_) (void)os::set_nonblocking(fd_.get(), false);
  socket_ = false;  // write(2) from here, which waits
  pump();
}

void EventsOutput::stop(const std::string& why) {
  log()->warn("write --events: {} (the journal still has every event)", why);
  if (polling_) uv_poll_stop(poll_.get());
  polling_ = false;
  poll_.reset();
  fd_.reset();
  queue_.clear();
  off_ = 0;
}

void EventsOutput::on_writable(uv_poll_t* p, int, int) noexcept {
  auto* self = static_cast<EventsOutput*>(p->data);
  if (!self) return;
  self->polling_ = false;
  uv_poll_stop(p);
  self->pump();
}

}  // namespace sbx::supervisor
