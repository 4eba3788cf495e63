#include "archive.hpp"

#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "os/sys.hpp"
#include "os/unique-fd.hpp"

namespace sbx::checkpoint {

namespace fs = std::filesystem;

namespace {

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* p, size_t n) { EVP_DigestUpdate(ctx_, p, n); }
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned len = 0;
    EVP_DigestFinal_ex(ctx_, md, &len);
    static constexpr char h[] = "0123456789abcdef";
    std::string out;
    for (unsigned i = 0; i < len; ++i) {
      out += h[md[i] >> 4];
      out += h[md[i] & 15];
    }
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

// Where libarchive's tar stream goes: compressed here with libzstd (a frame with a content
// checksum, which libarchive's zstd filter does not write: with it, a flipped byte anywhere in the
// file is an error at extraction, not only where the manifest's hashes look), then into the
// file, hashed and counted on the way.
struct Sink {
  int fd = -1;
  Sha256 sha;
  uint64_t bytes = 0;
  int error = 0;
  std::string zerror;
  ZSTD_CCtx* z = nullptr;
  std::vector<char> out = std::vector<char>(ZSTD_CStreamOutSize());

  ~Sink() { ZSTD_freeCCtx(z); }
  bool put(const char* p, size_t n) {
    if (auto r = os::write_all(fd, {p, n}); !r) {
      error = r.error().value();
      return false;
    }
    sha.update(p, n);
    bytes += n;
    return true;
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
  return s->feed(buf, n, ZSTD_e_continue) ? static_cast<la_ssize_t>(n) : -1;
}

int sink_close(struct archive*, void* data) {
  auto* s = static_cast<Sink*>(data);
  return s->feed(nullptr, 0, ZSTD_e_end) ? ARCHIVE_OK : ARCHIVE_FATAL;
}

struct ArchiveDeleter {
  void operator()(struct archive* a) const { archive_write_free(a); }
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

  ~Source() { ZSTD_freeDCtx(z); }
  // The next decompressed bytes: >0 bytes, 0 at the end of the file, -1 on an error.
  ssize_t next() {
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
      if (ob.pos) return static_cast<ssize_t>(ob.pos);
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
  *buf = s->out.data();
  return n;
}

struct ReadDeleter {
  void operator()(struct archive* a) const { archive_read_free(a); }
};
struct EntryDeleter {
  void operator()(struct archive_entry* e) const { archive_entry_free(e); }
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

bool safe_relative(std::string_view p) {
  if (p.empty() || p.front() == '/') return false;
  fs::path path(p);
  for (auto& part : path)
    if (part == "..") return false;
  return true;
}

}  // namespace

std::optional<std::string> sha256_file(const std::string& path, std::string& err) {
  os::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    err = "open " + path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  Sha256 sha;
  std::vector<char> buf(1 << 20);
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      err = "read " + path + ": " + std::strerror(errno);
      return std::nullopt;
    }
    if (n == 0) break;
    sha.update(buf.data(), static_cast<size_t>(n));
  }
  return sha.hex();
}

std::optional<ArchiveInfo> write_archive(const std::string& src_dir, boost::json::object manifest,
                                         const std::string& dst, int level, std::string& err) {
  Sink sink;
  os::UniqueFd out(::open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!out) {
    err = "create " + dst + ": " + std::strerror(errno);
    return std::nullopt;
  }
  sink.fd = out.get();
  sink.z = ZSTD_createCCtx();
  if (!sink.z) {
    err = "start the archive: no memory for a zstd context";
    return std::nullopt;
  }
  ZSTD_CCtx_setParameter(sink.z, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(sink.z, ZSTD_c_checksumFlag, 1);
  (void)ZSTD_CCtx_setParameter(sink.z, ZSTD_c_nbWorkers, 2);  // a libzstd without threads says no: fine
  std::unique_ptr<struct archive, ArchiveDeleter> a(archive_write_new());
  archive_write_set_format_pax_restricted(a.get());
  archive_write_set_bytes_per_block(a.get(), 1 << 20);
  archive_write_set_bytes_in_last_block(a.get(), 1);
  if (archive_write_open2(a.get(), &sink, nullptr, sink_write, sink_close, nullptr) != ARCHIVE_OK) {
    err = std::string("start the archive: ") + archive_error_string(a.get());
    return std::nullopt;
  }
  auto fail = [&](const std::string& what) {
    err = what + ": " + (sink.error             ? std::strerror(sink.error)
                         : !sink.zerror.empty() ? "zstd: " + sink.zerror
                                                : std::string(archive_error_string(a.get())));
    ::unlink(dst.c_str());
    return std::nullopt;
  };

  std::vector<fs::path> paths;
  walk(src_dir, "", paths);
  boost::json::object files;
  uint64_t raw = 0;
  std::vector<char> buf(1 << 20);
  for (auto& rel : paths) {
    std::string full = (fs::path(src_dir) / rel).string();
    struct stat st {};
    if (::lstat(full.c_str(), &st) != 0) continue;
    std::unique_ptr<struct archive_entry, EntryDeleter> e(archive_entry_new());
    archive_entry_copy_pathname(e.get(), rel.c_str());
    archive_entry_set_perm(e.get(), st.st_mode & 07777);
    archive_entry_set_uid(e.get(), st.st_uid);
    archive_entry_set_gid(e.get(), st.st_gid);
    archive_entry_set_mtime(e.get(), st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    if (S_ISDIR(st.st_mode)) {
      archive_entry_set_filetype(e.get(), AE_IFDIR);
      if (archive_write_header(a.get(), e.get()) != ARCHIVE_OK) return fail("write " + rel.string());
    } else if (S_ISLNK(st.st_mode)) {
      char target[4096];
      ssize_t n = ::readlink(full.c_str(), target, sizeof target - 1);
      if (n < 0) continue;
      target[n] = 0;
      archive_entry_set_filetype(e.get(), AE_IFLNK);
      archive_entry_copy_symlink(e.get(), target);
      if (archive_write_header(a.get(), e.get()) != ARCHIVE_OK) return fail("write " + rel.string());
      files[rel.string()] = {{"type", "symlink"}, {"target", target}};
    } else if (S_ISREG(st.st_mode)) {
      os::UniqueFd in(::open(full.c_str(), O_RDONLY | O_CLOEXEC));
      if (!in) {
        err = "open " + full + ": " + std::strerror(errno);
        ::unlink(dst.c_str());
        return std::nullopt;
      }
      archive_entry_set_filetype(e.get(), AE_IFREG);
      archive_entry_set_size(e.get(), st.st_size);
      if (archive_write_header(a.get(), e.get()) != ARCHIVE_OK) return fail("write " + rel.string());
      Sha256 sha;
      uint64_t left = static_cast<uint64_t>(st.st_size);
      while (left > 0) {
        ssize_t n = ::read(in.get(), buf.data(), std::min<uint64_t>(buf.size(), left));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          err = "read " + full + ": " + (n < 0 ? std::strerror(errno) : "the file shrank while it was archived");
          ::unlink(dst.c_str());
          return std::nullopt;
        }
        sha.update(buf.data(), static_cast<size_t>(n));
        if (archive_write_data(a.get(), buf.data(), static_cast<size_t>(n)) != n) return fail("write " + rel.string());
        left -= static_cast<uint64_t>(n);
      }
      raw += static_cast<uint64_t>(st.st_size);
      files[rel.string()] = {{"size", st.st_size}, {"sha256", sha.hex()}};
    }
    // Sockets, fifos and devices in a writable layer are not part of a snapshot.
  }
  manifest["files"] = std::move(files);
  manifest["raw_bytes"] = raw;
  std::string text = boost::json::serialize(manifest) + "\n";
  std::unique_ptr<struct archive_entry, EntryDeleter> e(archive_entry_new());
  archive_entry_copy_pathname(e.get(), "manifest.json");
  archive_entry_set_filetype(e.get(), AE_IFREG);
  archive_entry_set_perm(e.get(), 0644);
  archive_entry_set_size(e.get(), static_cast<la_int64_t>(text.size()));
  if (archive_write_header(a.get(), e.get()) != ARCHIVE_OK) return fail("write manifest.json");
  if (archive_write_data(a.get(), text.data(), text.size()) != static_cast<la_ssize_t>(text.size()))
    return fail("write manifest.json");
  if (archive_write_close(a.get()) != ARCHIVE_OK) return fail("finish the archive");
  if (::fsync(out.get()) != 0) {
    err = "fsync " + dst + ": " + std::strerror(errno);
    return std::nullopt;
  }
  return ArchiveInfo{sink.sha.hex(), raw + text.size(), sink.bytes};
}

std::optional<boost::json::object> extract_archive(const std::string& src, const std::string& dst_dir,
                                                   std::string& err) {
  auto fail = [&](std::string what) {
    err = std::move(what);
    remove_tree(dst_dir);
    return std::nullopt;
  };
  if (::mkdir(dst_dir.c_str(), 0700) != 0) return fail("create " + dst_dir + ": " + std::strerror(errno));
  os::UniqueFd in(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) return fail("open " + src + ": " + std::strerror(errno));
  Source source;
  source.fd = in.get();
  std::unique_ptr<struct archive, ReadDeleter> a(archive_read_new());
  archive_read_support_format_tar(a.get());
  // What went wrong reading: the decompressor's word first (libarchive has none for it).
  auto why = [&]() -> std::string {
    if (!source.error.empty()) return source.error;
    const char* e = archive_error_string(a.get());
    return e ? e : "unreadable";
  };
  if (archive_read_open(a.get(), &source, nullptr, source_read, nullptr) != ARCHIVE_OK)
    return fail("the archive is corrupted or truncated: " + why());
  struct Seen {
    uint64_t size;
    std::string sha;
  };
  std::map<std::string, Seen> seen;
  std::string manifest_text;
  bool have_manifest = false;
  std::vector<char> buf(1 << 20);
  for (;;) {
    struct archive_entry* e = nullptr;
    int r = archive_read_next_header(a.get(), &e);
    if (r == ARCHIVE_EOF) {
      if (!source.drain()) return fail("the archive is corrupted or truncated: " + source.error);
      break;
    }
    if (r != ARCHIVE_OK && r != ARCHIVE_WARN)
      return fail("the archive is corrupted or truncated: " + why());
    std::string path = archive_entry_pathname(e);
    if (!safe_relative(path)) return fail("the archive holds an unsafe path: " + path);
    if (have_manifest) return fail("the archive has entries after its manifest");
    auto type = archive_entry_filetype(e);
    std::string full = dst_dir + "/" + path;
    if (path == "manifest.json") {
      have_manifest = true;
      for (;;) {
        la_ssize_t n = archive_read_data(a.get(), buf.data(), buf.size());
        if (n < 0) return fail("the archive is corrupted or truncated: " + why());
        if (n == 0) break;
        manifest_text.append(buf.data(), static_cast<size_t>(n));
        if (manifest_text.size() > (64u << 20)) return fail("the archive's manifest is too large");
      }
      continue;
    }
    if (type == AE_IFDIR) {
      if (::mkdir(full.c_str(), archive_entry_perm(e) | 0700) != 0 && errno != EEXIST)
        return fail("create " + path + ": " + std::strerror(errno));
    } else if (type == AE_IFLNK) {
      if (::symlink(archive_entry_symlink(e), full.c_str()) != 0) return fail("create " + path + ": " + std::strerror(errno));
      seen[path] = {0, "symlink"};
    } else if (type == AE_IFREG) {
      os::UniqueFd out(::open(full.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, archive_entry_perm(e)));
      if (!out) return fail("create " + path + ": " + std::strerror(errno));
      Sha256 sha;
      uint64_t size = 0;
      for (;;) {
        la_ssize_t n = archive_read_data(a.get(), buf.data(), buf.size());
        if (n < 0) return fail("the archive is corrupted or truncated: " + why());
        if (n == 0) break;
        sha.update(buf.data(), static_cast<size_t>(n));
        if (auto w = os::write_all(out.get(), {buf.data(), static_cast<size_t>(n)}); !w)
          return fail("write " + path + ": " + w.error().message());
        size += static_cast<uint64_t>(n);
      }
      seen[path] = {size, sha.hex()};
    } else {
      return fail("the archive holds an entry of an unsupported type: " + path);
    }
  }
  if (!have_manifest) return fail("the archive is truncated: it has no manifest.json");
  boost::system::error_code ec;
  auto v = boost::json::parse(manifest_text, ec);
  if (ec || !v.is_object()) return fail("the archive is corrupted: its manifest.json is not a JSON object");
  auto& m = v.as_object();
  auto* fmt = m.if_contains("format");
  auto* ver = m.if_contains("format_version");
  if (!fmt || *fmt != kFormatName) return fail("not a sandboxer checkpoint archive (manifest format)");
  if (!ver || !ver->is_int64() || ver->as_int64() != kFormatVersion)
    return fail("the archive's format_version is not " + std::to_string(kFormatVersion));
  auto* files = m.if_contains("files");
  if (!files || !files->is_object()) return fail("the archive's manifest lists no files");
  for (auto& [k, f] : files->as_object()) {
    std::string path(k);
    auto it = seen.find(path);
    if (it == seen.end()) return fail("the archive is missing " + path + " (listed in its manifest)");
    if (!f.is_object()) return fail("the manifest's entry for " + path + " is not an object");
    auto& fo = f.as_object();
    if (fo.contains("sha256")) {
      auto* sz = fo.if_contains("size");
      if (!sz || !sz->is_number() || sz->to_number<uint64_t>() != it->second.size)
        return fail("size mismatch for " + path + ": the archive is corrupted");
      auto& want = fo.at("sha256");
      if (!want.is_string() || std::string_view(want.as_string()) != it->second.sha) return fail("sha256 mismatch for " + path + ": the archive is corrupted");
    }
    seen.erase(it);
  }
  if (!seen.empty()) return fail("the archive holds " + seen.begin()->first + ", which its manifest does not list");
  return m;
}

namespace {

// A copy of a tree the agent wrote (a branch's layer) into a place only the supervisor writes.
// Every entry is reached from its parent's fd without following symlinks, and every entry of the
// copy is created new (mkdirat, O_CREAT | O_EXCL, symlinkat): nothing already there is written
// through, so a symlink in the source (or anywhere) is copied as a symlink and never followed.
struct Copier {
  std::string& err;
  uint64_t bytes = 0;
  std::vector<char> buf;

  static constexpr int kMaxDepth = 256;

  bool fail(const std::string& what, int e) {
    err = what + ": " + std::strerror(e);
    return false;
  }

  // Owner and mode of the copy as the source has them: chown first (it clears set-id bits).
  bool keep_owner(int fd, const struct stat& st, const std::string& shown) {
    if (::fchown(fd, st.st_uid, st.st_gid) != 0) return fail("chown " + shown, errno);
    if (::fchmod(fd, st.st_mode & 07777) != 0) return fail("chmod " + shown, errno);
    return true;
  }

  bool data(int in, int out, const struct stat& st, const std::string& shown) {
    off_t left = st.st_size;
    bool plain = false;  // copy_file_range refuses some pairs of filesystems: read and write then
    while (left > 0) {
      ssize_t n = -1;
      if (!plain) {
        n = ::copy_file_range(in, nullptr, out, nullptr, static_cast<size_t>(left), 0);
        if (n < 0 && (errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP || errno == ENOSYS)) {
          plain = true;
          continue;
        }
      } else {
        if (buf.empty()) buf.resize(1 << 20);
        n = ::read(in, buf.data(), std::min<size_t>(buf.size(), static_cast<size_t>(left)));
        if (n > 0)
          if (auto w = os::write_all(out, {buf.data(), static_cast<size_t>(n)}); !w)
            return fail("write " + shown, w.error().value());
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return fail("copy " + shown, errno);
      if (n == 0) break;  // the file shrank under us: keep what is there
      left -= n;
    }
    bytes += static_cast<uint64_t>(st.st_size - left);
    return true;
  }

  bool file(int sdir, const char* name, int ddir, const char* dname, const std::string& shown) {
    // O_PATH first, then the very inode it holds: a FIFO or a device is never opened.
    auto p = os::open_beneath(sdir, name, O_PATH | O_NOFOLLOW);
    if (!p) return fail("open " + shown, p.error().value());
    struct stat st {};
    if (::fstat(p->get(), &st) != 0) return fail("stat " + shown, errno);
    if (!S_ISREG(st.st_mode)) return true;  // swapped for another type meanwhile: not copied
    auto in = os::reopen(p->get(), O_RDONLY);
    if (!in) return fail("open " + shown, in.error().value());
    os::UniqueFd out(::openat(ddir, dname, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) return fail("create the copy of " + shown, errno);
    return data(in->get(), out.get(), st, shown) && keep_owner(out.get(), st, shown);
  }

  bool symlink(int sdir, const char* name, const struct stat& st, int ddir, const char* dname,
               const std::string& shown) {
    std::vector<char> target(static_cast<size_t>(std::max<off_t>(st.st_size, 0)) + 2);
    ssize_t n = ::readlinkat(sdir, name, target.data(), target.size() - 1);
    if (n < 0) return fail("read the symlink " + shown, errno);
    target[static_cast<size_t>(n)] = 0;
    if (::symlinkat(target.data(), ddir, dname) != 0) return fail("create the copy of " + shown, errno);
    if (::fchownat(ddir, dname, st.st_uid, st.st_gid, AT_SYMLINK_NOFOLLOW) != 0) return fail("chown " + shown, errno);
    return true;
  }

  // Copies the directory `sfd` into `dfd` (new and empty), entry by entry.
  bool dir(int sfd, int dfd, const std::string& shown, int depth) {
    if (depth > kMaxDepth) {
      err = "copy " + shown + ": the tree is deeper than " + std::to_string(kMaxDepth) + " directories";
      return false;
    }
    int lfd = ::fcntl(sfd, F_DUPFD_CLOEXEC, 3);
    DIR* d = lfd < 0 ? nullptr : ::fdopendir(lfd);
    if (!d) {
      if (lfd >= 0) ::close(lfd);
      return fail("list " + shown, errno);
    }
    std::vector<std::string> names;
    while (auto* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) names.emplace_back(e->d_name);
    ::closedir(d);
    for (auto& n : names)
      if (!entry(sfd, n.c_str(), dfd, n.c_str(), shown + "/" + n, depth)) return false;
    return true;
  }

  // Copies the entry `name` of `sdir` as the new entry `dname` of `ddir`.
  bool entry(int sdir, const char* name, int ddir, const char* dname, const std::string& shown, int depth) {
    struct stat st {};
    if (::fstatat(sdir, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return true;  // gone meanwhile
      return fail("stat " + shown, errno);
    }
    if (S_ISLNK(st.st_mode)) return symlink(sdir, name, st, ddir, dname, shown);
    if (S_ISREG(st.st_mode)) return file(sdir, name, ddir, dname, shown);
    if (!S_ISDIR(st.st_mode)) return true;  // sockets, FIFOs, devices, overlay whiteouts: not part of a copy
    auto sub = os::open_beneath(sdir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!sub) return fail("open " + shown, sub.error().value());
    if (::fstat(sub->get(), &st) != 0) return fail("stat " + shown, errno);
    if (::mkdirat(ddir, dname, 0700) != 0) return fail("create the copy of " + shown, errno);
    auto out = os::open_beneath(ddir, dname, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!out) return fail("open the copy of " + shown, out.error().value());
    return dir(sub->get(), out->get(), shown, depth + 1) && keep_owner(out->get(), st, shown);
  }
};

}  // namespace

std::optional<uint64_t> copy_tree(const std::string& src, const std::string& dst, std::string& err) {
  auto split = [](const std::string& p) {
    auto slash = p.rfind('/');
    if (slash == std::string::npos) return std::pair<std::string, std::string>(".", p);
    return std::pair<std::string, std::string>(slash == 0 ? "/" : p.substr(0, slash), p.substr(slash + 1));
  };
  auto [sparent, sname] = split(src);
  auto [dparent, dname] = split(dst);
  if (sname.empty() || sname == "." || sname == ".." || dname.empty() || dname == "." || dname == "..") {
    err = "copy " + src + " to " + dst + ": each must name an entry";
    return std::nullopt;
  }
  // The parents are the caller's (the state dir); what is below them is reached by fd only.
  os::UniqueFd sdir(::open(sparent.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  os::UniqueFd ddir(::open(dparent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!sdir || !ddir) {
    err = "open " + (sdir ? dparent : sparent) + ": " + std::strerror(errno);
    return std::nullopt;
  }
  struct stat st {};
  if (::fstatat(sdir.get(), sname.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    err = "stat " + src + ": " + std::strerror(errno);
    return std::nullopt;
  }
  if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
    err = "copy " + src + ": it is " + os::file_type_name(st.st_mode) + ", not a directory or a regular file";
    return std::nullopt;
  }
  // A copy goes into a new place only: never merged into, or written through, what is there.
  if (::fstatat(ddir.get(), dname.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    err = "copy " + src + " to " + dst + ": the destination exists already (it is " + os::file_type_name(st.st_mode) +
          ")";
    return std::nullopt;
  }
  Copier c{err};
  if (!c.entry(sdir.get(), sname.c_str(), ddir.get(), dname.c_str(), src, 0)) return std::nullopt;
  return c.bytes;
}

void remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
}

uint64_t tree_bytes(const std::string& path) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(path, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file(ec) && !it->is_symlink(ec)) total += it->file_size(ec);
  }
  return total;
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

std::optional<std::string> incompatibility(const boost::json::object& manifest,
                                           const std::optional<std::string>& criu_here,
                                           const std::optional<std::string>& image_here) {
  auto text = [&](const char* key) -> std::optional<std::string> {
    auto* v = manifest.if_contains(key);
    if (!v || !v->is_string()) return std::nullopt;
    return std::string(v->as_string());
  };
  auto image = text("image");
  if (image && image_here && *image != *image_here)
    return "the snapshot was made in image " + *image + ", this box runs image " + *image_here +
           ": a live copy needs the same files and libraries under it";
  if (text("mode").value_or("fs") == "live") {
    auto criu = text("criu").value_or("(unknown)");
    if (!criu_here) return "the snapshot is live (criu " + criu + ") and this box has no criu";
    if (criu != *criu_here)
      return "the snapshot was made with criu " + criu + ", this box has criu " + *criu_here;
  }
  return std::nullopt;
}

}  // namespace sbx::checkpoint
