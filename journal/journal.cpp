#include "journal/journal.hpp"

#include <boost/json/basic_parser_impl.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "base/encoding.hpp"
#include "os/sys.hpp"

namespace sbx::journal {

namespace {

auto log() {
  static auto l = [] {
    auto existing = spdlog::get("journal");
    return existing ? existing : spdlog::default_logger()->clone("journal");
  }();
  return l;
}

struct Segment {
  uint64_t first;
  bool zst;
  bool plain;
};

std::string seg_name(uint64_t first) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%020llu", static_cast<unsigned long long>(first));
  return buf;
}

// The segments under dir, ordered by first seq.
std::vector<Segment> list_segments(const std::string& dir) {
  std::map<uint64_t, Segment> m;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d)) {
      std::string_view n = e->d_name;
      bool zst = n.ends_with(".jsonl.zst");
      bool plain = n.ends_with(".jsonl");
      if (!zst && !plain) continue;
      uint64_t first = 0;
      auto [p, ec] = std::from_chars(n.data(), n.data() + n.size(), first);
      if (ec != std::errc() || *p != '.') continue;
      auto& s = m[first];
      s.first = first;
      s.zst |= zst;
      s.plain |= plain;
    }
    ::closedir(d);
  }
  std::vector<Segment> out;
  for (auto& [k, v] : m) out.push_back(v);
  return out;
}

// The seq of one journal line, read without a full parse: lines start with {"seq":N.
std::optional<uint64_t> line_seq(std::string_view line) {
  constexpr std::string_view prefix = "{\"seq\":";
  if (!line.starts_with(prefix)) return std::nullopt;
  uint64_t v = 0;
  auto b = line.data() + prefix.size();
  auto [p, ec] = std::from_chars(b, line.data() + line.size(), v);
  if (ec != std::errc()) return std::nullopt;
  return v;
}

// Streams the lines of one segment file to fn; false from fn stops.
// Calls fn(line, resume) for every whole line; `resume` is where a later read may start and still
// see every line after this one: the file offset just past the line for a plain file, the offset
// of the zstd frame holding the line for a .zst (frames end at line ends: zstd_compress_file).
// The file is read from byte `from` on, which must be such a position. A .zst that does not end
// at a frame's end is an error (EBADMSG) unless `cut_ok`.
boost::system::result<bool> for_each_line(const std::string& path, bool zst,
                                          const std::function<bool(std::string_view, uint64_t)>& fn, uint64_t from = 0,
                                          bool cut_ok = false) {
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return {boost::system::in_place_error, os::last_error()};
  if (from > 0 && ::lseek(fd.get(), static_cast<off_t>(from), SEEK_SET) < 0)
    return {boost::system::in_place_error, os::last_error()};
  std::string pending;  // the start of a line the last chunk did not finish
  uint64_t at = from;   // plain: the file offset of the next byte fed; .zst: the current frame's
  auto feed = [&](std::string_view chunk) -> bool {
    while (!chunk.empty()) {
      size_t nl = chunk.find('\n');
      if (nl == std::string_view::npos) {
        pending.append(chunk);
        break;
      }
      std::string_view line = chunk.substr(0, nl);
      if (!pending.empty()) {
        pending.append(line);
        line = pending;
      }
      if (!zst) at += line.size() + 1;
      bool more = fn(line, at);
      pending.clear();
      if (!more) return false;
      chunk.remove_prefix(nl + 1);
    }
    return true;
  };
  std::vector<char> in(1 << 17), out(1 << 18);
  std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> dctx(zst ? ZSTD_createDCtx() : nullptr, ZSTD_freeDCtx);
  uint64_t in_at = from;  // the file offset of in[0]
  bool in_frame = false;  // .zst: the last frame begun has not ended
  std::string frame;      // .zst: what it has decoded of that frame
  for (;;) {
    ssize_t n = ::read(fd.get(), in.data(), in.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return {boost::system::in_place_error, os::last_error()};
    }
    if (n == 0) break;
    if (!zst) {
      if (!feed({in.data(), static_cast<size_t>(n)})) return false;
      continue;
    }
    ZSTD_inBuffer ib{in.data(), static_cast<size_t>(n), 0};
    while (ib.pos < ib.size) {
      ZSTD_outBuffer ob{out.data(), out.size(), 0};
      size_t r = ZSTD_decompressStream(dctx.get(), &ob, &ib);
      if (ZSTD_isError(r)) return {boost::system::in_place_error, os::sys_error(EBADMSG)};
      // A frame's lines go out once it has ended and its checksum is checked: a frame damaged in
      // its data decodes to other bytes, and gave them to readers before the checksum failed.
      frame.append(out.data(), ob.pos);
      in_frame = r != 0;
      if (in_frame) continue;
      if (!feed(frame)) return false;
      frame.clear();
      if (pending.empty()) at = in_at + ib.pos;  // a frame ended, at a line end
    }
    in_at += static_cast<uint64_t>(n);
  }
  // A .zst is renamed into place whole (zstd_compress_file): one that ends inside a frame, or
  // holds none, was cut short on disk, and what it held past the cut is not in it. Recovery
  // (cut_ok) still takes the lines of the part it holds: their seqs were handed out.
  if (zst && !cut_ok && (in_frame || in_at == 0)) return {boost::system::in_place_error, os::sys_error(EBADMSG)};
  if (zst && in_frame && !feed(frame)) return false;
  // A last line without its newline is torn: the writer died mid-write. Readers skip it.
  return true;
}

// Whether `line` is one JSON text, building nothing: boost::json's parser with a handler that
// keeps nothing. Recovery checks each line of the active segment (up to 16 MiB) at a box's
// restart: a start in a state dir whose segment held 15 MB of 4 KB lines took 78.9 ms with each
// line parsed into values (boost::json::parse) and the segment read whole, 32.7 ms with this and
// the segment read in chunks (bench/pid1, medians of 10; tini 1.8).
class JsonCheck {
 public:
  bool whole(std::string_view line) {
    parser_.reset();
    boost::system::error_code ec;
    size_t n = parser_.write_some(false, line.data(), line.size(), ec);
    return !ec && n == line.size();
  }

 private:
  struct Keep_nothing {
    using ec = boost::system::error_code;
    using sv = boost::json::string_view;
    static constexpr size_t max_object_size = static_cast<size_t>(-1);
    static constexpr size_t max_array_size = static_cast<size_t>(-1);
    static constexpr size_t max_key_size = static_cast<size_t>(-1);
    static constexpr size_t max_string_size = static_cast<size_t>(-1);
    bool on_document_begin(ec&) { return true; }
    bool on_document_end(ec&) { return true; }
    bool on_object_begin(ec&) { return true; }
    bool on_object_end(size_t, ec&) { return true; }
    bool on_array_begin(ec&) { return true; }
    bool on_array_end(size_t, ec&) { return true; }
    bool on_key_part(sv, size_t, ec&) { return true; }
    bool on_key(sv, size_t, ec&) { return true; }
    bool on_string_part(sv, size_t, ec&) { return true; }
    bool on_string(sv, size_t, ec&) { return true; }
    bool on_number_part(sv, ec&) { return true; }
    bool on_int64(int64_t, sv, ec&) { return true; }
    bool on_uint64(uint64_t, sv, ec&) { return true; }
    bool on_double(double, sv, ec&) { return true; }
    bool on_bool(bool, ec&) { return true; }
    bool on_null(ec&) { return true; }
    bool on_comment_part(sv, ec&) { return true; }
    bool on_comment(sv, ec&) { return true; }
  };
  // A line with a byte that is not UTF-8 is kept (an older sandboxer wrote such bytes into
  // messages); Journal::read gives it as text.
  static boost::json::parse_options options() {
    boost::json::parse_options o;
    o.allow_invalid_utf8 = true;
    return o;
  }
  boost::json::basic_parser<Keep_nothing> parser_{options()};
};

// Where the last zstd frame of the .zst segment at `path` starts: frames end at line ends
// (zstd_compress_file), so the segment's last line is the last frame's. 0 when the frames cannot
// be walked (the whole file is then read, and its error found there).
uint64_t last_frame_offset(const std::string& path) {
  auto data = os::read_file(path);
  if (!data) return 0;
  uint64_t off = 0, last = 0;
  while (off < data->size()) {
    size_t n = ZSTD_findFrameCompressedSize(data->data() + off, data->size() - off);
    if (ZSTD_isError(n) || n == 0) return 0;
    last = off;
    off += n;
  }
  return last;
}

// The seq of the last line of the .zst segment at `path` (whose first seq is `first`), read from
// a frame that ends the file: found by its magic number from the end, so that a damaged frame
// header before it (which stops ZSTD_findFrameCompressedSize's walk from the start) hides nothing
// after it. A frame that decodes to nothing (zstd_compress_file wrote one after a segment's last
// frame before 2026-12-08) ends nothing: the frame before it is looked for. nullopt when no such
// frame decodes to whole lines with seqs.
std::optional<uint64_t> last_seq_from_the_end(const std::string& path, uint64_t first) {
  auto data = os::read_file(path);
  if (!data || data->size() < 4) return std::nullopt;
  const unsigned char magic[4] = {0x28, 0xB5, 0x2F, 0xFD};  // ZSTD_MAGICNUMBER, little-endian
  size_t end = data->size();                                // where the frame looked for ends
  for (size_t off = end - 4 + 1; off-- > 0;) {
    if (std::memcmp(data->data() + off, magic, 4) != 0) continue;
    if (ZSTD_findFrameCompressedSize(data->data() + off, end - off) != end - off) continue;
    std::optional<uint64_t> seq;
    bool any = false;
    auto r = for_each_line(
        path, true,
        [&](std::string_view l, uint64_t) {
          any = true;
          if (auto s = line_seq(l); s && *s >= first && (!seq || *s > *seq)) seq = s;
          return true;
        },
        off);
    if (r && seq) return seq;
    if (r && !any) end = off;
  }
  return std::nullopt;
}

// Every line has at least `{"seq":N,"ts":"<RFC 3339>","type":"","box":""}` and its newline.
constexpr uint64_t kMinLineBytes = 32;

}  // namespace

// Compressed as a series of zstd frames, each ending at a line end near kFrameBytes: a reader catching up resumes at
// the frame of its last line (ReadPos) instead of decompressing the segment from its start at every refill. One zstd
// stream all the same.
boost::system::result<void> zstd_compress_file(const std::string& src, const std::string& dst, int level) {
  constexpr size_t kFrameBytes = 512u << 10;
  os::UniqueFd in(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return os::last_error();
  std::string tmp = dst + ".tmp";
  os::UniqueFd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640));
  if (!out) return os::last_error();
  std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> cctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_checksumFlag, 1);
  std::vector<char> ibuf(ZSTD_CStreamInSize()), obuf(ZSTD_CStreamOutSize());
  auto put = [&](std::string_view part, ZSTD_EndDirective mode) -> boost::system::result<void> {
    ZSTD_inBuffer ib{part.data(), part.size(), 0};
    for (;;) {
      ZSTD_outBuffer ob{obuf.data(), obuf.size(), 0};
      size_t rem = ZSTD_compressStream2(cctx.get(), &ob, &ib, mode);
      if (ZSTD_isError(rem)) return os::sys_error(EIO);
      if (auto r = os::write_all(out.get(), {obuf.data(), ob.pos}); !r) return r.error();
      if (mode == ZSTD_e_end ? rem == 0 : ib.pos == ib.size) return {};
    }
  };
  size_t in_frame = 0;  // bytes given to the current frame
  bool ended = false;   // a frame was ended
  for (;;) {
    ssize_t n = ::read(in.get(), ibuf.data(), ibuf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return os::last_error();
    }
    std::string_view chunk(ibuf.data(), static_cast<size_t>(n));
    if (n == 0) {
      // Not a frame of nothing after the last (a segment whose last read ended a frame): the seq
      // of its last line is read from the frame that ends the file (last_seq_from_the_end).
      if (in_frame > 0 || !ended)
        if (auto r = put({}, ZSTD_e_end); !r) return r.error();
      break;
    }
    size_t nl = in_frame + chunk.size() >= kFrameBytes ? chunk.rfind('\n') : std::string_view::npos;
    if (nl == std::string_view::npos) {
      if (auto r = put(chunk, ZSTD_e_continue); !r) return r.error();
      in_frame += chunk.size();
      continue;
    }
    if (auto r = put(chunk.substr(0, nl + 1), ZSTD_e_end); !r) return r.error();
    ended = true;
    in_frame = chunk.size() - nl - 1;
    if (in_frame > 0)
      if (auto r = put(chunk.substr(nl + 1), ZSTD_e_continue); !r) return r.error();
  }
  if (::fsync(out.get()) != 0) return os::last_error();
  out.reset();
  if (::rename(tmp.c_str(), dst.c_str()) != 0) return os::last_error();
  return {};
}

Journal::Journal(uv_loop_t* loop, JournalOptions opts) : loop_(loop), opts_(std::move(opts)) {}

Journal::~Journal() {
  flush();
  write_clean_mark();
}

// A journal that ends cleanly leaves a note of what its active segment then was (its first seq,
// size, inode, mtime and last seq, as a second line of seq.hwm: one pwrite to a file open already,
// no inode made), so that the next open need not check that segment line by line: a restart in a
// state dir whose segment held 15 MB spent 31-54 ms there (bench/pid1.py). The note is cut off as
// the next open reads it, before anything is appended, so any other end of a run (a kill, a crash,
// a full disk) leaves none and the next open checks every line, as before. It is trusted only for
// a segment still exactly as it was left (same inode, size and mtime) whose last line is whole and
// carries that last seq. Nothing is synced for it: after a power loss that kept the note and not
// the segment's data, the size or the last line differs, or (zeros where data was) readers skip
// what does not parse.
void Journal::write_clean_mark() {
  if (!active_ || !hwm_fd_ || degraded_ || !waiting_.empty()) return;
  struct stat st {};
  if (::fstat(active_.get(), &st) != 0) return;
  char buf[128];
  int n = std::snprintf(buf, sizeof buf, "%llu %llu %llu %lld %llu\n", static_cast<unsigned long long>(active_first_),
                        static_cast<unsigned long long>(st.st_size), static_cast<unsigned long long>(st.st_ino),
                        static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec,
                        static_cast<unsigned long long>(last_seq_));
  if (::pwrite(hwm_fd_.get(), buf, static_cast<size_t>(n), kHwmLine) != n)
    log()->warn("journal: note its clean end in {}/seq.hwm: {}", opts_.dir, os::last_error().message());
}

// The previous run's note of its clean end (write_clean_mark, read by recover): true, with the
// journal positioned at the segment's end, when the segment at `path` is as the note says.
bool Journal::resume_clean(const std::string& path, uint64_t first) {
  unsigned long long f = 0, size = 0, ino = 0, last = 0;
  long long mtime = 0;
  if (clean_note_.empty() ||
      std::sscanf(clean_note_.c_str(), "%llu %llu %llu %lld %llu", &f, &size, &ino, &mtime, &last) != 5)
    return false;
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0) return false;
  long long now_mtime = static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
  if (f != first || size != static_cast<unsigned long long>(st.st_size) || ino != st.st_ino || mtime != now_mtime ||
      size == 0 || last < first)
    return false;
  // The last line: whole (the file ends with a newline), JSON, and the seq the note names.
  std::string tail(static_cast<size_t>(std::min<unsigned long long>(size, 1 << 16)), '\0');
  off_t at = static_cast<off_t>(size - tail.size());
  if (::pread(fd.get(), tail.data(), tail.size(), at) != static_cast<ssize_t>(tail.size()) || tail.back() != '\n')
    return false;
  tail.pop_back();
  size_t start = tail.rfind('\n');
  if (start == std::string::npos && tail.size() + 1 < size) return false;  // a line longer than the window
  std::string_view line = std::string_view(tail).substr(start == std::string::npos ? 0 : start + 1);
  JsonCheck json;
  if (line_seq(line) != last || !json.whole(line)) return false;
  active_.reset(::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NOFOLLOW));
  if (!active_) return false;
  last_seq_ = last;
  active_first_ = first;
  active_bytes_ = size;
  return true;
}

boost::system::result<std::unique_ptr<Journal>> Journal::open(uv_loop_t* loop, JournalOptions opts) {
  if (auto r = os::make_dirs(opts.dir, 0750); !r) return r.error();
  std::unique_ptr<Journal> j(new Journal(loop, std::move(opts)));
  if (auto r = j->recover(); !r) return r.error();
  return j;
}

boost::system::result<void> Journal::recover() {
  // The high-water mark: 20 digits and a newline, created once and rewritten in place; after a
  // clean end, a second line: the note write_clean_mark leaves, cut off here as it is read.
  std::string hwm_path = opts_.dir + "/seq.hwm";
  hwm_fd_.reset(::open(hwm_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0640));
  if (!hwm_fd_) return os::last_error();
  char buf[256] = {};
  ssize_t n = ::pread(hwm_fd_.get(), buf, sizeof buf - 1, 0);
  if (n > 0) std::from_chars(buf, buf + n, hwm_);
  if (n <= 0) persist_high_water(0);  // allocate its block now, while there is room
  if (n > kHwmLine) {
    clean_note_.assign(buf + kHwmLine, static_cast<size_t>(n) - kHwmLine);
    if (::ftruncate(hwm_fd_.get(), kHwmLine) != 0) return os::last_error();
  }
  auto segs = list_segments(opts_.dir);
  for (size_t i = 0; i < segs.size(); ++i) {
    auto& s = segs[i];
    std::string base = opts_.dir + "/" + seg_name(s.first) + ".jsonl";
    bool newest = i + 1 == segs.size();
    if (s.zst && s.plain) {
      ::unlink(base.c_str());  // compressed and renamed; only the unlink was lost
      s.plain = false;
    }
    if (s.plain && !newest) {
      // Sealed but never compressed (the supervisor stopped first): compress it now.
      if (auto r = zstd_compress_file(base, base + ".zst"); r) ::unlink(base.c_str());
    }
  }
  if (segs.empty()) {
    reserve_pending_ = true;
    return {};
  }
  auto& last = segs.back();
  std::string base = opts_.dir + "/" + seg_name(last.first) + ".jsonl";
  if (last.plain) {
    if (auto r = recover_active(base, last.first); !r) return r;
  } else {
    uint64_t seq = last.first - 1;
    auto r = for_each_line(
        base + ".zst", true,
        [&](std::string_view l, uint64_t) {
          if (auto s = line_seq(l)) seq = *s;
          return true;
        },
        // Cut short on disk (damage to a reader): the seq goes on after the last line it still
        // holds, as it did before readers looked for a cut.
        last_frame_offset(base + ".zst"), true);
    if (!r) {
      if (r.error().value() != EBADMSG) return r.error();
      continue_after_unreadable(base + ".zst", last.first, seq, r.error());
    } else {
      last_seq_ = seq;
    }
  }
  // A seq handed out while events waited in memory is never handed out again, even if those
  // events never reached the disk.
  if (hwm_ > last_seq_) {
    log()->warn("recover journal: seq continues after {} (the high-water mark), not {}", hwm_, last_seq_);
    last_seq_ = hwm_;
  }
  make_reserve();
  return {};
}

// The newest segment is sealed and does not decode (a damaged frame, its checksum wrong): the box
// starts all the same (its agent may be waiting in a snapshot), and the sequence goes on past every
// seq that segment can hold. That is its last line's where a frame ending the file still decodes;
// otherwise as many lines as a sealed segment has room for, at their shortest, after its first
// seq (readers see the jump as a gap, the segment as unreadable). `read` is the last seq read
// before the damage.
void Journal::continue_after_unreadable(const std::string& path, uint64_t first, uint64_t read,
                                        const boost::system::error_code& ec) {
  auto found = last_seq_from_the_end(path, first);
  uint64_t bound = first - 1 + opts_.segment_bytes / kMinLineBytes + 1;
  last_seq_ = std::max(read, found ? *found : bound);
  log()->warn("recover journal: segment {} cannot be read ({}): seq continues after {}{}", seg_name(first),
              ec.message(), last_seq_, found ? ", its last line's" : ", past all it can hold");
  recovered_["type"] = "journal.recovered";
  recovered_["branch"] = kOwnBranch;
  recovered_["segment"] = seg_name(first);
  recovered_["unreadable"] = ec.message();
  recovered_["last_seq"] = last_seq_;
  recovered_["last_seq_known"] = found.has_value();
}

namespace {

// The lines of the active segment that recovery keeps, given each whole line's seq (0 for a line
// that is unreadable or whose seq is below the segment's first): the longest run of lines whose
// seqs increase (a longest increasing subsequence, in O(n log n)). A line whose seq was damaged
// breaks the sequence that the lines around it continue, so the run goes past it: keeping each line
// above the last one kept (the rule before) kept a 10 read as 90 and dropped the 22 good lines
// after it. Of runs as long, the one that ends lowest (a line that jumped ahead goes, not the one
// that continues the sequence); of two lines with one seq, the first.
std::vector<bool> longest_run(const std::vector<uint64_t>& seqs) {
  constexpr size_t kNone = SIZE_MAX;
  std::vector<size_t> tails;  // tails[k]: the line ending the lowest-ending run of k + 1 lines so far
  std::vector<size_t> prev(seqs.size(), kNone);
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i] == 0) continue;
    auto it = std::lower_bound(tails.begin(), tails.end(), seqs[i], [&](size_t t, uint64_t v) { return seqs[t] < v; });
    if (it != tails.end() && seqs[*it] == seqs[i]) continue;  // the same seq again: the first stays
    prev[i] = it == tails.begin() ? kNone : *(it - 1);
    if (it == tails.end())
      tails.push_back(i);
    else
      *it = i;
  }
  std::vector<bool> keep(seqs.size(), false);
  for (size_t i = tails.empty() ? kNone : tails.back(); i != kNone; i = prev[i]) keep[i] = true;
  return keep;
}

// A line recovery dropped: its line number in the segment (from 1), the seq it reads (when it has
// one), why (`unreadable`: not JSON with a seq; `duplicate`: a seq a kept line has; `out_of_order`:
// any other seq that breaks the sequence), and the kept seqs around it (0: none).
struct Dropped {
  uint64_t line;
  std::optional<uint64_t> seq;
  const char* reason;
  uint64_t after, before;
};

// What recovery says of the lines it dropped: the first kMaxListed of them, in journal.recovered's
// `skipped` and in the log (the count, `skipped_lines`, has them all).
constexpr size_t kMaxListed = 32;

std::string describe(const std::vector<Dropped>& dropped, size_t total) {
  std::string out;
  for (auto& d : dropped) {
    out += out.empty() ? "" : "; ";
    out += "line " + std::to_string(d.line);
    if (d.seq) out += " (seq " + std::to_string(*d.seq) + ")";
    std::string_view why = d.reason;
    out += why == "unreadable" ? ": unreadable" : why == "duplicate" ? ": a duplicate" : ": out of order";
    if (why == "unreadable") continue;
    if (d.after && d.before)
      out += ", between " + std::to_string(d.after) + " and " + std::to_string(d.before);
    else if (d.after || d.before)
      out += d.after ? ", after " + std::to_string(d.after) : ", before " + std::to_string(d.before);
  }
  if (total > dropped.size()) out += "; and " + std::to_string(total - dropped.size()) + " more";
  return out;
}

// What recovery dropped of the active segment's whole lines.
struct Skipped {
  uint64_t lines = 0, bytes = 0;
  boost::json::array listed;  // the first kMaxListed: {line, seq, reason}
};

// Writes the lines `keep` names (of the whole lines before `end`) over the segment at `path`, beside
// it and renamed over it: a crash in between leaves one whole file or the other. Says in the log
// which lines were dropped and why, and returns it.
boost::system::result<Skipped> rewrite_kept(const std::string& path, uint64_t first, uint64_t end,
                                            const std::vector<uint64_t>& seqs, const std::vector<bool>& keep) {
  std::vector<uint64_t> kept_seqs;  // increasing
  for (size_t i = 0; i < seqs.size(); ++i)
    if (keep[i]) kept_seqs.push_back(seqs[i]);
  std::string kept;
  std::vector<Dropped> listed;
  Skipped out;
  size_t line = 0, k = 0;  // k: the lines kept so far
  JsonCheck json;
  auto r = for_each_line(path, false, [&](std::string_view l, uint64_t at) {
    if (at > end || line >= seqs.size()) return false;
    if (keep[line++]) {
      kept.append(l).push_back('\n');
      ++k;
      return true;
    }
    ++out.lines;
    out.bytes += l.size() + 1;
    if (listed.size() == kMaxListed) return true;
    Dropped d{line, line_seq(l), "out_of_order", k ? kept_seqs[k - 1] : 0, k < kept_seqs.size() ? kept_seqs[k] : 0};
    if (!d.seq || !json.whole(l))
      d.reason = "unreadable";
    else if (std::binary_search(kept_seqs.begin(), kept_seqs.end(), *d.seq))
      d.reason = "duplicate";
    listed.push_back(d);
    return true;
  });
  if (!r) return r.error();
  if (auto w = os::write_file_atomic(path, kept, 0640); !w) return w.error();
  log()->warn("recover journal: dropped {} damaged line(s) ({} bytes) in segment {}, and kept every other: {}",
              out.lines, out.bytes, seg_name(first), describe(listed, out.lines));
  for (auto& d : listed) {
    boost::json::object o{{"line", d.line}};
    if (d.seq) o["seq"] = *d.seq;
    o["reason"] = d.reason;
    out.listed.push_back(std::move(o));
  }
  return out;
}

}  // namespace

// The active segment of the previous run: its whole lines that parse and whose seqs form the
// longest increasing run (longest_run) are kept; a line that does not parse or whose seq breaks that
// run (a bad block, a bit flipped, a hand edit) is dropped, not the end of the journal nor of the
// lines after it; a torn tail (no newline: the writer died mid-write) is cut off. Rewritten only
// when a whole line was dropped.
boost::system::result<void> Journal::recover_active(const std::string& path, uint64_t first) {
  if (resume_clean(path, first)) return {};
  // Read in chunks (for_each_line), not whole: a 16 MiB segment read into one string cost the
  // restart as much in page faults as its check.
  JsonCheck json;
  std::vector<uint64_t> seqs;  // each whole line's seq; 0: unreadable, or below the segment's first
  bool in_order = true;        // every line readable, each above the one before: all kept
  uint64_t end = 0;            // just past the last whole line
  auto r = for_each_line(path, false, [&](std::string_view line, uint64_t at) {
    auto s = line_seq(line);
    uint64_t seq = s && *s >= first && json.whole(line) ? *s : 0;
    in_order = in_order && seq && (seqs.empty() || seq > seqs.back());
    seqs.push_back(seq);
    end = at;
    return true;
  });
  if (!r) return r.error();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return os::last_error();
  uint64_t torn = static_cast<uint64_t>(st.st_size) - end;
  Skipped skipped;
  last_seq_ = first - 1;
  if (in_order) {
    if (torn && ::truncate(path.c_str(), static_cast<off_t>(end)) != 0) return os::last_error();
    if (!seqs.empty()) last_seq_ = seqs.back();
  } else {
    auto keep = longest_run(seqs);
    auto d = rewrite_kept(path, first, end, seqs, keep);
    if (!d) return d.error();
    skipped = std::move(*d);
    for (size_t i = 0; i < seqs.size(); ++i)
      if (keep[i]) last_seq_ = seqs[i];
  }
  if (torn || skipped.lines) {
    recovered_["type"] = "journal.recovered";
    recovered_["branch"] = kOwnBranch;
    recovered_["dropped_bytes"] = torn + skipped.bytes;
    if (skipped.lines) {
      recovered_["skipped_lines"] = skipped.lines;
      recovered_["skipped"] = std::move(skipped.listed);
    }
    recovered_["segment"] = seg_name(first);
    if (torn) log()->warn("recover journal: dropped a torn tail of {} bytes in segment {}", torn, seg_name(first));
  }
  active_.reset(::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NOFOLLOW));
  if (!active_) return os::last_error();
  active_first_ = first;
  active_bytes_ = end - skipped.bytes;
  return {};
}

void Journal::open_segment(uint64_t first_seq) {
  std::string path = opts_.dir + "/" + seg_name(first_seq) + ".jsonl";
  active_.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640));
  if (!active_) log()->error("open segment {}: {}", path, os::last_error().message());
  active_first_ = first_seq;
  active_bytes_ = 0;
  if (std::exchange(reserve_pending_, false)) make_reserve();
}

namespace {
struct CompressWork {
  uv_work_t req;
  Journal* journal;
  std::string plain;
  boost::system::error_code ec;
};
}  // namespace

// A sealed segment waits for a quiet turn of the loop before it is compressed: a turn of
// compress_quiet_ms in which no event was appended. The wait ends at once when more than
// kDeferredSegments are waiting. During a burst of agent output, the compression ran on the same
// 2 cores as the agent, the loop and the clients, and the event path gave way to it. One client
// read 64 MiB at a median of 328 MiB/s with it and 359 without it (bench/ws's C++ reader, 5
// interleaved runs each: 298-365 and 320-463; websocketd 238). The price is disk space: up to
// kDeferredSegments segments stay plain while a burst lasts, past journal.disk_cap if need be
// (enforce_cap drops only compressed ones). The end of the box (flush) compresses what still waits.
// A thread pool work at SCHED_IDLE was measured as well (median 380): a thread that leaves
// SCHED_IDLE needs CAP_SYS_NICE, which a container's supervisor does not have, and the pool's
// threads serve other work after it.
constexpr size_t kDeferredSegments = 4;  // 16 MiB each by default

void Journal::seal_active() {
  active_.reset();
  deferred_.push_back(opts_.dir + "/" + seg_name(active_first_) + ".jsonl");
  if (deferred_.size() > kDeferredSegments || opts_.compress_quiet_ms == 0) return compress_deferred();
  if (!quiet_timer_) {
    quiet_timer_ = loop::make_timer(loop_);
    quiet_timer_->data = this;
  }
  if (uv_is_active(quiet_timer_.handle())) return;
  seq_at_tick_ = last_seq_;
  uv_timer_start(
      quiet_timer_.get(), [](uv_timer_t* t) { static_cast<Journal*>(t->data)->on_quiet_tick(); },
      opts_.compress_quiet_ms, opts_.compress_quiet_ms);
}

void Journal::on_quiet_tick() {
  if (last_seq_ == seq_at_tick_) return compress_deferred();
  seq_at_tick_ = last_seq_;
}

void Journal::compress_deferred() {
  if (quiet_timer_) uv_timer_stop(quiet_timer_.get());
  for (auto& p : std::exchange(deferred_, {})) compress(std::move(p));
}

void Journal::compress(std::string plain) {
  auto* w = new CompressWork{};
  w->req.data = w;
  w->journal = this;
  w->plain = std::move(plain);
  ++pending_compressions_;
  uv_queue_work(
      loop_, &w->req,
      [](uv_work_t* req) {
        auto* w = static_cast<CompressWork*>(req->data);
        if (auto r = zstd_compress_file(w->plain, w->plain + ".zst"); !r)
          w->ec = r.error();
        else
          ::unlink(w->plain.c_str());
      },
      [](uv_work_t* req, int) {
        std::unique_ptr<CompressWork> w(static_cast<CompressWork*>(req->data));
        if (w->ec) log()->error("compress segment {}: {}", w->plain, w->ec.message());
        --w->journal->pending_compressions_;
        w->journal->enforce_cap();
      });
}

uint64_t Journal::disk_bytes() const {
  uint64_t total = 0;
  for (auto& s : list_segments(opts_.dir)) {
    struct stat st {};
    std::string p = opts_.dir + "/" + seg_name(s.first) + (s.zst ? ".jsonl.zst" : ".jsonl");
    if (::stat(p.c_str(), &st) == 0) total += static_cast<uint64_t>(st.st_size);
  }
  return total;
}

void Journal::enforce_cap() {
  if (!opts_.disk_cap || in_append_) return;
  auto segs = list_segments(opts_.dir);
  uint64_t total = 0;
  std::vector<std::pair<uint64_t, uint64_t>> sizes;  // first seq, bytes
  for (auto& s : segs) {
    struct stat st {};
    std::string p = opts_.dir + "/" + seg_name(s.first) + (s.zst ? ".jsonl.zst" : ".jsonl");
    if (::stat(p.c_str(), &st) == 0) {
      total += static_cast<uint64_t>(st.st_size);
      sizes.emplace_back(s.first, static_cast<uint64_t>(st.st_size));
    }
  }
  uint64_t dropped_until = 0;
  for (size_t i = 0; i + 1 < segs.size() && total > opts_.disk_cap; ++i) {
    if (!segs[i].zst) break;  // only sealed, compressed segments go
    std::string p = opts_.dir + "/" + seg_name(segs[i].first) + ".jsonl.zst";
    ::unlink(p.c_str());
    total -= sizes[i].second;
    dropped_until = segs[i + 1].first;
  }
  if (dropped_until) {
    boost::json::object ev{
        {"type", "journal.truncated"}, {"branch", kOwnBranch}, {"first_seq", dropped_until}, {"cap", opts_.disk_cap}};
    append(std::move(ev));
  }
}

boost::json::object Journal::stamp(uint64_t seq, boost::json::object fields) const {
  boost::json::object ev;
  ev.reserve(fields.size() + 4);
  ev["seq"] = seq;  // first: readers take a line's seq without parsing it (line_seq)
  ev["ts"] = base::rfc3339_now();
  ev["type"] = fields.contains("type") ? fields["type"] : boost::json::value("unknown");
  ev["box"] = opts_.box;
  for (auto& kv : fields)
    if (kv.key() != "type") ev[kv.key()] = std::move(kv.value());
  return ev;
}

// The event's line in a buffer of its own, after the headroom a listener may frame it in.
LineBuf Journal::serialize(const boost::json::object& ev) const {
  auto b = std::make_shared<std::string>(opts_.headroom, '\0');
  base::json_append(*b, ev);
  return b;
}

// One line, whole or not at all: a short or failed write is cut back to the last whole line, so
// the segment never holds half an event followed by the next one.
boost::system::result<void> Journal::write_line(uint64_t seq, const LineBuf& buf) {
  if (!active_) open_segment(seq);
  if (!active_) return os::last_error();
  // The line and its newline in one writev: no copy of the event (up to ~800 KiB of escaped
  // output) to add one byte.
  auto r = os::write_line(active_.get(), std::string_view(*buf).substr(opts_.headroom));
  if (!r) {
    if (::ftruncate(active_.get(), static_cast<off_t>(active_bytes_)) != 0)
      log()->error("cut journal segment {} back to {} bytes: {}", seg_name(active_first_), active_bytes_,
                   os::last_error().message());
    return r.error();
  }
  active_bytes_ += line_size(buf) + 1;
  return {};
}

void Journal::publish(uint64_t seq, const boost::json::object& obj, const LineBuf& buf) {
  Event e{seq, obj, std::string_view(*buf).substr(opts_.headroom), buf, opts_.headroom};
  // Listeners may add or remove listeners while being called: iterate over a snapshot of ids.
  std::vector<int> ids;
  for (auto& [id, l] : listeners_) ids.push_back(id);
  for (int id : ids)
    if (auto it = listeners_.find(id); it != listeners_.end()) it->second(e);
  if (active_bytes_ >= opts_.segment_bytes) seal_active();
}

uint64_t Journal::append(boost::json::object fields) {
  if (!recovered_.empty()) {
    auto rec = std::move(recovered_);
    recovered_ = {};
    append(std::move(rec));
  }
  in_append_ = true;
  uint64_t seq = ++last_seq_;
  auto ev = stamp(seq, std::move(fields));
  if (degraded_) {
    auto line = serialize(ev);
    enqueue(seq, std::move(ev), std::move(line));
  } else {
    auto line = serialize(ev);
    if (auto w = write_line(seq, line); w)
      publish(seq, ev, line);
    else
      seq = degrade(w.error(), seq, std::move(ev));
  }
  in_append_ = false;
  return seq;
}

// The first failed write: the reserve is given back so that `journal.degraded` takes the failed
// event's seq and reaches the disk and the clients; the failed event follows it, in memory.
uint64_t Journal::degrade(const boost::system::error_code& ec, uint64_t seq, boost::json::object ev) {
  degraded_ = true;
  spell_ = Spell{.since = std::chrono::steady_clock::now(), .reason = ec.message()};
  release_reserve();
  log()->error(
      "write journal segment {}: {}: events now wait in memory (up to {} bytes, then the agent is stopped) "
      "and are shown once written",
      seg_name(active_first_), ec.message(), opts_.queue_bytes);
  persist_high_water(seq + 1);
  auto d = stamp(seq, {{"type", "journal.degraded"},
                       {"branch", kOwnBranch},
                       {"reason", ec.message()},
                       {"errno", ec.value()},
                       {"queue_bytes", opts_.queue_bytes}});
  auto dline = serialize(d);
  if (write_line(seq, dline))
    publish(seq, d, dline);
  else
    enqueue(seq, std::move(d), std::move(dline));
  uint64_t moved = ++last_seq_;
  ev["seq"] = moved;
  auto line = serialize(ev);
  enqueue(moved, std::move(ev), std::move(line));
  if (!retry_timer_) retry_timer_ = loop::make_timer(loop_);
  retry_timer_->data = this;
  uv_timer_start(
      retry_timer_.get(), [](uv_timer_t* t) { static_cast<Journal*>(t->data)->retry(); }, opts_.retry_ms,
      opts_.retry_ms);
  return moved;
}

void Journal::enqueue(uint64_t seq, boost::json::object obj, LineBuf line) {
  persist_high_water(seq);
  waiting_bytes_ += line_size(line) + 1;
  spell_.events++;
  spell_.bytes += line_size(line) + 1;
  waiting_.push_back({seq, std::move(obj), std::move(line)});
  if (!spell_.stopped && waiting_bytes_ > opts_.queue_bytes) {
    spell_.stopped = true;
    spell_.stopped_at = std::chrono::steady_clock::now();
    log()->error("journal: {} bytes wait for the disk, past the bound of {}: stopping the agent until they are written",
                 waiting_bytes_, opts_.queue_bytes);
    if (pressure_) pressure_(true);
  }
}

// On the retry timer: once the disk has room for what waits (and the reserve), write it in
// order, showing each event as it lands; then say so and let the agent go on.
void Journal::retry(bool insist) {
  if (!degraded_) return;
  if (!insist)
    if (auto space = os::free_room(opts_.dir); space && space->bytes < waiting_bytes_ + 2 * opts_.reserve_bytes + 4096)
      return;
  while (!waiting_.empty()) {
    Waiting w = std::move(waiting_.front());
    waiting_.pop_front();
    if (auto r = write_line(w.seq, w.line); !r) {
      waiting_.push_front(std::move(w));
      return;  // still full: the next turn of the timer tries again
    }
    waiting_bytes_ -= line_size(w.line) + 1;
    publish(w.seq, w.obj, w.line);  // a listener may append: that waits behind, and is written here too
  }
  degraded_ = false;
  retry_timer_.reset();
  auto now = std::chrono::steady_clock::now();
  auto ms = [](auto d) { return std::chrono::round<std::chrono::milliseconds>(d).count(); };
  if (spell_.stopped) {
    spell_.stopped_ms = ms(now - spell_.stopped_at);
    if (pressure_) pressure_(false);
  }
  make_reserve();
  log()->warn("journal: the disk takes writes again; {} events ({} bytes) that waited are written", spell_.events,
              spell_.bytes);
  append({{"type", "journal.recovered"},
          {"branch", kOwnBranch},
          {"after", "degraded"},
          {"reason", spell_.reason},
          {"events", spell_.events},
          {"bytes", spell_.bytes},
          {"degraded_ms", ms(now - spell_.since)},
          {"agent_stopped", spell_.stopped},
          {"stopped_ms", spell_.stopped_ms}});
}

void Journal::make_reserve() {
  if (!opts_.reserve_bytes) return;
  std::string path = opts_.dir + "/reserve";
  os::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) return;
  if (int rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(opts_.reserve_bytes)); rc != 0) {
    log()->warn("reserve {} bytes for the journal in {}: {}", opts_.reserve_bytes, opts_.dir, std::strerror(rc));
    ::unlink(path.c_str());
  }
}

void Journal::release_reserve() { ::unlink((opts_.dir + "/reserve").c_str()); }

void Journal::persist_high_water(uint64_t seq) {
  if (!hwm_fd_ || (seq <= hwm_ && seq != 0)) return;
  hwm_ = seq;
  char buf[32];
  int n = std::snprintf(buf, sizeof buf, "%020llu\n", static_cast<unsigned long long>(seq));
  if (::pwrite(hwm_fd_.get(), buf, static_cast<size_t>(n), 0) != n)
    log()->error("write the journal's high-water mark (seq {}): {}", seq, os::last_error().message());
}

int Journal::add_listener(Listener l) {
  int id = next_listener_++;
  listeners_.emplace(id, std::move(l));
  return id;
}

void Journal::remove_listener(int id) { listeners_.erase(id); }

void Journal::flush() {
  if (degraded_) {
    retry(true);
    if (degraded_ && !waiting_.empty()) {
      log()->error("journal: {} events (seq {} to {}) never reached the disk, which stayed full; no one was shown them",
                   waiting_.size(), waiting_.front().seq, waiting_.back().seq);
      // Said once: they end with this process (the high-water mark keeps their seqs from reuse).
      waiting_.clear();
      waiting_bytes_ = 0;
    }
  }
  compress_deferred();  // at the end, nothing is left plain but the active segment
  // Closed here, while the loop still turns: the supervisor's last turn (~Box) comes before the
  // journal's destructor, and a handle closed after it is never freed (uv_loop_close then finds it
  // open). A seal after this makes a new quiet timer; no retry comes after the end.
  quiet_timer_.reset();
  retry_timer_.reset();
  while (pending_compressions_ > 0) uv_run(loop_, UV_RUN_ONCE);
}

bool Journal::holds_journal(const std::string& dir) {
  return ::access((dir + "/seq.hwm").c_str(), F_OK) == 0 || !list_segments(dir).empty();
}

boost::system::result<void> Journal::read(const std::string& dir, uint64_t since,
                                          const std::function<bool(uint64_t, std::string_view)>& fn, ReadPos* pos,
                                          const GapFn& gap) {
  auto segs = list_segments(dir);
  for (size_t i = 0; i < segs.size(); ++i) {
    // Skip a segment whose successor starts at or before since + 1: nothing in it is wanted.
    if (i + 1 < segs.size() && segs[i + 1].first <= since + 1) continue;
    std::string base = dir + "/" + seg_name(segs[i].first) + ".jsonl";
    bool zst = segs[i].zst;
    uint64_t given = 0;  // the last seq given to fn from this segment
    auto each = [&](bool z) {
      // Where the last read stopped in this segment: the lines before it are all <= since.
      uint64_t from = pos && pos->segment == segs[i].first && pos->zst == z ? pos->offset : 0;
      return for_each_line(
          z ? base + ".zst" : base, z,
          [&](std::string_view l, uint64_t end) {
            auto s = line_seq(l);
            if (!s || *s <= since) return true;
            if (pos) *pos = ReadPos{segs[i].first, end, z};
            given = *s;
            // A line an older sandboxer wrote with a byte that is not UTF-8 (a name a message
            // quoted; base::json_append writes none): as text, which every client's parser
            // needs. Its bytes outside strings are JSON's own, all ASCII.
            if (base::utf8_valid_prefix(l) != l.size()) return fn(*s, base::utf8_lossy(l));
            return fn(*s, l);
          },
          from);
    };
    auto r = each(zst);
    if (!r && r.error().value() == ENOENT && !zst) {  // compressed and unlinked meanwhile
      zst = true;
      r = each(true);
    }
    if (r && !*r) return {};
    if (r) continue;
    if (!gap) return r.error();
    // What this segment holds after since and after the lines it gave, up to the next one's first.
    Gap g{std::max({since, given, segs[i].first - 1}) + 1, i + 1 < segs.size() ? segs[i + 1].first - 1 : 0,
          seg_name(segs[i].first) + (zst ? ".jsonl.zst" : ".jsonl"), r.error()};
    if ((g.last == 0 || g.first <= g.last) && !gap(g)) return {};
  }
  return {};
}

std::string Journal::describe(const Gap& g) { return describe(g.segment, g.error.message(), g.first, g.last); }

std::string Journal::describe(std::string_view segment, std::string_view error, uint64_t first, uint64_t last) {
  std::string seqs = last == 0       ? "its seqs from " + std::to_string(first) + " on"
                     : first == last ? "seq " + std::to_string(first)
                                     : "seqs " + std::to_string(first) + " to " + std::to_string(last);
  return "segment " + std::string(segment) + " cannot be read (" + std::string(error) + "): " + seqs + " skipped";
}

std::string Journal::unreadable_event(const Gap& g, uint64_t last, std::string_view box) {
  boost::json::object ev;
  ev["seq"] = last;
  ev["ts"] = base::rfc3339_now();
  ev["type"] = "journal.unreadable";
  if (!box.empty()) ev["box"] = box;
  ev["first_seq"] = g.first;
  ev["last_seq"] = last;
  ev["segment"] = g.segment;
  ev["error"] = g.error.message();
  ev["branch"] = kOwnBranch;
  std::string line;
  base::json_append(line, ev);
  return line;
}

std::optional<std::string> Journal::last_line(const std::string& dir) {
  auto segs = list_segments(dir);
  std::optional<std::string> last;
  // Newest first: a segment just begun may hold no line yet.
  for (auto s = segs.rbegin(); s != segs.rend() && !last; ++s)
    (void)read(dir, s->first > 0 ? s->first - 1 : 0, [&](uint64_t, std::string_view line) {
      last = std::string(line);
      return true;
    });
  return last;
}

}  // namespace sbx::journal
