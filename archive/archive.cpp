#include "archive/archive.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <linux/openat2.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "archive/chunks.hpp"
#include "archive/hash.hpp"
#include "archive/libarchive.hpp"
#include "base/encoding.hpp"
#include "os/files.hpp"
#include "os/openssl.hpp"
#include "os/sys.hpp"
#include "os/unique-fd.hpp"

namespace sbx::archive {

namespace fs = std::filesystem;
namespace json = boost::json;

namespace {

// The loaded library: only after the public function that got here checked libraries().
const LibArchive& la() { return **libarchive(); }

// What writing and reading archives loads at its first use: libarchive, and libcrypto for the
// hashes and signatures (os/openssl.hpp). Else why not, naming the soname.
base::Result<void> libraries() {
  if (const auto& lib = libarchive(); !lib) return lib.error();
  if (const auto& lib = os::libcrypto(); !lib) return lib.error();
  return {};
}

// The archive's bytes, hashed (the snapshot's id) and written to its file (fd >= 0) on a thread of
// its own, beside the thread that reads the files and feeds the compressor (inline, the hash was
// ~0.5 s per GiB on that thread; on a 2-core machine whose cores the compressor's workers already
// fill, the sealing takes as long either way). At most kQueued blocks of ~1 MiB wait.
class HashWriter {
 public:
  explicit HashWriter(int fd) : fd_(fd), thread_([this] { run(); }) {}
  ~HashWriter() { (void)finish(); }
  HashWriter(const HashWriter&) = delete;
  HashWriter& operator=(const HashWriter&) = delete;

  // False once a write failed (error()).
  bool put(const char* p, size_t n) {
    block_.append(p, n);
    if (block_.size() >= kBlock) return push();
    return !failed_.load();
  }
  // Writes what is left and waits for the thread: the errno of a failed write, or 0.
  int finish() {
    if (thread_.joinable()) {
      if (!block_.empty()) (void)push();
      {
        std::lock_guard l(mu_);
        done_ = true;
      }
      cv_.notify_all();
      thread_.join();
    }
    return error_;
  }
  int error() const { return failed_.load() ? error_ : 0; }
  Sha256& sha() { return sha_; }  // after finish()
  uint64_t bytes() const { return bytes_; }

 private:
  static constexpr size_t kBlock = 1u << 20, kQueued = 8, kSyncBytes = 8u << 20;
  bool push() {
    std::unique_lock l(mu_);
    cv_.wait(l, [this] { return q_.size() < kQueued || failed_.load(); });
    bytes_ += block_.size();
    q_.push_back(std::move(block_));
    block_ = std::string();
    block_.reserve(kBlock + (128u << 10));
    l.unlock();
    cv_.notify_all();
    return !failed_.load();
  }
  void run() {
    for (;;) {
      std::unique_lock l(mu_);
      cv_.wait(l, [this] { return !q_.empty() || done_; });
      if (q_.empty()) return;
      std::string b = std::move(q_.front());
      q_.pop_front();
      l.unlock();
      cv_.notify_all();
      if (failed_.load()) continue;
      sha_.update(b.data(), b.size());
      if (fd_ < 0) continue;
      if (auto r = os::write_all(fd_, b); !r) {
        error_ = r.error().value();
        failed_.store(true);
        cv_.notify_all();
        continue;
      }
      // Writeback starts as the file grows (8 MiB at a time), so the fsync that seals the
      // archive waits for the last few blocks, not for all of it.
      written_ += b.size();
      if (written_ - synced_ >= kSyncBytes) {
        (void)::sync_file_range(fd_, static_cast<off_t>(synced_), static_cast<off_t>(written_ - synced_),
                                SYNC_FILE_RANGE_WRITE);
        synced_ = written_;
      }
    }
  }
  int fd_;
  std::string block_;
  std::deque<std::string> q_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::atomic<bool> failed_{false};
  int error_ = 0;
  Sha256 sha_;
  uint64_t bytes_ = 0;
  uint64_t written_ = 0, synced_ = 0;  // the writer thread's
  std::thread thread_;                 // last: started once the rest is ready
};

// Where libarchive's tar stream goes: compressed here with libzstd (a frame with a content
// checksum, which libarchive's zstd filter does not write: with it, a flipped byte anywhere in the
// file is an error at extraction, not only where the manifest's hashes look), then into the
// file, hashed and counted on the way (HashWriter; without a file, hashed and counted only).
struct Sink {
  std::unique_ptr<HashWriter> writer;
  int error = 0;
  std::string zerror;
  ZSTD_CCtx* z = nullptr;  // null: no archive file, the chunk store only
  // The tar stream itself, when it goes to a chunk store, which hashes it for the chunk list. No
  // hash of its own here: an archive file alone is named by its own hash and checked by its
  // files', and each further SHA-256 pass over the payload costs ~0.55 s per GiB of every
  // checkpoint after the agent's pause (this one was a second hash of the list's stream).
  ChunkWriter* chunks = nullptr;
  std::string chunk_error;
  std::vector<char> out = std::vector<char>(ZSTD_CStreamOutSize());

  ~Sink() { ZSTD_freeCCtx(z); }
  bool put(const char* p, size_t n) {
    if (writer->put(p, n)) return true;
    error = writer->error();
    return false;
  }
  // Feeds `n` bytes (or, with end, finishes the frame) through the compressor.
  bool feed(const void* buf, size_t n, ZSTD_EndDirective how) {
    ZSTD_inBuffer in{buf, n, 0};
    for (;;) {
      ZSTD_outBuffer o{out.data(), out.size(), 0};
      size_t left = ZSTD_compressStream2(z, &o, &in, how);
      if (ZSTD_isError(left)) {
        zerror = ZSTD_getErrorName(left);
        return false;
      }
      if (o.pos && !put(out.data(), o.pos)) return false;
      if (how == ZSTD_e_end ? left == 0 : in.pos == in.size) return true;
    }
  }
};

la_ssize_t sink_write(struct archive*, void* data, const void* buf, size_t n) {
  auto* s = static_cast<Sink*>(data);
  if (s->chunks) {
    if (auto r = s->chunks->write(buf, n); !r) {
      s->chunk_error = r.error().message;
      return -1;
    }
  }
  if (!s->z) return static_cast<la_ssize_t>(n);
  return s->feed(buf, n, ZSTD_e_continue) ? static_cast<la_ssize_t>(n) : -1;
}

int sink_close(struct archive*, void* data) {
  auto* s = static_cast<Sink*>(data);
  if (!s->z) return ARCHIVE_OK;
  return s->feed(nullptr, 0, ZSTD_e_end) ? ARCHIVE_OK : ARCHIVE_FATAL;
}

struct ArchiveDeleter {
  void operator()(struct archive* a) const { la().archive_write_free(a); }
};
// Where libarchive's tar reader takes its bytes from: the file, decompressed here with libzstd.
// libarchive's tar reader stops at the end-of-archive blocks and its own zstd filter would never
// reach the frame's end, where the content checksum is checked: drain() reads on to the end.
struct Source {
  int fd = -1;
  ZSTD_DCtx* z = ZSTD_createDCtx();
  std::vector<char> in = std::vector<char>(ZSTD_DStreamInSize());
  std::vector<char> out = std::vector<char>(ZSTD_DStreamOutSize());
  ZSTD_inBuffer ib{in.data(), 0, 0};
  size_t last = 1;  // ZSTD_decompressStream's last answer: 0 when a frame ended (and checked)
  bool file_ended = false;
  std::string error;
  // What the stream may expand to: a bound set from the manifest, so a decompression bomb (in an
  // entry, or past the end of the tar stream, which drain() reads) stops at it.
  uint64_t produced = 0;
  uint64_t limit = UINT64_MAX;
  // Or the tar stream comes from the chunk store, each chunk checked against its hash.
  ChunkReader* chunks = nullptr;
  const char* data = nullptr;  // where next()'s bytes are

  ~Source() { ZSTD_freeDCtx(z); }
  bool bounded(size_t n) {
    produced += n;
    if (produced <= limit) return true;
    error = "the archive expands beyond " + std::to_string(limit) +
            " bytes, more than its manifest lists: refused as a decompression bomb";
    return false;
  }
  // The next decompressed bytes: >0 bytes, 0 at the end of the file, -1 on an error.
  ssize_t next() {
    if (chunks) {
      auto v = chunks->next();
      if (!v) {
        error = v.error().message;
        return -1;
      }
      if (!bounded(v->size())) return -1;
      data = v->data();
      return static_cast<ssize_t>(v->size());
    }
    for (;;) {
      if (ib.pos == ib.size && !file_ended) {
        ssize_t n;
        do n = ::read(fd, in.data(), in.size());
        while (n < 0 && errno == EINTR);
        if (n < 0) {
          error = std::strerror(errno);
          return -1;
        }
        ib = {in.data(), static_cast<size_t>(n), 0};
        file_ended = n == 0;
      }
      if (ib.pos == ib.size && file_ended) {
        if (last != 0) {
          error = "the zstd stream ends inside a frame";
          return -1;
        }
        return 0;
      }
      ZSTD_outBuffer ob{out.data(), out.size(), 0};
      last = ZSTD_decompressStream(z, &ob, &ib);
      if (ZSTD_isError(last)) {
        error = std::string("zstd: ") + ZSTD_getErrorName(last);
        return -1;
      }
      if (!bounded(ob.pos)) return -1;
      if (ob.pos) {
        data = out.data();
        return static_cast<ssize_t>(ob.pos);
      }
    }
  }
  // Reads what is left of the stream, so the frame's checksum is checked; false (and error) if
  // the stream is damaged or cut.
  bool drain() {
    for (;;) {
      ssize_t n = next();
      if (n < 0) return false;
      if (n == 0) return true;
    }
  }
};

la_ssize_t source_read(struct archive*, void* data, const void** buf) {
  auto* s = static_cast<Source*>(data);
  ssize_t n = s->next();
  *buf = s->data;
  return n;
}

struct ReadDeleter {
  void operator()(struct archive* a) const { la().archive_read_free(a); }
};
struct EntryDeleter {
  void operator()(struct archive_entry* e) const { la().archive_entry_free(e); }
};

// Relative paths under root, parents before children, in a stable order.
void walk(const fs::path& root, const fs::path& rel, std::vector<fs::path>& out) {
  std::vector<fs::path> kids;
  std::error_code ec;
  for (auto& de : fs::directory_iterator(root / rel, ec)) kids.push_back(rel / de.path().filename());
  std::sort(kids.begin(), kids.end());
  for (auto& k : kids) {
    out.push_back(k);
    struct stat st {};
    if (::lstat((root / k).c_str(), &st) == 0 && S_ISDIR(st.st_mode)) walk(root, k, out);
  }
}

}  // namespace

base::Result<std::string> sha256_file(const std::string& path) {
  if (const auto& lib = os::libcrypto(); !lib) return lib.error();
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return base::fail("open " + path + ": " + std::strerror(errno));
  Sha256 sha;
  std::vector<char> buf(1 << 20);
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return base::fail("read " + path + ": " + std::strerror(errno));
    if (n == 0) break;
    sha.update(buf.data(), static_cast<size_t>(n));
  }
  return sha.hex();
}

namespace {

// A file's data extents (offset, length), the holes between them.
using Extents = std::vector<std::pair<off_t, off_t>>;

// The payload as the first pass of write_archive found it: every entry's manifest line is known
// (and signed) before the first byte of the tar stream is written.
struct Planned {
  fs::path rel;
  struct stat st {};
  std::string target;     // a symlink's text, or the path of the first name of a hard link's inode
  std::string sha;        // a regular file's
  bool hardlink = false;  // a further name of an inode planned before: a hard link entry
  bool sparse = false;    // a regular file with holes: only its `extents` are in the stream
  Extents extents;
};

bool is_utf8(std::string_view s) { return base::utf8_valid_prefix(s) == s.size(); }

// At most this many data extents per sparse entry (the smallest holes between more are taken as
// data, zeros in the stream): the GNU sparse map before its data is then a few KiB, well within
// what an importer allows a tar entry beyond its data (kEntryOverhead).
constexpr size_t kMaxExtents = 128;

// The smallest gaps between `x`'s extents closed until at most kMaxExtents are left.
void coalesce(Extents& x) {
  if (x.size() <= kMaxExtents) return;
  std::vector<off_t> gaps, top;
  for (size_t i = 0; i + 1 < x.size(); ++i) gaps.push_back(x[i + 1].first - (x[i].first + x[i].second));
  top = gaps;
  std::nth_element(top.begin(), top.begin() + (kMaxExtents - 2), top.end(), std::greater<>());
  off_t cut = top[kMaxExtents - 2];  // the smallest gap kept
  auto equal_kept = std::count(top.begin(), top.begin() + (kMaxExtents - 1), cut);
  Extents out{x[0]};
  for (size_t i = 0; i < gaps.size(); ++i) {
    if (gaps[i] > cut || (gaps[i] == cut && equal_kept-- > 0))
      out.push_back(x[i + 1]);
    else
      out.back().second = x[i + 1].first + x[i + 1].second - out.back().first;
  }
  x = std::move(out);
}

// The data extents of the regular file `path` (`size` bytes): nullopt where it has no hole or its
// filesystem cannot say (lseek SEEK_DATA / SEEK_HOLE). A file of holes only gets its last byte as
// data: libarchive (3.6.2) reads a sparse entry whose map holds no byte as empty.
std::optional<Extents> data_extents(const std::string& path, off_t size) {
  if (size == 0) return std::nullopt;
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return std::nullopt;  // the hash that follows says why
  Extents x;
  for (off_t pos = 0; pos < size;) {
    off_t start = ::lseek(fd.get(), pos, SEEK_DATA);
    if (start < 0 && errno == ENXIO) break;
    off_t end = start < 0 ? -1 : ::lseek(fd.get(), start, SEEK_HOLE);
    if (end < 0) return std::nullopt;
    if (start >= size) break;
    end = std::min(end, size);
    x.emplace_back(start, end - start);
    pos = end;
  }
  if (x.size() == 1 && x[0].first == 0 && x[0].second == size) return std::nullopt;
  if (x.empty()) x.emplace_back(size - 1, 1);
  coalesce(x);
  return x;
}

// The manifest lists a path as a key of `files`, or, where it is not UTF-8 (a name is any bytes
// but '/' and NUL, and JSON text is UTF-8), as the base64 of its bytes, a key of `files_b64`; a
// symlink's text likewise, as `target` or `target_b64`.
// A file's size goes into `raw` before it is hashed: past `max_bytes`, nothing more is read.
base::Result<void> plan_payload(const std::string& src_dir, std::vector<Planned>& plan, json::object& files,
                                json::object& files_b64, uint64_t& raw, uint64_t max_bytes) {
  std::vector<fs::path> paths;
  walk(src_dir, "", paths);
  std::map<std::pair<dev_t, ino_t>, std::string> firsts;  // inodes of several names: the first's path
  auto text = [](json::object& f, const char* key, const std::string& s) {
    if (is_utf8(s))
      f[key] = s;
    else
      f[std::string(key) + "_b64"] = base::base64_encode(s);
  };
  for (auto& rel : paths) {
    Planned p{rel};
    std::string full = (fs::path(src_dir) / rel).string();
    if (::lstat(full.c_str(), &p.st) != 0) continue;
    json::object f;
    if (S_ISDIR(p.st.st_mode)) {
      f = {{"type", "dir"}};
    } else if (S_ISLNK(p.st.st_mode)) {
      char target[4096];
      ssize_t n = ::readlink(full.c_str(), target, sizeof target - 1);
      if (n <= 0) continue;
      p.target.assign(target, static_cast<size_t>(n));
      f = {{"type", "symlink"}};
      text(f, "target", p.target);
    } else if (auto inode = std::make_pair(p.st.st_dev, p.st.st_ino); S_ISREG(p.st.st_mode) && firsts.contains(inode)) {
      // A further name of an inode: its owner and mode are listed with the first.
      p.hardlink = true;
      p.target = firsts[inode];
      f = {{"type", "hardlink"}};
      text(f, "target", p.target);
    } else if (S_ISREG(p.st.st_mode)) {
      raw += static_cast<uint64_t>(p.st.st_size);
      if (raw > max_bytes)
        return base::fail("archive the snapshot: its files hold more than " + std::to_string(max_bytes) +
                              " bytes (holes included; " + rel.string() + " takes it to " + std::to_string(raw) +
                              "), what an archive may expand to (--max-archive-bytes): no box with that bound "
                              "could restore it",
                          "limit");
      if (auto x = data_extents(full, p.st.st_size)) {
        p.sparse = true;
        p.extents = std::move(*x);
      }
      auto sha = sha256_file(full);
      if (!sha) return sha.error();
      p.sha = *sha;
      if (p.st.st_nlink > 1) firsts[inode] = rel.string();
      f = {{"type", "file"}, {"size", p.st.st_size}, {"sha256", p.sha}};
    } else {
      continue;  // sockets, fifos and devices in a writable layer are not part of a snapshot
    }
    // Owner and mode are signed with the rest: a copy from an archive gets the files its parent had.
    if (!p.hardlink) {
      f["uid"] = p.st.st_uid;
      f["gid"] = p.st.st_gid;
    }
    if (!S_ISLNK(p.st.st_mode) && !p.hardlink) f["mode"] = p.st.st_mode & 07777;
    std::string key = rel.string();
    if (is_utf8(key))
      files[key] = std::move(f);
    else
      files_b64[base::base64_encode(key)] = std::move(f);
    plan.push_back(std::move(p));
  }
  return {};
}

// A small regular entry (manifest.json, signature.json).
bool write_blob(struct archive* a, const char* name, const std::string& text) {
  std::unique_ptr<struct archive_entry, EntryDeleter> e(la().archive_entry_new());
  la().archive_entry_copy_pathname(e.get(), name);
  la().archive_entry_set_filetype(e.get(), AE_IFREG);
  la().archive_entry_set_perm(e.get(), 0644);
  la().archive_entry_set_size(e.get(), static_cast<la_int64_t>(text.size()));
  return la().archive_write_header(a, e.get()) == ARCHIVE_OK &&
         la().archive_write_data(a, text.data(), text.size()) == static_cast<la_ssize_t>(text.size());
}

// A payload entry's header. A name or symlink text that libarchive cannot translate to UTF-8 (the
// pax default, from the supervisor's "C" locale: any byte past 0x7f) is written as its bytes, with
// hdrcharset=BINARY in that entry's pax header, and ARCHIVE_WARN says so: every ARCHIVE_WARN of
// the pax writer's header is such a fallback, the entry written whole. Entries of ASCII names
// stay as they were, byte for byte.
bool header_written(struct archive* a, struct archive_entry* e) {
  int r = la().archive_write_header(a, e);
  return r == ARCHIVE_OK || r == ARCHIVE_WARN;
}

// One planned entry. The payload is the supervisor's own staging copy (in its state dir, which no
// agent sees), so a file is not hashed a second time: its size must still be its plan's, and an
// importer checks every byte against the manifest anyway.
// Returns "" or what went wrong ("archive" when libarchive or the sink says why).
std::string write_payload_entry(struct archive* a, const std::string& src_dir, const Planned& p,
                                std::vector<char>& buf) {
  std::string full = (fs::path(src_dir) / p.rel).string();
  std::unique_ptr<struct archive_entry, EntryDeleter> e(la().archive_entry_new());
  la().archive_entry_copy_pathname(e.get(), p.rel.c_str());
  la().archive_entry_set_perm(e.get(), p.st.st_mode & 07777);
  la().archive_entry_set_uid(e.get(), p.st.st_uid);
  la().archive_entry_set_gid(e.get(), p.st.st_gid);
  la().archive_entry_set_mtime(e.get(), p.st.st_mtim.tv_sec, p.st.st_mtim.tv_nsec);
  if (S_ISDIR(p.st.st_mode)) {
    la().archive_entry_set_filetype(e.get(), AE_IFDIR);
    return header_written(a, e.get()) ? "" : "archive";
  }
  if (S_ISLNK(p.st.st_mode)) {
    la().archive_entry_set_filetype(e.get(), AE_IFLNK);
    la().archive_entry_copy_symlink(e.get(), p.target.c_str());
    return header_written(a, e.get()) ? "" : "archive";
  }
  la().archive_entry_set_filetype(e.get(), AE_IFREG);
  if (p.hardlink) {
    la().archive_entry_copy_hardlink(e.get(), p.target.c_str());
    la().archive_entry_set_size(e.get(), 0);
    return header_written(a, e.get()) ? "" : "archive";
  }
  os::UniqueFd in(::open(full.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!in) return "open " + full + ": " + std::strerror(errno);
  la().archive_entry_set_size(e.get(), p.st.st_size);
  // A sparse entry: its data extents (libarchive adds an empty one at the end of a last hole).
  for (auto [at, len] : p.extents) la().archive_entry_sparse_add_entry(e.get(), at, len);
  if (!header_written(a, e.get())) return "archive";
  // The writer takes the whole contents and leaves out its holes unread: they are given as zeros.
  static const std::vector<char> zeros(1 << 20);
  auto hole = [&](uint64_t n) {
    for (; n > 0; n -= std::min<uint64_t>(n, zeros.size()))
      if (auto k = std::min<uint64_t>(n, zeros.size()); la().archive_write_data(a, zeros.data(), k) != la_ssize_t(k))
        return false;
    return true;
  };
  auto data = [&](off_t at, uint64_t left) -> std::string {
    while (left > 0) {
      ssize_t n = ::pread(in.get(), buf.data(), std::min<uint64_t>(buf.size(), left), at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        return "read " + full + ": " + (n < 0 ? std::strerror(errno) : "the file shrank while it was archived");
      if (la().archive_write_data(a, buf.data(), static_cast<size_t>(n)) != n) return "archive";
      left -= static_cast<uint64_t>(n);
      at += n;
    }
    return "";
  };
  if (!p.sparse) return data(0, static_cast<uint64_t>(p.st.st_size));
  off_t pos = 0;
  for (auto [at, len] : p.extents) {
    if (!hole(static_cast<uint64_t>(at - pos))) return "archive";
    if (auto why = data(at, static_cast<uint64_t>(len)); !why.empty()) return why;
    pos = at + len;
  }
  return hole(static_cast<uint64_t>(p.st.st_size - pos)) ? "" : "archive";
}

base::Result<void> start_compressor(Sink& sink, int fd, int level) {
  sink.writer = std::make_unique<HashWriter>(fd);
  sink.z = ZSTD_createCCtx();
  if (!sink.z) return base::fail("start the archive: no memory for a zstd context");
  ZSTD_CCtx_setParameter(sink.z, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(sink.z, ZSTD_c_checksumFlag, 1);
  (void)ZSTD_CCtx_setParameter(sink.z, ZSTD_c_nbWorkers, 2);  // a libzstd without threads says no: fine
  return {};
}

}  // namespace

base::Result<ArchiveInfo> write_archive(const std::string& src_dir, boost::json::object manifest,
                                        const std::string& dst, int level, const SigningKey* key) {
  return write_snapshot(src_dir, std::move(manifest), {dst, nullptr}, level, key);
}

base::Result<ArchiveInfo> write_snapshot(const std::string& src_dir, boost::json::object manifest,
                                         const SnapshotOut& to, int level, const SigningKey* key) {
  if (auto lib = libraries(); !lib) return lib.error();
  const std::string& dst = to.archive;
  // First the manifest (and its signature), so a reader can check them before any payload.
  std::vector<Planned> plan;
  json::object files, files_b64;
  uint64_t raw = 0;
  if (auto planned = plan_payload(src_dir, plan, files, files_b64, raw, to.max_bytes); !planned) return planned.error();
  bool links = std::any_of(plan.begin(), plan.end(), [](const Planned& p) { return p.hardlink; });
  if (links) manifest["format_version"] = kLinksFormatVersion;
  manifest["files"] = std::move(files);
  if (!files_b64.empty()) manifest["files_b64"] = std::move(files_b64);
  manifest["raw_bytes"] = raw;
  std::string text = json::serialize(manifest) + "\n";
  std::string signature;
  if (key) {
    auto sig = key->sign(text);
    if (!sig) return sig.error();
    signature = json::serialize(json::object{{"alg", "ed25519"},
                                             {"key", key->public_key().fingerprint()},
                                             {"public_key", base::base64_encode(key->public_key().raw)},
                                             {"signature", base::base64_encode(*sig)}}) +
                "\n";
  }

  os::UniqueFd out;  // before the sink: its writer thread ends before the file is closed
  Sink sink;
  sink.chunks = to.chunks;
  if (!dst.empty()) {
    out = os::UniqueFd(::open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) return base::fail("create " + dst + ": " + std::strerror(errno));
  }
  // Without a file nothing is compressed here: the chunk store compresses its chunks, and the id
  // is the manifest's hash, whatever bytes an export's compression makes.
  if (!dst.empty())
    if (auto r = start_compressor(sink, out.get(), level); !r) return r.error();
  std::unique_ptr<struct archive, ArchiveDeleter> a(la().archive_write_new());
  la().archive_write_set_format_pax_restricted(a.get());
  la().archive_write_set_bytes_per_block(a.get(), 1 << 20);
  la().archive_write_set_bytes_in_last_block(a.get(), 1);
  if (la().archive_write_open2(a.get(), &sink, nullptr, sink_write, sink_close, nullptr) != ARCHIVE_OK)
    return base::fail(std::string("start the archive: ") + la().archive_error_string(a.get()));
  auto fail = [&](const std::string& what) {
    auto e = base::fail(what + ": " +
                        (sink.error                  ? std::strerror(sink.error)
                         : !sink.zerror.empty()      ? "zstd: " + sink.zerror
                         : !sink.chunk_error.empty() ? sink.chunk_error
                                                     : std::string(la().archive_error_string(a.get()))));
    if (!dst.empty()) ::unlink(dst.c_str());
    return e;
  };
  if (!write_blob(a.get(), "manifest.json", text)) return fail("write manifest.json");
  if (key && !write_blob(a.get(), "signature.json", signature)) return fail("write signature.json");
  std::vector<char> buf(1 << 20);
  for (auto& p : plan) {
    if (auto why = write_payload_entry(a.get(), src_dir, p, buf); !why.empty()) {
      if (why != "archive") {
        if (!dst.empty()) ::unlink(dst.c_str());
        return base::fail(why);
      }
      return fail("write " + p.rel.string());
    }
  }
  if (la().archive_write_close(a.get()) != ARCHIVE_OK) return fail("finish the archive");
  if (sink.writer && (sink.error = sink.writer->finish()) != 0) return fail("write the archive");
  if (out && ::fsync(out.get()) != 0) return base::fail("fsync " + dst + ": " + std::strerror(errno));
  ArchiveInfo info;
  Sha256 id;
  id.update(text.data(), text.size());
  info.manifest_sha256 = id.hex();
  if (sink.writer) {
    info.sha256 = sink.writer->sha().hex();
    info.compressed_bytes = sink.writer->bytes();
  }
  info.raw_bytes = raw + text.size() + signature.size();
  info.format_version = links ? kLinksFormatVersion : kFormatVersion;
  if (to.chunks) {
    auto list = to.chunks->finish();
    if (!list) return fail("store the chunks: " + list.error().message);
    info.chunks = std::move(*list);
    info.chunks->manifest_sha256 = info.manifest_sha256;
  }
  return info;
}

namespace {

constexpr size_t kMaxManifest = 64u << 20;
constexpr size_t kMaxSignature = 64u << 10;
// What tar adds to each entry beyond its data (a header, a pax header for long names or large
// numbers, padding), generously; and to the whole stream (end blocks, the last block's padding).
constexpr uint64_t kEntryOverhead = 16u << 10;
constexpr uint64_t kStreamOverhead = 2u << 20;

// A manifest line, checked before extraction.
struct Listed {
  std::string type;  // dir, file, symlink
  uint64_t size = 0;
  std::string sha, target;
  std::optional<uid_t> uid;  // owner and mode as the manifest lists them (none: root, the tar's mode)
  std::optional<gid_t> gid;
  std::optional<mode_t> mode;
  bool seen = false;
};

// A path as an archive may hold it: relative, under criu/ or fs/ (or one of those), with no
// empty, "." or ".." component.
bool payload_path(std::string_view p) {
  if (p.empty() || p.size() > 4096 || p.front() == '/') return false;
  size_t start = 0;
  bool first = true;
  for (;;) {
    size_t slash = p.find('/', start);
    auto part = p.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start);
    if (part.empty() || part == "." || part == ".." || part.find('\0') != std::string_view::npos) return false;
    if (first && part != "criu" && part != "fs") return false;
    first = false;
    if (slash == std::string_view::npos) return true;
    start = slash + 1;
  }
}

// Writes the `n` bytes at `p` at offset `at` of the new file `fd`, but each block of zeros (4 KiB,
// aligned in the file): that is left a hole, which reads as zeros. A sparse file (a pax sparse
// entry's holes come out of libarchive as zeros) or a run of zeros takes no room, as in the copy
// the snapshot was taken of. Returns 0 or the errno of a failed write.
int write_holes(int fd, const char* p, size_t n, off_t at) {
  static const char zeros[4096] = {};
  auto block = [&](size_t i) { return std::min(n - i, sizeof zeros - static_cast<size_t>((at + i) % sizeof zeros)); };
  for (size_t i = 0; i < n;) {
    if (size_t len = block(i); std::memcmp(p + i, zeros, len) == 0) {
      i += len;
      continue;
    }
    size_t j = i;  // the run of blocks that are not zeros, written at once
    while (j < n && std::memcmp(p + j, zeros, block(j)) != 0) j += block(j);
    while (i < j) {
      ssize_t w = ::pwrite(fd, p + i, j - i, at + static_cast<off_t>(i));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return errno;
      i += static_cast<size_t>(w);
    }
  }
  return 0;
}

// Opens the directory `rel` ("" for the root itself) beneath `root`, following no symlink and
// leaving neither the tree nor its filesystem.
os::UniqueFd open_beneath(int root, const std::string& rel) {
  auto fd =
      os::open_beneath(root, rel.empty() ? "." : rel, O_PATH | O_DIRECTORY, 0, os::kResolveNoLinks | RESOLVE_NO_XDEV);
  if (!fd) {
    errno = fd.error().value();  // the caller names it
    return {};
  }
  return std::move(*fd);
}

// Reads one archive into a directory, checking as it goes (extract_archive's contract); or checks
// it without writing anything (verify_archive), or reads its manifest alone (read_manifest).
class Extractor {
 public:
  enum class Mode { extract, verify, head };
  Extractor(const ImportPolicy& policy, std::string& err, Mode mode = Mode::extract)
      : policy_(policy), err_(err), mode_(mode) {}

  /// From the archive file `src`, or (`chunks` not null) from the chunk store; into `dst_dir` when
  /// extracting.
  std::optional<Extracted> run(const std::string& src, ChunkReader* chunks, const std::string& dst_dir,
                               bool* untrusted) {
    if (mode_ == Mode::extract) {
      if (::mkdir(dst_dir.c_str(), 0700) != 0) return fail("create " + dst_dir + ": " + std::strerror(errno));
      made_ = dst_dir;
      root_ = os::UniqueFd(::open(dst_dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (!root_) return fail("open " + dst_dir + ": " + std::strerror(errno));
    }
    if (chunks) {
      source_.chunks = chunks;
    } else {
      in_ = os::UniqueFd(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
      if (!in_) return fail("open " + src + ": " + std::strerror(errno));
      source_.fd = in_.get();
    }
    source_.limit = kMaxManifest + kMaxSignature + 4 * kEntryOverhead + kStreamOverhead;
    la().archive_read_support_format_tar(a_.get());
    if (la().archive_read_open(a_.get(), &source_, nullptr, source_read, nullptr) != ARCHIVE_OK)
      return fail("the archive is corrupted or truncated: " + why());
    struct archive_entry* e = nullptr;
    if (!next(e)) return std::nullopt;
    if (!e || std::string_view(la().archive_entry_pathname(e)) != "manifest.json" ||
        la().archive_entry_filetype(e) != AE_IFREG)
      return fail(
          "the archive does not begin with manifest.json: it is of format 1 (from before signed "
          "archives; make it again with this version) or not a sandboxer archive");
    if (!read_blob(manifest_text_, kMaxManifest, "manifest.json") || !check_manifest()) return std::nullopt;
    if (mode_ == Mode::head) return std::move(out_);
    if (!next(e)) return std::nullopt;
    std::string signature;
    bool signed_ = e && std::string_view(la().archive_entry_pathname(e)) == "signature.json";
    if (signed_ && la().archive_entry_filetype(e) != AE_IFREG)
      return fail("the archive's signature.json is not a regular file");
    if (signed_ && !read_blob(signature, kMaxSignature, "signature.json")) return std::nullopt;
    check_signature(signed_, signature);
    if (!out_.trusted) {
      if (untrusted) *untrusted = true;
      if (!policy_.allow_unsigned)
        return fail("the archive is refused: " + out_.why_untrusted +
                    " (a box trusts its own signing key and those given with --trust-key; a box started "
                    "with --allow-unsigned restores such an archive cold, its files only)");
    }
    if (mode_ == Mode::extract && !inodes_left()) return std::nullopt;
    // From here on, payload: the stream may expand to what the manifest says, and no further.
    source_.limit = source_.produced + total_ + kEntryOverhead * listed_.size() + kStreamOverhead;
    if (signed_ && !next(e)) return std::nullopt;
    while (e)
      if (!entry(e) || !next(e)) return std::nullopt;
    if (!source_.drain()) return fail("the archive is corrupted or truncated: " + source_.error);
    if (!finish()) return std::nullopt;
    made_.clear();
    return std::move(out_);
  }

  ~Extractor() {
    if (!made_.empty()) os::remove_tree(made_);
  }

  /// The failure's code where it is not the archive's fault (no_space), else empty.
  const std::string& code() const { return code_; }

 private:
  std::nullopt_t fail(std::string what) {
    err_ = std::move(what);
    return std::nullopt;
  }
  // Whether the destination's filesystem has an inode for each entry the manifest lists (but hard
  // links) and policy.keep_inodes besides; none counted where it has no fixed number (btrfs).
  bool inodes_left() {
    if (!policy_.keep_inodes) return true;
    uint64_t n = 0;
    for (auto& [path, l] : listed_) n += l.type != "hardlink";
    auto room = os::free_room(root_.get());
    if (!room || !room->inodes || *room->inodes >= n + policy_.keep_inodes) return true;
    code_ = "no_space";
    return refuse("the archive lists " + std::to_string(n) + " files, directories and symlinks, and the filesystem " +
                  "it is extracted to has " + std::to_string(*room->inodes) + " free inodes, of which " +
                  std::to_string(policy_.keep_inodes) + " are kept free (for the box's journal)");
  }
  bool refuse(std::string what) {
    err_ = std::move(what);
    return false;
  }
  // What went wrong reading: the decompressor's word first (libarchive has none for it).
  std::string why() {
    if (!source_.error.empty()) return source_.error;
    const char* e = la().archive_error_string(a_.get());
    return e ? e : "unreadable";
  }
  // The next header; `e` is null at the end of the tar stream.
  bool next(struct archive_entry*& e) {
    int r = la().archive_read_next_header(a_.get(), &e);
    if (r == ARCHIVE_EOF) {
      e = nullptr;
      return true;
    }
    if (r != ARCHIVE_OK && r != ARCHIVE_WARN) return refuse("the archive is corrupted or truncated: " + why());
    return true;
  }
  bool read_blob(std::string& out, size_t cap, const char* name) {
    for (;;) {
      la_ssize_t n = la().archive_read_data(a_.get(), buf_.data(), buf_.size());
      if (n < 0) return refuse("the archive is corrupted or truncated: " + why());
      if (n == 0) return true;
      out.append(buf_.data(), static_cast<size_t>(n));
      if (out.size() > cap) return refuse(std::string("the archive's ") + name + " is too large");
    }
  }
  bool check_manifest();
  bool check_listed(const std::string& path, const json::value& v);
  void check_signature(bool present, const std::string& text);
  bool entry(struct archive_entry* e);
  bool write_file(struct archive_entry* e, int parent, const std::string& name, const std::string& path, Listed& l);
  bool link(const std::string& path, const std::string& target, const Listed& l);
  bool keep_owner(int fd, const std::string& path, const Listed& l, mode_t mode);
  bool finish();
  bool parent_seen(const std::string& path, const std::string& dir);

  const ImportPolicy& policy_;
  std::string& err_;
  std::string code_;
  Mode mode_;
  std::unique_ptr<struct archive, ReadDeleter> a_{la().archive_read_new()};
  Source source_;
  os::UniqueFd in_, root_;
  std::string made_;  // removed on failure
  std::string manifest_text_;
  std::map<std::string, Listed> listed_;
  uint64_t total_ = 0;
  std::vector<std::pair<std::string, std::string>> symlinks_;  // made last: path, target
  Extracted out_;
  std::vector<char> buf_ = std::vector<char>(1 << 20);
  std::unique_ptr<ParallelSha256> sha_;  // made at the first file: a thread
};

bool Extractor::check_listed(const std::string& path, const json::value& v) {
  if (!payload_path(path)) return refuse("the archive's manifest lists an unsafe path: " + path);
  auto bad = [&](const std::string& what) { return refuse("the manifest's entry for " + path + " " + what); };
  if (!v.is_object()) return bad("is not an object");
  auto& o = v.as_object();
  Listed l;
  auto* type = o.if_contains("type");
  if (!type || !type->is_string()) return bad("has no type");
  l.type = std::string(type->as_string());
  if (l.type == "file") {
    auto* size = o.if_contains("size");
    auto* sha = o.if_contains("sha256");
    if (!size || !size->is_int64() || size->as_int64() < 0) return bad("has no size");
    if (!sha || !sha->is_string() || !is_sha256_hex(sha->as_string())) return bad("has no sha256");
    l.size = static_cast<uint64_t>(size->as_int64());
    l.sha = std::string(sha->as_string());
    if (l.size > policy_.max_bytes || total_ + l.size > policy_.max_bytes)
      return refuse("the archive would expand beyond " + std::to_string(policy_.max_bytes) +
                    " bytes, this box's limit (--max-archive-bytes): its manifest lists more than that");
    total_ += l.size;
  } else if (l.type == "symlink" || l.type == "hardlink") {
    auto* target = o.if_contains("target");
    auto* b64 = o.if_contains("target_b64");
    if (target && b64) return bad("has both target and target_b64");
    std::string text;
    if (b64 && (!b64->is_string() || !base::base64_decode(b64->as_string(), text))) return bad("has a bad target_b64");
    if (target && target->is_string()) text = target->as_string();
    if (text.empty() || text.size() > 4095 || text.find('\0') != std::string::npos) return bad("has no target");
    if (path.starts_with("criu")) return bad("is a " + l.type + " among the criu images");
    // A hard link names a file of the layer, listed as one (checked when its entry comes).
    if (l.type == "hardlink" && out_.format_version < kLinksFormatVersion)
      return bad("is a hard link, which a format-" + std::to_string(out_.format_version) + " archive does not hold");
    if (l.type == "hardlink" && (!payload_path(text) || !text.starts_with("fs/")))
      return bad("links to " + text + ", not a file of the layer");
    l.target = std::move(text);
  } else if (l.type != "dir") {
    return bad("has type " + l.type + " (dir, file, symlink or hardlink)");
  }
  // Absent: root, and the tar's mode. Present: a number within its range.
  auto id = [&](const char* k, uint64_t max, auto& out) {
    auto* f = o.if_contains(k);
    if (!f) return true;
    if (!f->is_int64() || f->as_int64() < 0 || static_cast<uint64_t>(f->as_int64()) > max) return false;
    out = static_cast<std::remove_reference_t<decltype(*out)>>(f->as_int64());
    return true;
  };
  if (!id("uid", 0xfffffffeu, l.uid)) return bad("has a bad uid");
  if (!id("gid", 0xfffffffeu, l.gid)) return bad("has a bad gid");
  if (!id("mode", 07777, l.mode)) return bad("has a bad mode");
  listed_[path] = std::move(l);
  return true;
}

bool Extractor::check_manifest() {
  boost::system::error_code ec;
  auto v = json::parse(manifest_text_, ec);
  if (ec || !v.is_object()) return refuse("the archive is corrupted: its manifest.json is not a JSON object");
  auto& m = v.as_object();
  auto* fmt = m.if_contains("format");
  auto* ver = m.if_contains("format_version");
  if (!fmt || *fmt != kFormatName) return refuse("not a sandboxer checkpoint archive (manifest format)");
  if (!ver || !ver->is_int64() || ver->as_int64() < kOldestFormatVersion || ver->as_int64() > kLinksFormatVersion)
    return refuse(
        "the archive's format_version is not " + std::to_string(kOldestFormatVersion) + ".." +
        std::to_string(kLinksFormatVersion) +
        (ver && ver->is_int64() && ver->as_int64() < kOldestFormatVersion
             ? " (format " + std::to_string(ver->as_int64()) + " is from before signed archives: make it again)"
             : std::string()));
  out_.format_version = static_cast<int>(ver->as_int64());
  Sha256 sha;
  sha.update(manifest_text_.data(), manifest_text_.size());
  out_.manifest_sha256 = sha.hex();
  auto* files = m.if_contains("files");
  if (!files || !files->is_object()) return refuse("the archive's manifest lists no files");
  for (auto& [k, f] : files->as_object())
    if (!check_listed(std::string(k), f)) return false;
  if (auto* more = m.if_contains("files_b64")) {
    if (!more->is_object()) return refuse("the archive's manifest has a files_b64 that is not an object");
    for (auto& [k, f] : more->as_object()) {
      std::string path;
      if (!base::base64_decode(k, path))
        return refuse("the archive's manifest lists a path in files_b64 that is not base64");
      if (base::utf8_valid_prefix(path) == path.size() || listed_.contains(path))
        return refuse("the archive's manifest lists " + path +
                      " in files_b64, whose names are not UTF-8 and not in files");
      if (!check_listed(path, f)) return false;
    }
  }
  out_.manifest = std::move(m);
  return true;
}

void Extractor::check_signature(bool present, const std::string& text) {
  out_.trusted = false;
  if (!present) {
    out_.why_untrusted = "it is not signed";
    return;
  }
  boost::system::error_code ec;
  auto v = json::parse(text, ec);
  auto field = [&](const char* k) -> std::optional<std::string> {
    if (ec || !v.is_object()) return std::nullopt;
    auto* f = v.as_object().if_contains(k);
    if (!f || !f->is_string()) return std::nullopt;
    return std::string(f->as_string());
  };
  auto alg = field("alg");
  auto decoded = [&](const char* k) -> std::optional<std::string> {
    std::string out;
    auto f = field(k);
    if (!f || !base::base64_decode(*f, out)) return std::nullopt;
    return out;
  };
  auto pub = decoded("public_key");
  auto sig = decoded("signature");
  if (alg != "ed25519" || !pub || pub->size() != 32 || !sig) {
    out_.why_untrusted = "its signature.json is malformed (alg ed25519, public_key, signature, base64)";
    return;
  }
  PublicKey key{*pub};
  auto it = std::find_if(policy_.trusted.begin(), policy_.trusted.end(),
                         [&](const PublicKey& k) { return k.raw == key.raw; });
  if (it == policy_.trusted.end()) {
    out_.why_untrusted = "it is signed by an unknown key " + key.fingerprint();
    return;
  }
  if (!key.verify(manifest_text_, *sig)) {
    out_.why_untrusted = "its signature by key " + key.fingerprint() + " does not verify: the manifest was altered";
    return;
  }
  out_.trusted = true;
  out_.signer = key.fingerprint();
}

bool Extractor::entry(struct archive_entry* e) {
  std::string path = la().archive_entry_pathname(e) ? la().archive_entry_pathname(e) : "";
  if (la().archive_entry_filetype(e) == AE_IFDIR && path.size() > 1 && path.back() == '/') path.pop_back();
  if (!payload_path(path)) return refuse("the archive holds an unsafe path: " + path);
  auto it = listed_.find(path);
  const char* hardlink = la().archive_entry_hardlink(e);
  if (hardlink && (it == listed_.end() || it->second.type != "hardlink"))
    return refuse("the archive holds a hard link (" + path + "), which its manifest does not list as one");
  if (it == listed_.end()) return refuse("the archive holds " + path + ", which its manifest does not list");
  Listed& l = it->second;
  if (l.seen) return refuse("the archive holds " + path + " twice");
  l.seen = true;
  if (hardlink) return link(path, hardlink, l);
  auto type = la().archive_entry_filetype(e);
  const char* want = type == AE_IFDIR ? "dir" : type == AE_IFREG ? "file" : type == AE_IFLNK ? "symlink" : nullptr;
  if (!want) return refuse("the archive holds an entry of an unsupported type: " + path);
  if (l.type != want) return refuse("the archive holds " + path + " as a " + want + ", its manifest as a " + l.type);
  auto slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "" : path.substr(0, slash);
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (type == AE_IFLNK) {
    const char* target = la().archive_entry_symlink(e);
    if (!target || l.target != target)
      return refuse("the archive's symlink " + path + " does not point where its manifest says");
    symlinks_.emplace_back(path, l.target);
    return true;
  }
  if (mode_ != Mode::extract) {
    if (!parent_seen(path, dir)) return false;
    return type == AE_IFDIR || write_file(e, -1, name, path, l);
  }
  os::UniqueFd parent = open_beneath(root_.get(), dir);
  if (!parent)
    return refuse("extract " + path + ": its directory " + dir + " " +
                  (errno == ENOENT ? std::string("comes later or not at all") : std::strerror(errno)));
  if (type == AE_IFDIR) {
    if (::mkdirat(parent.get(), name.c_str(), 0700) != 0) return refuse("create " + path + ": " + std::strerror(errno));
    os::UniqueFd d(::openat(parent.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!d) return refuse("create " + path + ": " + std::strerror(errno));
    return keep_owner(d.get(), path, l, l.mode ? *l.mode : (la().archive_entry_perm(e) | 0700));
  }
  return write_file(e, parent.get(), name, path, l);
}

// A hard link entry (format 4): to the file its manifest says, which came before it. Both are
// reached beneath the root, no symlink followed (there is none yet: symlinks are made last), and
// the link is a new name only.
bool Extractor::link(const std::string& path, const std::string& target, const Listed& l) {
  if (target != l.target) return refuse("the archive's hard link " + path + " does not name what its manifest says");
  auto t = listed_.find(target);
  if (t == listed_.end() || t->second.type != "file" || !t->second.seen)
    return refuse("the archive's hard link " + path + " names " + target + ", which is not a file it holds before it");
  auto dir_of = [](const std::string& p) { return p.rfind('/') == std::string::npos ? "" : p.substr(0, p.rfind('/')); };
  auto name_of = [](const std::string& p) { return p.substr(p.rfind('/') + 1); };
  if (mode_ != Mode::extract) return parent_seen(path, dir_of(path));
  os::UniqueFd parent = open_beneath(root_.get(), dir_of(path));
  if (!parent)
    return refuse("extract " + path + ": its directory " + dir_of(path) + " " +
                  (errno == ENOENT ? std::string("comes later or not at all") : std::strerror(errno)));
  os::UniqueFd from = open_beneath(root_.get(), dir_of(target));
  if (!from || ::linkat(from.get(), name_of(target).c_str(), parent.get(), name_of(path).c_str(), 0) != 0)
    return refuse("link " + path + " to " + target + ": " + std::strerror(errno));
  return true;
}

// Without a directory to write into (verify_archive): an entry's directory must have come before it,
// as extraction's open_beneath would find it.
bool Extractor::parent_seen(const std::string& path, const std::string& dir) {
  if (dir.empty()) return true;
  auto it = listed_.find(dir);
  if (it == listed_.end() || it->second.type != "dir" || !it->second.seen)
    return refuse("extract " + path + ": its directory " + dir + " comes later or not at all");
  return true;
}

// With `parent` < 0, the data is checked and not written (verify_archive).
bool Extractor::write_file(struct archive_entry* e, int parent, const std::string& name, const std::string& path,
                           Listed& l) {
  if (!la().archive_entry_size_is_set(e) || la().archive_entry_size(e) < 0 ||
      static_cast<uint64_t>(la().archive_entry_size(e)) != l.size)
    return refuse("the archive's " + path + " is " + std::to_string(la().archive_entry_size(e)) +
                  " bytes, its manifest says " + std::to_string(l.size));
  os::UniqueFd out;
  if (parent >= 0) {
    out = os::UniqueFd(::openat(parent, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) return refuse("create " + path + ": " + std::strerror(errno));
  }
  // The bytes are hashed on a thread of their own while this one reads, decompresses and writes
  // the next (~0.55 s per GiB of SHA-256 off the extraction's own thread).
  if (!sha_) sha_ = std::make_unique<ParallelSha256>(buf_.size());
  uint64_t size = 0;
  for (;;) {
    std::vector<char>& b = sha_->take();
    la_ssize_t n = la().archive_read_data(a_.get(), b.data(), b.size());
    if (n < 0) return refuse("the archive is corrupted or truncated: " + why());
    if (n == 0) {
      sha_->push(b, 0);
      break;
    }
    if (size + static_cast<uint64_t>(n) > l.size)
      return refuse("size mismatch for " + path + ": the archive is corrupted");
    sha_->push(b, static_cast<size_t>(n));  // read, not changed, while it is written below
    if (out)
      if (int err = write_holes(out.get(), b.data(), static_cast<size_t>(n), static_cast<off_t>(size)))
        return refuse("write " + path + ": " + std::strerror(err));
    size += static_cast<uint64_t>(n);
  }
  if (size != l.size) return refuse("size mismatch for " + path + ": the archive is corrupted");
  if (sha_->digest() != l.sha) return refuse("sha256 mismatch for " + path + ": the archive is corrupted");
  if (!out) return true;
  if (::ftruncate(out.get(), static_cast<off_t>(size)) != 0)
    return refuse("size " + path + ": " + std::strerror(errno));
  return keep_owner(out.get(), path, l, l.mode ? *l.mode : la().archive_entry_perm(e));
}

bool Extractor::keep_owner(int fd, const std::string& path, const Listed& l, mode_t mode) {
  // chown first (it clears set-id bits), and no set-id bits at all: an archive brings files, not
  // privileges.
  if ((l.uid || l.gid) && ::fchown(fd, l.uid ? *l.uid : 0, l.gid ? *l.gid : 0) != 0)
    return refuse("chown " + path + ": " + std::strerror(errno));
  if (::fchmod(fd, mode & 01777) != 0) return refuse("chmod " + path + ": " + std::strerror(errno));
  return true;
}

bool Extractor::finish() {
  for (auto& [path, l] : listed_)
    if (!l.seen) return refuse("the archive is missing " + path + " (listed in its manifest)");
  if (mode_ != Mode::extract) {
    for (auto& [path, target] : symlinks_) {
      auto slash = path.rfind('/');
      if (!parent_seen(path, slash == std::string::npos ? "" : path.substr(0, slash))) return false;
    }
    return true;
  }
  // Symlinks last: nothing is extracted through one.
  for (auto& [path, target] : symlinks_) {
    auto slash = path.rfind('/');
    std::string dir = slash == std::string::npos ? "" : path.substr(0, slash);
    os::UniqueFd parent = open_beneath(root_.get(), dir);
    std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
    if (!parent || ::symlinkat(target.c_str(), parent.get(), name.c_str()) != 0)
      return refuse("create " + path + ": " + std::strerror(errno));
    const Listed& l = listed_.at(path);
    if ((l.uid || l.gid) &&
        ::fchownat(parent.get(), name.c_str(), l.uid ? *l.uid : 0, l.gid ? *l.gid : 0, AT_SYMLINK_NOFOLLOW) != 0)
      return refuse("chown " + path + ": " + std::strerror(errno));
  }
  return true;
}

}  // namespace

namespace {
// One Extractor run, its failure coded "untrusted" when no trusted key signed the archive, or as
// the Extractor says (no_space).
base::Result<Extracted> run_extractor(Extractor::Mode mode, const std::string& src, ChunkReader* chunks,
                                      const std::string& dst_dir, const ImportPolicy& policy) {
  if (auto lib = libraries(); !lib) return lib.error();
  std::string err;
  bool untrusted = false;
  Extractor x(policy, err, mode);
  auto r = x.run(src, chunks, dst_dir, &untrusted);
  if (!r) return base::fail(err, !x.code().empty() ? x.code() : untrusted ? "untrusted" : "bad_snapshot");
  return std::move(*r);
}
}  // namespace

base::Result<Extracted> extract_archive(const std::string& src, const std::string& dst_dir,
                                        const ImportPolicy& policy) {
  return run_extractor(Extractor::Mode::extract, src, nullptr, dst_dir, policy);
}

base::Result<Extracted> extract_chunks(const std::string& store_dir, ChunkList list, const std::string& dst_dir,
                                       const ImportPolicy& policy) {
  if (auto lib = libraries(); !lib) return lib.error();
  auto reader = ChunkReader::open(store_dir, std::move(list));
  if (!reader) return base::fail(reader.error().message, "bad_snapshot");
  return run_extractor(Extractor::Mode::extract, "", reader->get(), dst_dir, policy);
}

base::Result<Extracted> read_manifest(const std::string& src) {
  return run_extractor(Extractor::Mode::head, src, nullptr, "", ImportPolicy{});
}

base::Result<Extracted> verify_archive(const std::string& src, const ImportPolicy& policy) {
  return run_extractor(Extractor::Mode::verify, src, nullptr, "", policy);
}

base::Result<std::string> archive_id(const std::string& src) {
  ImportPolicy any;
  any.allow_unsigned = true;
  auto x = verify_archive(src, any);
  if (!x) return x.error();
  if (named_by_manifest(x->format_version)) return snapshot_id_of(x->manifest_sha256);
  auto sha = sha256_file(src);
  if (!sha) return sha.error();
  return snapshot_id_of(*sha);
}

base::Result<ArchiveInfo> rebuild_archive(const std::string& store_dir, ChunkList list, const std::string& dst,
                                          int level) {
  std::string expect_sha256 = list.archive_sha256;
  auto reader = ChunkReader::open(store_dir, std::move(list));
  if (!reader) return reader.error();
  os::UniqueFd out;  // before the sink: its writer thread ends before the file is closed
  Sink sink;
  if (!dst.empty()) {  // else the archive is only hashed (its id)
    out = os::UniqueFd(::open(dst.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) return base::sys_fail("create " + dst, errno);
  }
  if (auto r = start_compressor(sink, out ? out.get() : -1, level); !r) return r.error();
  auto fail = [&](base::Error e) {
    if (!dst.empty()) ::unlink(dst.c_str());
    return e;
  };
  for (;;) {
    auto v = (*reader)->next();
    if (!v) return fail(v.error());
    if (v->empty()) break;
    if (!sink.feed(v->data(), v->size(), ZSTD_e_continue))
      return fail(
          base::fail("write " + dst + ": " + (sink.error ? std::strerror(sink.error) : "zstd: " + sink.zerror)));
  }
  if (!sink.feed(nullptr, 0, ZSTD_e_end))
    return fail(base::fail("write " + dst + ": " + (sink.error ? std::strerror(sink.error) : "zstd: " + sink.zerror)));
  if (int e = sink.writer->finish(); e != 0) return fail(base::sys_fail("write " + dst, e));
  if (out && ::fsync(out.get()) != 0) return fail(base::sys_fail("fsync " + dst, errno));
  std::string sha = sink.writer->sha().hex();
  if (!expect_sha256.empty() && sha != expect_sha256)
    return fail(base::fail("the archive written anew from the chunk store hashes to " + sha + ", not " + expect_sha256 +
                           ": this libzstd compresses differently from the one that took the snapshot"));
  ArchiveInfo info;
  info.sha256 = sha;
  info.compressed_bytes = sink.writer->bytes();
  return info;
}

base::Result<ChunkList> chunk_archive(const std::string& src, const std::string& store_dir) {
  auto head = read_manifest(src);
  if (!head) return head.error();
  // A format-2 archive is named by its file's hash, which an export from the chunks must match.
  auto sha = named_by_manifest(head->format_version) ? base::Result<std::string>(std::string()) : sha256_file(src);
  if (!sha) return sha.error();
  os::UniqueFd in(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return base::sys_fail("open " + src, errno);
  auto w = ChunkWriter::open(store_dir, 3, !named_by_manifest(head->format_version));
  if (!w) return w.error();
  Source source;
  source.fd = in.get();
  for (;;) {
    ssize_t n = source.next();
    if (n < 0) return base::fail("read " + src + ": " + source.error, "bad_snapshot");
    if (n == 0) break;
    if (auto r = (*w)->write(source.data, static_cast<size_t>(n)); !r) return r.error();
  }
  auto list = (*w)->finish();
  if (!list) return list.error();
  list->archive_sha256 = *sha;
  if (named_by_manifest(head->format_version)) list->manifest_sha256 = head->manifest_sha256;
  return list;
}

std::optional<std::string> read_image_id(const std::string& path) {
  auto text = os::read_file(path);
  if (!text) return std::nullopt;
  boost::system::error_code ec;
  auto v = boost::json::parse(*text, ec);
  if (ec || !v.is_object()) return std::nullopt;
  auto* id = v.as_object().if_contains("id");
  if (!id || !id->is_string() || id->as_string().empty()) return std::nullopt;
  return std::string(id->as_string());
}

base::Result<void> incompatibility(const boost::json::object& manifest, const std::optional<std::string>& criu_here,
                                   const std::optional<std::string>& image_here) {
  auto refuse = [](std::string why) { return base::fail(std::move(why), "incompatible"); };
  auto text = [&](const char* key) -> std::optional<std::string> {
    auto* v = manifest.if_contains(key);
    if (!v || !v->is_string()) return std::nullopt;
    return std::string(v->as_string());
  };
  auto image = text("image");
  if (image && image_here && *image != *image_here)
    return refuse("the snapshot was made in image " + *image + ", this box runs image " + *image_here +
                  ": a live copy needs the same files and libraries under it");
  if (text("mode").value_or("fs") == "live") {
    auto criu = text("criu").value_or("(unknown)");
    if (!criu_here) return refuse("the snapshot is live (criu " + criu + ") and this box has no criu");
    if (criu != *criu_here)
      return refuse("the snapshot was made with criu " + criu + ", this box has criu " + *criu_here);
  }
  return {};
}

base::Result<void> library_loadable() { return libraries(); }

bool valid_snapshot_id(std::string_view id) {
  if (id.size() != 18 || !id.starts_with("s-")) return false;
  for (char c : id.substr(2))
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

}  // namespace sbx::archive
