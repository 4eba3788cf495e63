#include "archive/chunks.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <unordered_map>

#include "archive/hash.hpp"
#include "archive/signing.hpp"
#include "os/openssl.hpp"
#include "os/sys.hpp"

namespace sbx::archive {

namespace json = boost::json;

namespace {

// The gear table: 256 fixed pseudo-random words (splitmix64 from a fixed seed). Fixed forever:
// another table would cut the same content elsewhere, and stores would stop sharing chunks.
constexpr std::array<uint64_t, 256> make_gear() {
  std::array<uint64_t, 256> g{};
  uint64_t x = 0x5a4d6f6e6b657921ull;
  for (auto& v : g) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    v = z ^ (z >> 31);
  }
  return g;
}
constexpr auto kGear = make_gear();
// The gear hash's high bits depend on the last 64 bytes: a boundary is where they are all zero,
// harder to meet before the average size and easier after it (normalized chunking).
constexpr uint64_t kMaskS = ~0ull << (64 - 18);
constexpr uint64_t kMaskL = ~0ull << (64 - 14);

Sha256* sha(void* p) { return static_cast<Sha256*>(p); }

std::string chunk_path(const std::string& hex) { return hex.substr(0, 2) + "/" + hex; }

base::Result<os::UniqueFd> open_store(const std::string& dir, bool create) {
  if (create)
    if (auto r = os::make_dirs(dir, 0700); !r) return base::sys_fail("create the chunk store " + dir, r.error());
  os::UniqueFd fd(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return base::sys_fail("open the chunk store " + dir, errno);
  return fd;
}

// Keeps the compressed file `z` of chunk `hex` in the store `dir`: written to a temporary and
// renamed into place without replacing. False when the store had it already (that copy stays).
base::Result<bool> keep_chunk(int dir, const std::string& hex, std::string_view z) {
  std::string sub = hex.substr(0, 2);
  if (::mkdirat(dir, sub.c_str(), 0700) != 0 && errno != EEXIST)
    return base::sys_fail("create the chunk directory " + sub, errno);
  std::string tmp = sub + "/.tmp-" + os::random_hex(6);
  os::UniqueFd fd(::openat(dir, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd) return base::sys_fail("store chunk " + hex, errno);
  if (auto r = os::write_all(fd.get(), z); !r) {
    ::unlinkat(dir, tmp.c_str(), 0);
    return base::sys_fail("store chunk " + hex, r.error());
  }
  fd.reset();
  if (::renameat2(dir, tmp.c_str(), dir, chunk_path(hex).c_str(), RENAME_NOREPLACE) == 0) return true;
  int err = errno;
  ::unlinkat(dir, tmp.c_str(), 0);
  if (err != EEXIST) return base::sys_fail("store chunk " + hex, err);
  return false;
}

}  // namespace

size_t chunk_boundary(const unsigned char* data, size_t n, bool at_end) {
  if (n <= kChunkMin) return at_end ? n : 0;
  size_t normal = std::min(kChunkAvg, n), limit = std::min(kChunkMax, n);
  uint64_t h = 0;
  size_t i = kChunkMin;
  for (; i < normal; ++i) {
    h = (h << 1) + kGear[data[i]];
    if (!(h & kMaskS)) return i + 1;
  }
  for (; i < limit; ++i) {
    h = (h << 1) + kGear[data[i]];
    if (!(h & kMaskL)) return i + 1;
  }
  if (limit == kChunkMax) return kChunkMax;
  return at_end ? n : 0;
}

// ---- writing ----

base::Result<std::unique_ptr<ChunkWriter>> ChunkWriter::open(const std::string& dir, int level, bool hash_stream) {
  if (const auto& lib = os::libcrypto(); !lib) return lib.error();  // SHA-256
  auto fd = open_store(dir, true);
  if (!fd) return fd.error();
  auto w = std::make_unique<ChunkWriter>();
  w->dir_ = std::move(*fd);
  w->level_ = level;
  auto* c = ZSTD_createCCtx();
  if (!c) return base::fail("start the chunk store: no memory for a zstd context");
  ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 1);
  w->cctx_ = c;
  if (hash_stream) w->sha_ = new Sha256();
  w->zbuf_.resize(ZSTD_compressBound(kChunkMax));
  w->cur_.reserve(2 * kChunkMax);
  return w;
}

ChunkWriter::~ChunkWriter() {
  ZSTD_freeCCtx(static_cast<ZSTD_CCtx*>(cctx_));
  delete sha(sha_);
}

base::Result<void> ChunkWriter::write(const void* p, size_t n) {
  auto* b = static_cast<const unsigned char*>(p);
  if (sha_) sha(sha_)->update(b, n);
  list_.bytes += n;
  cur_.insert(cur_.end(), b, b + n);
  size_t off = 0;
  while (cur_.size() - off >= kChunkMax) {
    size_t cut = chunk_boundary(cur_.data() + off, cur_.size() - off, false);
    if (auto r = store(cur_.data() + off, cut); !r) return r;
    off += cut;
  }
  cur_.erase(cur_.begin(), cur_.begin() + static_cast<ptrdiff_t>(off));
  return {};
}

base::Result<void> ChunkWriter::store(const unsigned char* p, size_t n) {
  Sha256 h;
  h.update(p, n);
  std::string hex = h.hex();
  std::string rel = chunk_path(hex);
  list_.chunks.push_back({hex, static_cast<uint32_t>(n)});
  struct stat st {};
  if (::fstatat(dir_.get(), rel.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
    list_.stored_bytes += static_cast<uint64_t>(st.st_size);  // stored once already
    return {};
  }
  size_t z = ZSTD_compress2(static_cast<ZSTD_CCtx*>(cctx_), zbuf_.data(), zbuf_.size(), p, n);
  if (ZSTD_isError(z)) return base::fail(std::string("compress a chunk: zstd: ") + ZSTD_getErrorName(z));
  // Another writer may have stored the same chunk meanwhile: then its copy stays.
  auto added = keep_chunk(dir_.get(), hex, {zbuf_.data(), z});
  if (!added) return added.error();
  if (*added) {
    list_.added_bytes += z;
    ++list_.new_chunks;
  }
  list_.stored_bytes += z;
  return {};
}

base::Result<ChunkList> ChunkWriter::finish() {
  size_t off = 0;
  while (off < cur_.size()) {
    size_t cut = chunk_boundary(cur_.data() + off, cur_.size() - off, true);
    if (auto r = store(cur_.data() + off, cut); !r) return r.error();
    off += cut;
  }
  cur_.clear();
  if (sha_) list_.sha256 = sha(sha_)->hex();
  // Durable before the list that names them is written.
  os::UniqueFd any(::openat(dir_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!any || ::syncfs(any.get()) != 0) return base::sys_fail("sync the chunk store", errno);
  return std::move(list_);
}

// ---- reading ----

base::Result<std::unique_ptr<ChunkReader>> ChunkReader::open(const std::string& dir, ChunkList list) {
  if (const auto& lib = os::libcrypto(); !lib) return lib.error();  // SHA-256
  auto fd = open_store(dir, false);
  if (!fd) return fd.error();
  auto r = std::make_unique<ChunkReader>();
  r->dir_ = std::move(*fd);
  r->list_ = std::move(list);
  r->dctx_ = ZSTD_createDCtx();
  if (!r->dctx_) return base::fail("read the chunk store: no memory for a zstd context");
  if (!r->list_.sha256.empty()) r->sha_ = new Sha256();
  r->in_.resize(ZSTD_compressBound(kChunkMax));
  r->out_.resize(kChunkMax);
  return r;
}

ChunkReader::~ChunkReader() {
  ZSTD_freeDCtx(static_cast<ZSTD_DCtx*>(dctx_));
  delete sha(sha_);
}

base::Result<std::string_view> ChunkReader::next() {
  auto bad = [](std::string m) { return base::fail(std::move(m), "bad_snapshot"); };
  if (at_ == list_.chunks.size()) {
    if (at_ == SIZE_MAX) return std::string_view();
    at_ = SIZE_MAX;
    if (!sha_) return std::string_view();
    std::string got = sha(sha_)->hex();
    if (got != list_.sha256)
      return bad("the stream read from the chunk store hashes to " + got + ", not " + list_.sha256);
    return std::string_view();
  }
  if (at_ == SIZE_MAX) return std::string_view();
  const ChunkRef& c = list_.chunks[at_++];
  if (c.size == 0 || c.size > kChunkMax) return bad("chunk " + c.sha256 + " has an impossible size");
  os::UniqueFd fd(::openat(dir_.get(), chunk_path(c.sha256).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return bad("chunk " + c.sha256 + " is missing from the store: " + std::strerror(errno));
  size_t got = 0;
  for (;;) {
    if (got == in_.size()) return bad("chunk " + c.sha256 + " is corrupted: its file is too large");
    ssize_t n = ::read(fd.get(), in_.data() + got, in_.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return bad("read chunk " + c.sha256 + ": " + std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  size_t n = ZSTD_decompressDCtx(static_cast<ZSTD_DCtx*>(dctx_), out_.data(), out_.size(), in_.data(), got);
  if (ZSTD_isError(n)) return bad("chunk " + c.sha256 + " is corrupted: zstd: " + ZSTD_getErrorName(n));
  if (n != c.size)
    return bad("chunk " + c.sha256 + " is corrupted: " + std::to_string(n) + " bytes, not " + std::to_string(c.size));
  Sha256 h;
  h.update(out_.data(), n);
  if (std::string hex = h.hex(); hex != c.sha256)
    return bad("chunk " + c.sha256 + " is corrupted: it hashes to " + hex);
  if (sha_) sha(sha_)->update(out_.data(), n);
  return std::string_view(out_.data(), n);
}

// ---- the list ----

json::object to_json(const ChunkList& l) {
  json::array chunks;
  chunks.reserve(l.chunks.size());
  for (auto& c : l.chunks) chunks.push_back(json::array{json::string(c.sha256), c.size});
  json::object o{{"format", "sandboxer.chunks"}, {"version", 1}, {"bytes", l.bytes}, {"stored_bytes", l.stored_bytes}};
  if (!l.sha256.empty()) o["sha256"] = l.sha256;
  if (!l.manifest_sha256.empty()) o["manifest_sha256"] = l.manifest_sha256;
  if (!l.archive_sha256.empty()) o["archive_sha256"] = l.archive_sha256;
  o["chunks"] = std::move(chunks);
  return o;
}

base::Result<ChunkList> chunk_list_from_json(const json::value& v) {
  auto bad = [](std::string m) { return base::fail("the chunk list is damaged: " + std::move(m), "bad_snapshot"); };
  const auto* o = v.if_object();
  if (!o) return bad("not an object");
  auto* f = o->if_contains("format");
  if (!f || !f->is_string() || f->as_string() != "sandboxer.chunks") return bad("no format sandboxer.chunks");
  ChunkList l;
  auto* bytes = o->if_contains("bytes");
  auto* chunks = o->if_contains("chunks");
  boost::system::error_code ec;
  if (!bytes || !chunks || !chunks->is_array()) return bad("bytes or chunks");
  l.bytes = bytes->to_number<uint64_t>(ec);
  if (ec) return bad("bytes");
  for (auto [key, field] : {std::pair{"sha256", &l.sha256},
                            {"manifest_sha256", &l.manifest_sha256},
                            {"archive_sha256", &l.archive_sha256}}) {
    auto* a = o->if_contains(key);
    if (!a) continue;
    if (!a->is_string() || !is_sha256_hex(a->as_string())) return bad(key);
    *field = std::string(a->as_string());
  }
  // A stream's hash may be left out only where the manifest's names the snapshot (format 3).
  if (l.sha256.empty() && l.manifest_sha256.empty()) return bad("sha256");
  if (auto* s = o->if_contains("stored_bytes"); s && s->is_number()) l.stored_bytes = s->to_number<uint64_t>(ec);
  uint64_t total = 0;
  for (auto& c : chunks->as_array()) {
    auto* a = c.if_array();
    boost::system::error_code ec;
    int64_t size = a && a->size() == 2 ? (*a)[1].to_number<int64_t>(ec) : 0;
    if (!a || a->size() != 2 || !(*a)[0].is_string() || !is_sha256_hex((*a)[0].as_string()) || ec)
      return bad("a chunk entry is not [sha256, size]");
    if (size <= 0 || size > static_cast<int64_t>(kChunkMax)) return bad("a chunk's size is out of range");
    l.chunks.push_back({std::string((*a)[0].as_string()), static_cast<uint32_t>(size)});
    total += static_cast<uint64_t>(size);
  }
  if (total != l.bytes)
    return bad("its chunks add up to " + std::to_string(total) + " bytes, not " + std::to_string(l.bytes));
  return l;
}

// ---- deltas ----

namespace {

// A chunk's compressed file, checked: it decompresses to `c.size` bytes hashing to `c.sha256`.
base::Result<void> check_compressed(const ChunkRef& c, std::string_view z, std::vector<char>& out) {
  if (const auto& lib = os::libcrypto(); !lib) return lib.error();  // SHA-256
  auto bad = [&](std::string why) { return base::fail("chunk " + c.sha256 + " is corrupted: " + why, "bad_snapshot"); };
  out.resize(kChunkMax);
  size_t n = ZSTD_decompress(out.data(), out.size(), z.data(), z.size());
  if (ZSTD_isError(n)) return bad(std::string("zstd: ") + ZSTD_getErrorName(n));
  if (n != c.size) return bad(std::to_string(n) + " bytes, not " + std::to_string(c.size));
  Sha256 h;
  h.update(out.data(), n);
  if (auto hex = h.hex(); hex != c.sha256) return bad("it hashes to " + hex);
  return {};
}

base::Result<std::string> read_all(int dir, const std::string& rel, size_t limit) {
  os::UniqueFd fd(::openat(dir, rel.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) return base::sys_fail("open " + rel, errno);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return base::sys_fail("read " + rel, errno);
    if (n == 0) return out;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > limit) return base::fail(rel + " is larger than " + std::to_string(limit) + " bytes");
  }
}

}  // namespace

namespace {
base::Result<uint64_t> write_delta_without(const std::string& dir, const std::string& id, const ChunkList& list,
                                           const std::string& base, std::unordered_set<std::string> have,
                                           const std::string& dst);
}  // namespace

base::Result<uint64_t> write_delta(const std::string& dir, const std::string& id, const ChunkList& list,
                                   const std::string& base, const ChunkList& base_list, const std::string& dst) {
  std::unordered_set<std::string> have;
  for (auto& c : base_list.chunks) have.insert(c.sha256);
  return write_delta_without(dir, id, list, base, std::move(have), dst);
}

base::Result<uint64_t> write_delta_for(const std::string& dir, const std::string& id, const ChunkList& list,
                                       std::string_view lacks, const std::string& dst) {
  if (lacks.size() != (list.chunks.size() + 7) / 8)
    return base::fail("lacks has " + std::to_string(lacks.size()) + " bytes; snapshot " + id + "'s " +
                          std::to_string(list.chunks.size()) + " chunks need " +
                          std::to_string((list.chunks.size() + 7) / 8),
                      "bad_request");
  // A chunk the receiver has under one index and lacks under another (a repeated chunk, a crafted
  // bitmap) is sent: it costs bytes, never a missing chunk.
  std::unordered_set<std::string> have, lacked;
  for (size_t i = 0; i < list.chunks.size(); ++i)
    ((static_cast<unsigned char>(lacks[i / 8]) >> (i % 8)) & 1 ? lacked : have).insert(list.chunks[i].sha256);
  for (auto& h : lacked) have.erase(h);
  return write_delta_without(dir, id, list, "", std::move(have), dst);
}

base::Result<Lacking> lacking(const std::string& dir, std::string_view hashes) {
  if (hashes.size() % kRawHash != 0)
    return base::fail(std::to_string(hashes.size()) + " bytes of hashes are not a whole number of " +
                          std::to_string(kRawHash) + "-byte hashes",
                      "bad_request");
  size_t n = hashes.size() / kRawHash;
  Lacking out;
  out.bits.assign((n + 7) / 8, '\0');
  auto store = open_store(dir, false);
  for (size_t i = 0; i < n; ++i) {
    struct stat st {};
    bool have =
        store &&
        ::fstatat(store->get(),
                  chunk_path(hex_encode(reinterpret_cast<const unsigned char*>(hashes.data() + i * kRawHash), kRawHash))
                      .c_str(),
                  &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode);
    if (have) continue;
    out.bits[i / 8] = static_cast<char>(out.bits[i / 8] | (1 << (i % 8)));
    ++out.count;
  }
  return out;
}

std::string raw_hashes(const ChunkList& list, size_t from, size_t count) {
  auto nibble = [](char c) { return static_cast<unsigned>(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10) & 0xf; };
  std::string out;
  size_t end = std::min(list.chunks.size(), from + count);
  for (size_t i = from; i < end; ++i) {
    const std::string& h = list.chunks[i].sha256;  // 64 hex digits (chunk_list_from_json)
    for (size_t k = 0; k + 1 < h.size(); k += 2) out.push_back(static_cast<char>(nibble(h[k]) << 4 | nibble(h[k + 1])));
  }
  return out;
}

namespace {
base::Result<uint64_t> write_delta_without(const std::string& dir, const std::string& id, const ChunkList& list,
                                           const std::string& base, std::unordered_set<std::string> have,
                                           const std::string& dst) {
  auto store = open_store(dir, false);
  if (!store) return store.error();
  // The header first, with each included chunk's size; then the chunks, read one at a time (a
  // delta may be as large as the whole snapshot: it is never held in memory).
  std::vector<std::pair<std::string, uint64_t>> bodies;
  json::array included;
  for (auto& c : list.chunks) {
    if (have.contains(c.sha256)) continue;
    have.insert(c.sha256);  // once, however often the stream repeats it
    struct stat st {};
    if (::fstatat(store->get(), chunk_path(c.sha256).c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode))
      return base::fail("chunk " + c.sha256 + " is missing from the store", "bad_snapshot");
    included.push_back(json::array{json::string(c.sha256), st.st_size});
    bodies.emplace_back(c.sha256, static_cast<uint64_t>(st.st_size));
  }
  std::string header = json::serialize(json::object{{"format", "sandboxer.delta"},
                                                    {"version", 1},
                                                    {"snapshot", id},
                                                    {"base", base},
                                                    {"list", to_json(list)},
                                                    {"included", std::move(included)}});
  os::UniqueFd out(::open(dst.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!out) return base::sys_fail("create " + dst, errno);
  uint32_t len = static_cast<uint32_t>(header.size());
  unsigned char le[4] = {static_cast<unsigned char>(len), static_cast<unsigned char>(len >> 8),
                         static_cast<unsigned char>(len >> 16), static_cast<unsigned char>(len >> 24)};
  uint64_t total = kDeltaMagic.size() + 4 + header.size();
  auto w = os::write_all(out.get(), kDeltaMagic);
  if (w) w = os::write_all(out.get(), {reinterpret_cast<const char*>(le), 4});
  if (w) w = os::write_all(out.get(), header);
  for (auto& [sha, size] : bodies) {
    if (!w) break;
    auto z = read_all(store->get(), chunk_path(sha), ZSTD_compressBound(kChunkMax));
    if (!z || z->size() != size) {
      ::unlink(dst.c_str());
      return base::fail(
          "chunk " + sha + ": " + (z ? "its size changed while the delta was written" : z.error().message),
          "bad_snapshot");
    }
    w = os::write_all(out.get(), *z);
    total += size;
  }
  if (!w || ::fsync(out.get()) != 0) {
    auto e = w ? base::sys_fail("fsync " + dst, errno) : base::sys_fail("write " + dst, w.error());
    ::unlink(dst.c_str());
    return e;
  }
  return total;
}
}  // namespace

bool is_delta(const std::string& path) {
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  char magic[8] = {};
  return fd && ::read(fd.get(), magic, sizeof magic) == 8 && std::string_view(magic, 8) == kDeltaMagic;
}

base::Result<DeltaHeader> read_delta_header(const std::string& path) {
  auto bad = [](std::string m) { return base::fail("the delta is refused: " + std::move(m), "bad_snapshot"); };
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return base::sys_fail("open " + path, errno);
  unsigned char head[12];
  if (::read(fd.get(), head, sizeof head) != 12 || std::string_view(reinterpret_cast<char*>(head), 8) != kDeltaMagic)
    return bad("it does not begin with SBXDELTA and a header length");
  uint32_t len = head[8] | (head[9] << 8) | (head[10] << 16) | (static_cast<uint32_t>(head[11]) << 24);
  if (len == 0 || len > (64u << 20)) return bad("its header length " + std::to_string(len) + " is out of range");
  std::string text(len, '\0');
  size_t got = 0;
  while (got < len) {
    ssize_t n = ::read(fd.get(), text.data() + got, len - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return bad("it ends inside its header");
    got += static_cast<size_t>(n);
  }
  boost::system::error_code ec;
  auto v = json::parse(text, ec);
  const json::object* o = ec ? nullptr : v.if_object();
  auto str = [&](const char* k) {
    auto* x = o ? o->if_contains(k) : nullptr;
    return x && x->is_string() ? std::string(x->as_string()) : std::string();
  };
  if (!o || str("format") != "sandboxer.delta") return bad("its header is not a sandboxer.delta");
  DeltaHeader h;
  h.snapshot = str("snapshot");
  h.base = str("base");
  auto* list = o->if_contains("list");
  auto* inc = o->if_contains("included");
  if (!list || !inc || !inc->is_array()) return bad("its header has no list or included");
  auto l = chunk_list_from_json(*list);
  if (!l) return bad(l.error().message);
  if (l->id_sha256().empty()) return bad("its list has no manifest_sha256 (nor a format-2 archive_sha256)");
  h.list = std::move(*l);
  std::unordered_set<std::string> listed;
  for (auto& c : h.list.chunks) listed.insert(c.sha256);
  for (auto& e : inc->as_array()) {
    auto* a = e.if_array();
    boost::system::error_code nec;
    uint64_t n = a && a->size() == 2 ? (*a)[1].to_number<uint64_t>(nec) : 0;
    if (!a || a->size() != 2 || !(*a)[0].is_string() || nec || n == 0 || n > ZSTD_compressBound(kChunkMax) ||
        !listed.contains(std::string((*a)[0].as_string())))
      return bad("an included chunk is not [sha256 of a listed chunk, its compressed size]");
    h.included.emplace_back(std::string((*a)[0].as_string()), n);
  }
  h.body_offset = 12 + len;
  return h;
}

base::Result<uint64_t> store_delta_chunks(const std::string& path, const DeltaHeader& h, const std::string& dir) {
  auto store = open_store(dir, true);
  if (!store) return store.error();
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd || ::lseek(fd.get(), static_cast<off_t>(h.body_offset), SEEK_SET) < 0)
    return base::sys_fail("read the delta " + path, errno);
  std::unordered_map<std::string, uint32_t> sizes;
  for (auto& c : h.list.chunks) sizes[c.sha256] = c.size;
  std::vector<char> out;
  std::string z;
  uint64_t added = 0;
  for (auto& [sha, n] : h.included) {
    z.resize(n);
    size_t got = 0;
    while (got < n) {
      ssize_t r = ::read(fd.get(), z.data() + got, n - got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return base::fail("the delta is refused: it ends inside chunk " + sha, "bad_snapshot");
      got += static_cast<size_t>(r);
    }
    ChunkRef c{sha, sizes.at(sha)};
    if (auto ok = check_compressed(c, z, out); !ok)
      return base::fail("the delta is refused: " + ok.error().message, "bad_snapshot");
    auto kept = keep_chunk(store->get(), sha, z);
    if (!kept) return kept.error();
    if (*kept) added += n;
  }
  char extra;
  if (::read(fd.get(), &extra, 1) != 0)
    return base::fail("the delta is refused: bytes follow its last chunk", "bad_snapshot");
  size_t missing = 0;
  for (auto& c : h.list.chunks) {
    struct stat st {};
    if (::fstatat(store->get(), chunk_path(c.sha256).c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) ++missing;
  }
  if (missing && h.base.empty())
    return base::fail("this box lacks " + std::to_string(missing) + " chunks of snapshot " + h.snapshot +
                          " that the delta left out as chunks it had: they were removed since it said so;"
                          " send it again",
                      "missing_chunks");
  if (missing)
    return base::fail("this box lacks " + std::to_string(missing) + " chunks of snapshot " + h.snapshot +
                          " that the delta leaves to its base " + h.base + ": import " + h.base + " first",
                      "missing_base");
  os::UniqueFd any(::openat(store->get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!any || ::syncfs(any.get()) != 0) return base::sys_fail("sync the chunk store", errno);
  return added;
}

// ---- the store ----

namespace {
// Calls fn(subdir fd, name, stat) for every file of the store's 256 subdirectories.
template <class Fn>
void each_file(int dir, Fn fn) {
  for (int i = 0; i < 256; ++i) {
    char sub[3];
    std::snprintf(sub, sizeof sub, "%02x", i);
    int fd = ::openat(dir, sub, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) continue;
    DIR* d = ::fdopendir(fd);
    if (!d) {
      ::close(fd);
      continue;
    }
    while (auto* e = ::readdir(d)) {
      std::string_view name = e->d_name;
      if (name == "." || name == "..") continue;
      struct stat st {};
      if (::fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      fn(fd, name, st);
    }
    ::closedir(d);
  }
}
}  // namespace

base::Result<std::pair<StoreUsage, StoreUsage>> collect_garbage(const std::string& dir,
                                                                const std::unordered_set<std::string>& live) {
  auto fd = open_store(dir, false);
  if (!fd) return fd.error();
  StoreUsage removed, kept;
  each_file(fd->get(), [&](int sub, std::string_view name, const struct stat& st) {
    if (is_sha256_hex(name) && S_ISREG(st.st_mode) && live.contains(std::string(name))) {
      ++kept.chunks;
      kept.bytes += static_cast<uint64_t>(st.st_size);
      return;
    }
    if (::unlinkat(sub, std::string(name).c_str(), 0) == 0 && is_sha256_hex(name)) {
      ++removed.chunks;
      removed.bytes += static_cast<uint64_t>(st.st_size);
    }
  });
  return std::pair{removed, kept};
}

StoreUsage store_usage(const std::string& dir) {
  StoreUsage u;
  auto fd = open_store(dir, false);
  if (!fd) return u;
  each_file(fd->get(), [&](int, std::string_view name, const struct stat& st) {
    if (!is_sha256_hex(name) || !S_ISREG(st.st_mode)) return;
    ++u.chunks;
    u.bytes += static_cast<uint64_t>(st.st_size);
  });
  return u;
}

}  // namespace sbx::archive
