// The checkpoint archive: round trip, and refusal of corrupted, truncated and unsafe archives.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <csignal>

#include <filesystem>
#include <fstream>
#include <string>

#include "archive/archive.hpp"
#include "archive/hash.hpp"
#include "checkpoint/checkpointer.hpp"
#include "mount-ns.hpp"
#include "os/files.hpp"
#include "os/sys.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
using namespace sbx::archive;
namespace os = sbx::os;

namespace {

// One per test case: its own directory, gone at the end.
struct TempDir : sbx::test::TempDir {
  TempDir() : sbx::test::TempDir("archive-test") {}
};

void put(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

std::string get(const fs::path& p) {
  auto r = sbx::os::read_file(p.string());
  return r ? *r : std::string("<missing>");
}

boost::json::object manifest() { return {{"format", kFormatName}, {"format_version", kFormatVersion}, {"box", "b-1"}}; }

// One key for the whole test binary: the box's own, which its policy trusts.
const SigningKey& box_key() {
  static SigningKey k = [] {
    auto g = SigningKey::generate();
    REQUIRE_MESSAGE(g.has_value(), g.error().message);
    return std::move(*g);
  }();
  return k;
}

ImportPolicy trusting() {
  ImportPolicy p;
  p.trusted.push_back(box_key().public_key());
  return p;
}

sbx::base::Result<ArchiveInfo> write(const fs::path& src, const boost::json::object& m, const fs::path& dst) {
  return write_archive(src.string(), m, dst.string(), 3, &box_key());
}

sbx::base::Result<boost::json::object> extract(const fs::path& src, const fs::path& dst) {
  auto x = extract_archive(src.string(), dst.string(), trusting());
  if (!x) return x.error();
  return x->manifest;
}

// What a failed result says ("" for a value).
template <class T>
std::string why(const sbx::base::Result<T>& r) {
  return r ? std::string() : r.error().message;
}

}  // namespace

TEST_CASE("archive: a tree goes in and comes back out the same, with its manifest") {
  TempDir t;
  put(t.path / "src/criu/core-1.img", std::string(100000, 'x'));
  put(t.path / "src/fs/workspace/a.txt", "hello");
  fs::create_directories(t.path / "src/fs/tmp/empty");
  fs::create_symlink("a.txt", t.path / "src/fs/workspace/link");
  auto info = write(t.path / "src", manifest(), t.path / "a.tar.zst");
  REQUIRE_MESSAGE(info.has_value(), why(info));
  CHECK(info->compressed_bytes < 100000);
  CHECK(info->raw_bytes > 100005);
  auto sha = sha256_file((t.path / "a.tar.zst").string());
  REQUIRE(sha.has_value());
  CHECK(*sha == info->sha256);

  auto m = extract(t.path / "a.tar.zst", t.path / "out");
  REQUIRE_MESSAGE(m.has_value(), why(m));
  CHECK(m->at("box") == "b-1");
  CHECK(m->at("files").as_object().contains("fs/workspace/a.txt"));
  CHECK(get(t.path / "out/fs/workspace/a.txt") == "hello");
  CHECK(get(t.path / "out/criu/core-1.img") == std::string(100000, 'x'));
  CHECK(fs::read_symlink(t.path / "out/fs/workspace/link") == "a.txt");
  CHECK(fs::is_directory(t.path / "out/fs/tmp/empty"));
}

TEST_CASE("archive: a write the file system refuses fails the archive, naming why, and leaves no file") {
  TempDir t;
  // 6 MiB that do not compress, into a file the process may grow to 1 MiB only (EFBIG).
  std::string noise(6u << 20, '\0');
  uint64_t x = 88172645463325252ull;
  for (auto& c : noise) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c = static_cast<char>(x);
  }
  put(t.path / "src/criu/pages-1.img", noise);
  struct rlimit old {};
  ::getrlimit(RLIMIT_FSIZE, &old);
  auto old_xfsz = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 1u << 20;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  auto info = write(t.path / "src", manifest(), t.path / "a.tar.zst");
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_xfsz);
  REQUIRE_FALSE(info.has_value());
  CHECK_MESSAGE(why(info).find("File too large") != std::string::npos, why(info));
  CHECK_FALSE(fs::exists(t.path / "a.tar.zst"));
  // The same archive without the limit: written whole.
  auto again = write(t.path / "src", manifest(), t.path / "a.tar.zst");
  REQUIRE_MESSAGE(again.has_value(), why(again));
  CHECK(again->compressed_bytes > (6u << 20));
}

TEST_CASE("archive: damaged archives are refused with the reason and leave nothing behind") {
  TempDir t;
  put(t.path / "src/criu/pages-1.img", std::string(50000, 'p') + "tail");
  auto info = write(t.path / "src", manifest(), t.path / "a.tar.zst");
  REQUIRE(info.has_value());
  auto data = get(t.path / "a.tar.zst");

  SUBCASE("truncated") {
    put(t.path / "bad.tar.zst", data.substr(0, data.size() / 2));
    auto x = extract(t.path / "bad.tar.zst", t.path / "out");
    CHECK_FALSE(x.has_value());
    INFO(why(x));
    CHECK(why(x).find("truncated") != std::string::npos);
  }
  SUBCASE("a flipped byte") {
    std::string bad = data;
    bad[bad.size() / 2] = static_cast<char>(bad[bad.size() / 2] ^ 0x55);
    put(t.path / "bad.tar.zst", bad);
    auto x = extract(t.path / "bad.tar.zst", t.path / "out");
    CHECK_FALSE(x.has_value());
    INFO(why(x));
    CHECK((why(x).find("corrupted") != std::string::npos || why(x).find("truncated") != std::string::npos));
  }
  SUBCASE("a flipped bit anywhere: refused, unless it changes nothing the archive holds") {
    // Tar headers and padding are not in the manifest's hashes; the zstd frame's checksum covers
    // them (read to the end of the stream). A few bits of a zstd frame decode to the same bytes
    // either way (the window size, some unused bits): such a flip changes no content, and the
    // archive's sha256, its id, is checked before any restore anyway.
    auto decoded = [](const std::string& z) {
      std::string out(4u << 20, '\0');
      size_t n = ZSTD_decompress(out.data(), out.size(), z.data(), z.size());
      return ZSTD_isError(n) ? std::string("error") : out.substr(0, n);
    };
    std::string content = decoded(data);
    REQUIRE(content != "error");
    int refused = 0, tried = 0;
    for (size_t at = 0; at < data.size(); at += std::max<size_t>(1, data.size() / 61)) {
      std::string bad = data;
      bad[at] = static_cast<char>(bad[at] ^ 0x01);
      put(t.path / "bad.tar.zst", bad);
      INFO("flipped byte " << at << " of " << data.size());
      ++tried;
      if (!extract(t.path / "bad.tar.zst", t.path / "out")) {
        ++refused;
        CHECK(fs::exists(t.path / "out") == false);
      } else {
        CHECK(decoded(bad) == content);  // accepted only when the content is the same
        fs::remove_all(t.path / "out");
      }
    }
    CHECK(refused >= tried - 4);
  }
  SUBCASE("not an archive at all") {
    put(t.path / "bad.tar.zst", "hello, I am not a tar stream");
    auto x = extract(t.path / "bad.tar.zst", t.path / "out");
    CHECK_FALSE(x.has_value());
    CHECK_FALSE(why(x).empty());
  }
  CHECK_FALSE(fs::exists(t.path / "out"));
}

TEST_CASE("archive: a manifest of another format or version is refused") {
  TempDir t;
  put(t.path / "src/x", "x");
  auto m = manifest();
  m["format_version"] = kLinksFormatVersion + 1;
  REQUIRE(write(t.path / "src", m, t.path / "a.tar.zst").has_value());
  auto x = extract(t.path / "a.tar.zst", t.path / "out");
  CHECK_FALSE(x.has_value());
  CHECK(why(x).find("format_version") != std::string::npos);
}

namespace {
// The tar stream of an archive file, and an archive file of a tar stream.
std::string untar_zstd(const std::string& z) {
  std::string out(8u << 20, '\0');
  size_t n = ZSTD_decompress(out.data(), out.size(), z.data(), z.size());
  REQUIRE_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}
std::string zstd_of(const std::string& tar, int level) {
  std::string z(ZSTD_compressBound(tar.size()), '\0');
  size_t n = ZSTD_compress(z.data(), z.size(), tar.data(), tar.size(), level);
  REQUIRE_FALSE(ZSTD_isError(n));
  z.resize(n);
  return z;
}
// The first entry's bytes (manifest.json) of a tar stream.
std::string first_entry(const std::string& tar) {
  size_t size = std::stoul(std::string(tar.data() + 124, 11), nullptr, 8);
  return tar.substr(512, size);
}
}  // namespace

TEST_CASE("archive: the snapshot id is the manifest's hash, whatever bytes the compression made") {
  TempDir t;
  put(t.path / "src/criu/pages-1.img", std::string(200000, 'p'));
  put(t.path / "src/fs/workspace/a.txt", "hello");
  auto info = write(t.path / "src", manifest(), t.path / "a.tar.zst");
  REQUIRE_MESSAGE(info.has_value(), why(info));
  std::string tar = untar_zstd(get(t.path / "a.tar.zst"));
  Sha256 h;
  std::string text = first_entry(tar);
  h.update(text.data(), text.size());
  CHECK(info->manifest_sha256 == h.hex());
  auto head = read_manifest((t.path / "a.tar.zst").string());
  REQUIRE_MESSAGE(head.has_value(), why(head));
  CHECK(head->format_version == kFormatVersion);
  CHECK(head->manifest_sha256 == info->manifest_sha256);
  CHECK(head->manifest.at("box") == "b-1");
  auto id = archive_id((t.path / "a.tar.zst").string());
  REQUIRE_MESSAGE(id.has_value(), why(id));
  CHECK(*id == snapshot_id_of(info->manifest_sha256));
  // The same stream compressed otherwise: other bytes, the same id.
  put(t.path / "b.tar.zst", zstd_of(tar, 19));
  CHECK(sha256_file((t.path / "b.tar.zst").string()).value() != info->sha256);
  CHECK(archive_id((t.path / "b.tar.zst").string()).value() == *id);
  // The control: a format-2 archive is still named by its file's hash.
  auto old = manifest();
  old["format_version"] = 2;
  auto v2 = write(t.path / "src", old, t.path / "c.tar.zst");
  REQUIRE_MESSAGE(v2.has_value(), why(v2));
  CHECK(archive_id((t.path / "c.tar.zst").string()).value() == snapshot_id_of(v2->sha256));
  CHECK(extract(t.path / "c.tar.zst", t.path / "out").has_value());
}

TEST_CASE("archive: verify_archive checks every entry and writes nothing") {
  TempDir t;
  put(t.path / "src/criu/pages-1.img", std::string(200000, 'p'));
  put(t.path / "src/fs/workspace/a.txt", "hello");
  fs::create_symlink("a.txt", t.path / "src/fs/workspace/link");
  REQUIRE(write(t.path / "src", manifest(), t.path / "a.tar.zst").has_value());
  auto ok = verify_archive((t.path / "a.tar.zst").string(), trusting());
  REQUIRE_MESSAGE(ok.has_value(), why(ok));
  CHECK(ok->trusted);
  // A payload byte changed, the stream recompressed as a valid frame: only the entry's hash tells.
  std::string tar = untar_zstd(get(t.path / "a.tar.zst"));
  auto at = tar.find("hello");
  REQUIRE(at != std::string::npos);
  tar[at] = 'j';
  put(t.path / "bad.tar.zst", zstd_of(tar, 3));
  auto before = std::distance(fs::directory_iterator(t.path), fs::directory_iterator());
  auto bad = verify_archive((t.path / "bad.tar.zst").string(), trusting());
  REQUIRE_FALSE(bad.has_value());
  CHECK(why(bad) == "sha256 mismatch for fs/workspace/a.txt: the archive is corrupted");
  CHECK(std::distance(fs::directory_iterator(t.path), fs::directory_iterator()) == before);
  auto id = archive_id((t.path / "bad.tar.zst").string());
  CHECK_FALSE(id.has_value());
  // Extraction says the same (the control: the check is the extraction's own).
  CHECK(why(extract(t.path / "bad.tar.zst", t.path / "out")) == why(bad));
}

TEST_CASE("checkpoint: snapshot ids are s- and 16 hex digits") {
  CHECK(valid_snapshot_id("s-0123456789abcdef"));
  CHECK_FALSE(valid_snapshot_id("s-0123456789abcde"));
  CHECK_FALSE(valid_snapshot_id("s-0123456789ABCDEF"));
  CHECK_FALSE(valid_snapshot_id("../../etc/passwd0"));
  CHECK_FALSE(valid_snapshot_id("x-0123456789abcdef"));
}

TEST_CASE("archive: a snapshot from another image or criu version is refused with the reason") {
  boost::json::object live{{"mode", "live"}, {"criu", "4.2.1"}, {"image", "sha256:aaa"}};
  SUBCASE("the same image and criu: restorable (the control)") {
    CHECK(incompatibility(live, std::string("4.2.1"), std::string("sha256:aaa")).has_value());
  }
  SUBCASE("another image") {
    auto refusal = incompatibility(live, std::string("4.2.1"), std::string("sha256:bbb"));
    REQUIRE_FALSE(refusal.has_value());
    CHECK(refusal.error().message.find("image sha256:aaa") != std::string::npos);
    CHECK(refusal.error().message.find("image sha256:bbb") != std::string::npos);
  }
  SUBCASE("another criu") {
    auto refusal = incompatibility(live, std::string("4.1.1"), std::string("sha256:aaa"));
    REQUIRE_FALSE(refusal.has_value());
    CHECK(refusal.error().message == "the snapshot was made with criu 4.2.1, this box has criu 4.1.1");
  }
  SUBCASE("no criu here for a live snapshot") {
    CHECK_FALSE(incompatibility(live, std::nullopt, std::string("sha256:aaa")).has_value());
  }
  SUBCASE("an unknown image on either side is no reason to refuse") {
    CHECK(incompatibility(live, std::string("4.2.1"), std::nullopt).has_value());
    auto plain = live;
    plain["image"] = nullptr;
    CHECK(incompatibility(plain, std::string("4.2.1"), std::string("sha256:bbb")).has_value());
  }
  SUBCASE("a files-only snapshot needs no criu, but the same image") {
    boost::json::object fs_only{{"mode", "fs"}, {"criu", nullptr}, {"image", "sha256:aaa"}};
    CHECK(incompatibility(fs_only, std::nullopt, std::string("sha256:aaa")).has_value());
    CHECK_FALSE(incompatibility(fs_only, std::nullopt, std::string("sha256:bbb")).has_value());
  }
}

TEST_CASE("archive: the image id comes from image.json's id, else none") {
  TempDir d;
  put(d.path / "image.json", R"({"id": "sha256:abc", "version": "0.1.0"})");
  CHECK(read_image_id((d.path / "image.json").string()) == std::optional<std::string>("sha256:abc"));
  CHECK_FALSE(read_image_id((d.path / "missing.json").string()));
  put(d.path / "bad.json", "not json");
  CHECK_FALSE(read_image_id((d.path / "bad.json").string()));
}

TEST_CASE("archive: the manifest and its signature come first, before any payload") {
  TempDir t;
  put(t.path / "src/criu/core-1.img", "core");
  REQUIRE(write(t.path / "src", manifest(), t.path / "a.tar.zst").has_value());
  auto z = get(t.path / "a.tar.zst");
  std::string tar(1 << 20, '\0');
  size_t n = ZSTD_decompress(tar.data(), tar.size(), z.data(), z.size());
  REQUIRE_FALSE(ZSTD_isError(n));
  CHECK(std::string(tar.c_str()) == "manifest.json");
  size_t size = std::stoul(std::string(tar.data() + 124, 11), nullptr, 8);
  size_t second = 512 + (size + 511) / 512 * 512;
  CHECK(std::string(tar.c_str() + second) == "signature.json");
}

TEST_CASE("archive: only a trusted key's signature lets an archive in") {
  TempDir t;
  put(t.path / "src/criu/core-1.img", "core");
  put(t.path / "src/fs/workspace/a.txt", "a");
  std::string err;
  SUBCASE("unsigned: refused, and accepted (untrusted) under allow_unsigned") {
    REQUIRE(
        write_archive((t.path / "src").string(), manifest(), (t.path / "a.tar.zst").string(), 3, nullptr).has_value());
    auto refused = extract_archive((t.path / "a.tar.zst").string(), (t.path / "out").string(), trusting());
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == "untrusted");
    CHECK(why(refused).find("it is not signed") != std::string::npos);
    CHECK_FALSE(fs::exists(t.path / "out"));
    auto p = trusting();
    p.allow_unsigned = true;
    auto x = extract_archive((t.path / "a.tar.zst").string(), (t.path / "out").string(), p);
    REQUIRE_MESSAGE(x.has_value(), why(x));
    CHECK_FALSE(x->trusted);
    CHECK(x->why_untrusted == "it is not signed");
  }
  SUBCASE("signed by another key: refused with that key's fingerprint") {
    auto other = SigningKey::generate();
    REQUIRE(other.has_value());
    REQUIRE(
        write_archive((t.path / "src").string(), manifest(), (t.path / "a.tar.zst").string(), 3, &*other).has_value());
    auto refused = extract_archive((t.path / "a.tar.zst").string(), (t.path / "out").string(), trusting());
    CHECK_FALSE(refused.has_value());
    CHECK(why(refused).find("signed by an unknown key " + other->public_key().fingerprint()) != std::string::npos);
  }
  SUBCASE("signed by the box's key: trusted (the control)") {
    REQUIRE(write(t.path / "src", manifest(), t.path / "a.tar.zst").has_value());
    auto x = extract_archive((t.path / "a.tar.zst").string(), (t.path / "out").string(), trusting());
    REQUIRE_MESSAGE(x.has_value(), why(x));
    CHECK(x->trusted);
    CHECK(x->signer == box_key().public_key().fingerprint());
  }
}

TEST_CASE("archive: the expansion is bounded by the box's limit") {
  TempDir t;
  put(t.path / "src/fs/big", std::string(100000, 'b'));
  REQUIRE(write(t.path / "src", manifest(), t.path / "a.tar.zst").has_value());
  auto p = trusting();
  p.max_bytes = 50000;
  auto x = extract_archive((t.path / "a.tar.zst").string(), (t.path / "out").string(), p);
  CHECK_FALSE(x.has_value());
  CHECK(why(x).find("would expand beyond 50000 bytes") != std::string::npos);
  CHECK_FALSE(fs::exists(t.path / "out"));
}

TEST_CASE("archive: symlinks come back as symlinks, and nothing is followed through them") {
  TempDir t;
  put(t.path / "src/fs/workspace/a", "a");
  fs::create_symlink("/etc", t.path / "src/fs/workspace/etc");
  REQUIRE(write(t.path / "src", manifest(), t.path / "a.tar.zst").has_value());
  auto x = extract_archive((t.path / "a.tar.zst").string(), (t.path / "out").string(), trusting());
  REQUIRE_MESSAGE(x.has_value(), why(x));
  CHECK(fs::read_symlink(t.path / "out/fs/workspace/etc") == "/etc");
  CHECK(get(t.path / "out/fs/workspace/a") == "a");
}

TEST_CASE("signing: a signature checks only its own message") {
  auto sig = box_key().sign("hello");
  REQUIRE(sig.has_value());
  REQUIRE(sig->size() == 64);
  CHECK(box_key().public_key().verify("hello", *sig));
  CHECK_FALSE(box_key().public_key().verify("hellO", *sig));
}

// copy_tree copies a layer the agent wrote: nothing in it, or already at the destination, is
// followed or written through (issue #13 item 4).
TEST_CASE("copy_tree: goes into a new place only, never through a symlink, keeping owners and modes") {
  TempDir t;
  auto victim = t.path / "victim";
  fs::create_directories(victim);
  fs::permissions(victim, fs::perms(0755));
  put(victim / "keep", "host file");
  put(t.path / "src/x/ld.so.preload", "evil");
  fs::permissions(t.path / "src/x", fs::perms(0777));
  fs::create_symlink(victim, t.path / "src/link");

  SUBCASE("a destination that exists already is refused, and nothing is merged into it") {
    fs::create_directories(t.path / "dst");
    fs::create_symlink(victim, t.path / "dst/x");
    auto r = os::copy_tree((t.path / "src").string(), (t.path / "dst").string());
    CHECK_FALSE(r.has_value());
    CHECK(why(r).find("the destination exists already") != std::string::npos);
    CHECK(fs::is_symlink(fs::symlink_status(t.path / "dst/x")));  // untouched
  }
  SUBCASE("a destination that is a symlink is refused, not followed") {
    fs::create_symlink(victim, t.path / "dst");
    auto r = os::copy_tree((t.path / "src").string(), (t.path / "dst").string());
    CHECK_FALSE(r.has_value());
    CHECK(why(r).find("(it is a symlink)") != std::string::npos);
  }
  SUBCASE("a source that is a symlink is refused") {
    auto r = os::copy_tree((t.path / "src/link").string(), (t.path / "dst").string());
    CHECK_FALSE(r.has_value());
    CHECK(why(r).find("is a symlink, not a directory") != std::string::npos);
  }
  SUBCASE("symlinks are copied as symlinks, owners, modes and set-id bits are kept, FIFOs skipped") {
    REQUIRE(::chown((t.path / "src/x/ld.so.preload").c_str(), 1234, 5678) == 0);
    REQUIRE(::chmod((t.path / "src/x/ld.so.preload").c_str(), 04751) == 0);
    REQUIRE(::chown((t.path / "src/x").c_str(), 4321, 8765) == 0);
    REQUIRE(::lchown((t.path / "src/link").c_str(), 1111, 2222) == 0);
    REQUIRE(::mkfifo((t.path / "src/fifo").c_str(), 0644) == 0);
    auto n = os::copy_tree((t.path / "src").string(), (t.path / "dst").string());
    REQUIRE_MESSAGE(n.has_value(), why(n));
    CHECK(*n == 4);
    struct stat st {};
    REQUIRE(::lstat((t.path / "dst/x/ld.so.preload").c_str(), &st) == 0);
    CHECK(st.st_uid == 1234);
    CHECK(st.st_gid == 5678);
    CHECK((st.st_mode & 07777) == 04751);
    REQUIRE(::lstat((t.path / "dst/x").c_str(), &st) == 0);
    CHECK(st.st_uid == 4321);
    CHECK((st.st_mode & 07777) == 0777);
    REQUIRE(::lstat((t.path / "dst/link").c_str(), &st) == 0);
    CHECK(S_ISLNK(st.st_mode));
    CHECK(st.st_uid == 1111);
    CHECK(fs::read_symlink(t.path / "dst/link") == victim);
    CHECK_FALSE(fs::exists(fs::symlink_status(t.path / "dst/fifo")));
    CHECK(get(t.path / "dst/x/ld.so.preload") == "evil");
  }
  // Whatever happened, the host directory the symlinks point at is as it was.
  struct stat st {};
  REQUIRE(::stat(victim.c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0755);
  CHECK(get(victim / "keep") == "host file");
  CHECK_FALSE(fs::exists(victim / "ld.so.preload"));
}

TEST_CASE("copy_tree: the attack of issue #13 item 4 (two sources into one place) stops at the second") {
  // A cold copy's tmp holds x -> victim, its tmp-upper a directory x: copied one after the other
  // into one place, the old copy_tree chmod-ed the victim 0777 and wrote x/ld.so.preload into it.
  TempDir t;
  auto victim = t.path / "victim";
  fs::create_directories(victim);
  fs::permissions(victim, fs::perms(0755));
  fs::create_directories(t.path / "tmp");
  fs::create_symlink(victim, t.path / "tmp/x");
  put(t.path / "tmp-upper/x/ld.so.preload", "evil");
  fs::permissions(t.path / "tmp-upper/x", fs::perms(0777));
  REQUIRE(os::copy_tree((t.path / "tmp").string(), (t.path / "out").string()).has_value());
  auto second = os::copy_tree((t.path / "tmp-upper").string(), (t.path / "out").string());
  CHECK_FALSE(second.has_value());
  CHECK(why(second).find("the destination exists already") != std::string::npos);
  struct stat st {};
  REQUIRE(::stat(victim.c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0755);
  CHECK_FALSE(fs::exists(victim / "ld.so.preload"));
}

TEST_CASE("os: make_dirs makes what is missing, finds what is there, and names what is in the way") {
  TempDir t;
  std::string top = t.path.string();
  REQUIRE(sbx::os::make_dirs(top + "/a/b/c", 0750).has_value());
  CHECK(fs::is_directory(t.path / "a/b/c"));
  CHECK((fs::status(t.path / "a").permissions() & fs::perms::all) == fs::perms(0750));
  REQUIRE(sbx::os::make_dirs(top + "/a/b/c", 0750).has_value());   // there already
  REQUIRE(sbx::os::make_dirs(top + "/a/b/d/", 0750).has_value());  // a trailing slash
  CHECK(fs::is_directory(t.path / "a/b/d"));
  fs::create_directory_symlink(t.path / "a", t.path / "link");
  REQUIRE(sbx::os::make_dirs(top + "/link/e", 0750).has_value());  // a symlink to a directory is one
  CHECK(fs::is_directory(t.path / "a/e"));
  put(t.path / "a/file", "x");
  auto r = sbx::os::make_dirs(top + "/a/file", 0750);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().value() == ENOTDIR);
  r = sbx::os::make_dirs(top + "/a/file/f/g", 0750);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().value() == ENOTDIR);
  r = sbx::os::make_dirs("relative-does-not-exist-" + std::to_string(::getpid()) + "/x", 0750);
  REQUIRE(r.has_value());  // relative to the working directory
  fs::remove_all("relative-does-not-exist-" + std::to_string(::getpid()));
}

TEST_CASE("os: write_file_atomic_at replaces a symlink at its place and never follows one") {
  TempDir t;
  put(t.path / "victim", "host file");
  fs::create_directories(t.path / "run/sandboxer");
  fs::create_symlink(t.path / "victim", t.path / "run/sandboxer/branch.json");
  auto top = sbx::os::open_dir(t.path.string());
  REQUIRE(top.has_value());
  SUBCASE("a symlink on the way is refused") {
    fs::remove_all(t.path / "run/sandboxer");
    fs::create_symlink(t.path, t.path / "run/sandboxer");
    auto d = sbx::os::make_dirs_at(top->get(), "run/sandboxer", 0755);
    REQUIRE_FALSE(d.has_value());
    CHECK(d.error().value() == ELOOP);
  }
  SUBCASE("the file's place") {
    auto d = sbx::os::make_dirs_at(top->get(), "run/sandboxer", 0755);
    REQUIRE(d.has_value());
    REQUIRE(sbx::os::write_file_atomic_at(d->get(), "branch.json", "{}\n", 0644).has_value());
    CHECK(fs::is_regular_file(fs::symlink_status(t.path / "run/sandboxer/branch.json")));
    CHECK(get(t.path / "run/sandboxer/branch.json") == "{}\n");
  }
  CHECK(get(t.path / "victim") == "host file");
}

TEST_CASE("os: copy_file_atomic_at copies the bytes, replaces a symlink, and leaves nothing of a short source") {
  TempDir t;
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 % 251);
  put(t.path / "src", big);
  put(t.path / "victim", "host file");
  fs::create_directories(t.path / "home");
  fs::create_symlink(t.path / "victim", t.path / "home/copy");
  auto home = sbx::os::open_dir((t.path / "home").string());
  REQUIRE(home.has_value());
  sbx::os::UniqueFd src(::open((t.path / "src").c_str(), O_RDONLY | O_CLOEXEC));
  REQUIRE(src);
  SUBCASE("whole") {
    REQUIRE(sbx::os::copy_file_atomic_at(home->get(), "copy", src.get(), big.size(), 0755).has_value());
    CHECK(fs::is_regular_file(fs::symlink_status(t.path / "home/copy")));
    CHECK(get(t.path / "home/copy") == big);
    struct stat st {};
    REQUIRE(::stat((t.path / "home/copy").c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == 0755);
  }
  SUBCASE("a source shorter than its size") {
    auto r = sbx::os::copy_file_atomic_at(home->get(), "copy", src.get(), big.size() + 1, 0755);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().value() == ENODATA);
    CHECK(fs::is_symlink(t.path / "home/copy"));  // what was there is as it was
    CHECK(std::distance(fs::directory_iterator(t.path / "home"), fs::directory_iterator()) == 1);  // no temporary
  }
  CHECK(get(t.path / "victim") == "host file");
}

TEST_CASE("os: write_file_atomic reports the file it wrote, not whatever the path names later") {
  TempDir t;
  const auto path = (t.path / "init.json").string();
  struct stat mine {
  }, now{};
  REQUIRE(sbx::os::write_file_atomic(path, "a\n", 0644, &mine).has_value());
  REQUIRE(::lstat(path.c_str(), &now) == 0);
  CHECK(mine.st_ino == now.st_ino);
  CHECK(mine.st_dev == now.st_dev);
  CHECK(mine.st_size == 2);
  // Another writer's rename replaces it at the path: the first's stat still names its own inode,
  // which a later lstat of the path would not.
  struct stat theirs {};
  REQUIRE(sbx::os::write_file_atomic(path, "bb\n", 0644, &theirs).has_value());
  REQUIRE(::lstat(path.c_str(), &now) == 0);
  CHECK(theirs.st_ino == now.st_ino);
  CHECK(mine.st_ino != now.st_ino);
}

TEST_CASE("archive: owners and modes are signed in the manifest and come back out, set-id bits never") {
  TempDir t;
  put(t.path / "src/fs/workspace/mine.txt", "agent's");
  put(t.path / "src/fs/workspace/tool", "#!/bin/sh\n");
  fs::create_symlink("mine.txt", t.path / "src/fs/workspace/link");
  REQUIRE(::chown((t.path / "src/fs/workspace").c_str(), 65534, 65534) == 0);
  REQUIRE(::chmod((t.path / "src/fs/workspace").c_str(), 0750) == 0);
  REQUIRE(::chown((t.path / "src/fs/workspace/mine.txt").c_str(), 65534, 1234) == 0);
  REQUIRE(::chmod((t.path / "src/fs/workspace/mine.txt").c_str(), 0640) == 0);
  REQUIRE(::chmod((t.path / "src/fs/workspace/tool").c_str(), 04755) == 0);
  REQUIRE(::lchown((t.path / "src/fs/workspace/link").c_str(), 65534, 65534) == 0);
  auto info = write(t.path / "src", manifest(), t.path / "a.tar.zst");
  REQUIRE_MESSAGE(info.has_value(), why(info));
  auto m = extract(t.path / "a.tar.zst", t.path / "out");
  REQUIRE_MESSAGE(m.has_value(), why(m));
  auto& listed = m->at("files").at("fs/workspace/mine.txt").as_object();
  CHECK(listed.at("uid").as_int64() == 65534);
  CHECK(listed.at("mode").as_int64() == 0640);
  struct stat st {};
  REQUIRE(::lstat((t.path / "out/fs/workspace").c_str(), &st) == 0);
  CHECK((st.st_uid == 65534 && st.st_gid == 65534 && (st.st_mode & 07777) == 0750));
  REQUIRE(::lstat((t.path / "out/fs/workspace/mine.txt").c_str(), &st) == 0);
  CHECK((st.st_uid == 65534 && st.st_gid == 1234 && (st.st_mode & 07777) == 0640));
  REQUIRE(::lstat((t.path / "out/fs/workspace/tool").c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0755);  // the setuid bit stays behind
  REQUIRE(::lstat((t.path / "out/fs/workspace/link").c_str(), &st) == 0);
  CHECK((S_ISLNK(st.st_mode) && st.st_uid == 65534));
}

TEST_CASE("hash: ParallelSha256 hashes what it is given, in order, one digest per file") {
  ParallelSha256 p(4096, 2);
  std::string all;
  for (int file = 0; file < 3; ++file) {
    std::string data;
    for (int i = 0; i < 10 + file; ++i) {
      auto& b = p.take();
      size_t n = 1 + static_cast<size_t>((i * 977 + file * 31) % b.size());
      for (size_t k = 0; k < n; ++k) b[k] = static_cast<char>('a' + (k + static_cast<size_t>(i)) % 26);
      data.append(b.data(), n);
      p.push(b, n);
    }
    p.push(p.take(), 0);  // a buffer given back unused hashes nothing
    Sha256 want;
    want.update(data.data(), data.size());
    CHECK(p.digest() == want.hex());
  }
  Sha256 empty;
  CHECK(p.digest() == empty.hex());
}

TEST_CASE("archive: one that lists more entries than the destination has inodes to spare is refused first") {
  // 3000 empty files and their two directories (a few KiB of archive) into a tmpfs of 2000 inodes that keeps 500:
  // refused no_space before any payload, nothing left. The control, in the same namespace: with no inodes kept, the
  // extraction runs out of them midway.
  if (::geteuid() != 0) return;  // mounts need root (the CI runs as root)
  TempDir t;
  for (int i = 0; i < 3000; ++i) put(t.path / "src/fs/workspace" / std::to_string(i), "");
  REQUIRE(write(t.path / "src", manifest(), t.path / "a.tar.zst").has_value());
  fs::create_directories(t.path / "fs");
  int failed = sbx::test::in_own_mount_ns([&](auto step) {
    step(::mount("tmpfs", (t.path / "fs").c_str(), "tmpfs", 0, "size=64m,nr_inodes=2000") == 0, 3);
    auto policy = trusting();
    policy.keep_inodes = 500;
    auto x = extract_archive((t.path / "a.tar.zst").string(), (t.path / "fs/out").string(), policy);
    step(!x.has_value() && x.error().code == "no_space", 4);
    step(x.error().message.starts_with("the archive lists 3002 files, directories and symlinks, and the filesystem "
                                       "it is extracted to has "),
         5);
    step(x.error().message.ends_with(" free inodes, of which 500 are kept free (for the box's journal)"), 6);
    step(!fs::exists(t.path / "fs/out"), 7);
    policy.keep_inodes = 0;
    auto c = extract_archive((t.path / "a.tar.zst").string(), (t.path / "fs/out").string(), policy);
    step(!c.has_value() && c.error().code == "bad_snapshot", 8);
    step(c.error().message.find("No space left on device") != std::string::npos, 9);
  });
  CHECK(failed == 0);  // else the step that failed
}
