#include "journal/journal.hpp"

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
// Calls fn(line, end) for every whole line; `end` is the file offset just past the line's newline
// (of the decompressed stream for a .zst). A plain file is read from byte `from` on, which must be
// the start of a line.
boost::system::result<bool> for_each_line(const std::string& path, bool zst,
                                          const std::function<bool(std::string_view, uint64_t)>& fn,
                                          uint64_t from = 0) {
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return {boost::system::in_place_error, os::last_error()};
  if (!zst && from > 0 && ::lseek(fd.get(), static_cast<off_t>(from), SEEK_SET) < 0)
    return {boost::system::in_place_error, os::last_error()};
  std::string pending;
  uint64_t pending_at = zst ? 0 : from;  // the file offset of pending[0]
  auto feed = [&](std::string_view chunk) -> bool {
    pending.append(chunk);
    size_t start = 0;
    for (;;) {
      size_t nl = pending.find('\n', start);
      if (nl == std::string::npos) break;
      if (!fn(std::string_view(pending).substr(start, nl - start), pending_at + nl + 1)) return false;
      start = nl + 1;
    }
    pending.erase(0, start);
    pending_at += start;
    return true;
  };
  std::vector<char> in(1 << 17), out(1 << 18);
  std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> dctx(zst ? ZSTD_createDCtx() : nullptr, ZSTD_freeDCtx);
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
      if (ZSTD_isError(r))
        return {boost::system::in_place_error, boost::system::error_code(EBADMSG, boost::system::system_category())};
      if (!feed({out.data(), ob.pos})) return false;
    }
  }
  // A last line without its newline is torn: the writer died mid-write. Readers skip it.
  return true;
}

}  // namespace

boost::system::result<void> zstd_compress_file(const std::string& src, const std::string& dst, int level) {
  os::UniqueFd in(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return os::last_error();
  std::string tmp = dst + ".tmp";
  os::UniqueFd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640));
  if (!out) return os::last_error();
  std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> cctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_checksumFlag, 1);
  std::vector<char> ibuf(ZSTD_CStreamInSize()), obuf(ZSTD_CStreamOutSize());
  for (;;) {
    ssize_t n = ::read(in.get(), ibuf.data(), ibuf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return os::last_error();
    }
    bool last = n == 0;
    ZSTD_inBuffer ib{ibuf.data(), static_cast<size_t>(n), 0};
    bool done = false;
    while (!done) {
      ZSTD_outBuffer ob{obuf.data(), obuf.size(), 0};
      size_t rem = ZSTD_compressStream2(cctx.get(), &ob, &ib, last ? ZSTD_e_end : ZSTD_e_continue);
      if (ZSTD_isError(rem)) return boost::system::error_code(EIO, boost::system::system_category());
      if (auto r = os::write_all(out.get(), {obuf.data(), ob.pos}); !r) return r.error();
      done = last ? rem == 0 : ib.pos == ib.size;
    }
    if (last) break;
  }
  if (::fsync(out.get()) != 0) return os::last_error();
  out.reset();
  if (::rename(tmp.c_str(), dst.c_str()) != 0) return os::last_error();
  return {};
}

Journal::Journal(uv_loop_t* loop, JournalOptions opts) : loop_(loop), opts_(std::move(opts)) {}

Journal::~Journal() { flush(); }

boost::system::result<std::unique_ptr<Journal>> Journal::open(uv_loop_t* loop, JournalOptions opts) {
  if (auto r = os::make_dirs(opts.dir, 0750); !r) return r.error();
  std::unique_ptr<Journal> j(new Journal(loop, std::move(opts)));
  if (auto r = j->recover(); !r) return r.error();
  return j;
}

boost::system::result<void> Journal::recover() {
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
  if (segs.empty()) return {};
  auto& last = segs.back();
  std::string base = opts_.dir + "/" + seg_name(last.first) + ".jsonl";
  if (last.plain) {
    // The active segment of the previous run: keep every whole line, drop a torn tail.
    auto content = os::read_file(base);
    if (!content) return content.error();
    std::string_view c = *content;
    size_t good = 0;
    uint64_t seq = 0;
    size_t pos = 0;
    while (pos < c.size()) {
      size_t nl = c.find('\n', pos);
      if (nl == std::string_view::npos) break;
      auto s = line_seq(c.substr(pos, nl - pos));
      boost::system::error_code ec;
      boost::json::parse(c.substr(pos, nl - pos), ec);
      if (!s || ec) break;
      seq = *s;
      pos = nl + 1;
      good = pos;
    }
    if (good < c.size()) {
      if (::truncate(base.c_str(), static_cast<off_t>(good)) != 0) return os::last_error();
      recovered_["type"] = "journal.recovered";
      recovered_["dropped_bytes"] = c.size() - good;
      recovered_["segment"] = seg_name(last.first);
      log()->warn("recover journal: dropped a torn tail of {} bytes in segment {}", c.size() - good,
                  seg_name(last.first));
    }
    last_seq_ = seq ? seq : last.first - 1;
    active_.reset(::open(base.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC));
    if (!active_) return os::last_error();
    active_first_ = last.first;
    active_bytes_ = good;
  } else {
    uint64_t seq = last.first - 1;
    auto r = for_each_line(base + ".zst", true, [&](std::string_view l, uint64_t) {
      if (auto s = line_seq(l)) seq = *s;
      return true;
    });
    if (!r) return r.error();
    last_seq_ = seq;
  }
  return {};
}

void Journal::open_segment(uint64_t first_seq) {
  std::string path = opts_.dir + "/" + seg_name(first_seq) + ".jsonl";
  active_.reset(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640));
  if (!active_) log()->error("open segment {}: {}", path, os::last_error().message());
  active_first_ = first_seq;
  active_bytes_ = 0;
}

namespace {
struct CompressWork {
  uv_work_t req;
  Journal* journal;
  std::string plain;
  boost::system::error_code ec;
};
}  // namespace

void Journal::seal_active() {
  active_.reset();
  auto* w = new CompressWork{};
  w->req.data = w;
  w->journal = this;
  w->plain = opts_.dir + "/" + seg_name(active_first_) + ".jsonl";
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
    boost::json::object ev{{"type", "journal.truncated"}, {"first_seq", dropped_until}, {"cap", opts_.disk_cap}};
    append(std::move(ev));
  }
}

uint64_t Journal::append(boost::json::object fields) {
  if (!recovered_.empty()) {
    auto rec = std::move(recovered_);
    recovered_ = {};
    append(std::move(rec));
  }
  in_append_ = true;
  boost::json::object ev;
  ev.reserve(fields.size() + 4);
  uint64_t seq = ++last_seq_;
  ev["seq"] = seq;
  ev["ts"] = base::rfc3339_now();
  ev["type"] = fields.contains("type") ? fields["type"] : boost::json::value("unknown");
  ev["box"] = opts_.box;
  for (auto& kv : fields)
    if (kv.key() != "type") ev[kv.key()] = std::move(kv.value());
  std::string line = boost::json::serialize(ev);
  if (!active_) open_segment(seq);
  line.push_back('\n');
  if (active_) {
    if (auto r = os::write_all(active_.get(), line); !r) log()->error("write journal segment: {}", r.error().message());
    active_bytes_ += line.size();
  }
  line.pop_back();
  Event e{seq, ev, line};
  // Listeners may add or remove listeners while being called: iterate over a snapshot of ids.
  std::vector<int> ids;
  for (auto& [id, l] : listeners_) ids.push_back(id);
  for (int id : ids)
    if (auto it = listeners_.find(id); it != listeners_.end()) it->second(e);
  if (active_bytes_ >= opts_.segment_bytes) seal_active();
  in_append_ = false;
  return seq;
}

int Journal::add_listener(Listener l) {
  int id = next_listener_++;
  listeners_.emplace(id, std::move(l));
  return id;
}

void Journal::remove_listener(int id) { listeners_.erase(id); }

void Journal::flush() {
  while (pending_compressions_ > 0) uv_run(loop_, UV_RUN_ONCE);
}

boost::system::result<void> Journal::read(const std::string& dir, uint64_t since,
                                          const std::function<bool(uint64_t, std::string_view)>& fn, ReadPos* pos) {
  auto segs = list_segments(dir);
  for (size_t i = 0; i < segs.size(); ++i) {
    // Skip a segment whose successor starts at or before since + 1: nothing in it is wanted.
    if (i + 1 < segs.size() && segs[i + 1].first <= since + 1) continue;
    std::string base = dir + "/" + seg_name(segs[i].first) + ".jsonl";
    bool zst = segs[i].zst;
    auto each = [&](bool z) {
      // Where the last read stopped in this plain segment: the lines before it are all <= since.
      uint64_t from = !z && pos && pos->segment == segs[i].first ? pos->offset : 0;
      return for_each_line(
          z ? base + ".zst" : base, z,
          [&](std::string_view l, uint64_t end) {
            auto s = line_seq(l);
            if (!s || *s <= since) return true;
            if (pos) *pos = z ? ReadPos{} : ReadPos{segs[i].first, end};
            return fn(*s, l);
          },
          from);
    };
    auto r = each(zst);
    if (!r && r.error().value() == ENOENT && !zst) r = each(true);  // compressed and unlinked meanwhile
    if (!r) return r.error();
    if (!*r) return {};
  }
  return {};
}

}  // namespace sbx::journal
