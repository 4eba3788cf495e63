// The archive of a layer with hard links and holes (the audit's: 1 MiB linked 300 times, a 1 GiB
// file of holes): a hard link entry per further name of an inode (format 4), a pax sparse entry
// per file with holes, and an extraction that makes the links again and leaves the holes holes;
// through an archive file and through the chunk store. And the bound on what an archive's files
// may add up to.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include "archive/archive.hpp"
#include "archive/chunks.hpp"
#include "os/unique-fd.hpp"
#include "sparse-files.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
using namespace sbx::archive;
namespace os = sbx::os;

using namespace sbx::test;

namespace {

// 1 MiB that does not compress, as /dev/urandom's.
const std::string& random_mib() {
  static const std::string s = [] {
    std::mt19937_64 g(7);
    std::string r(static_cast<size_t>(kMiB), '\0');
    for (size_t i = 0; i < r.size(); i += 8) {
      uint64_t v = g();
      std::memcpy(r.data() + i, &v, 8);
    }
    return r;
  }();
  return s;
}

// A snapshot's payload as the audit's checkpoint staged it: its layer and an image.
void payload(const fs::path& src) {
  put_at(src / "criu/core-1.img", 0, "image");
  auto ws = src / "fs/workspace";
  put_at(ws / "r", 0, random_mib());
  fs::create_directories(ws / "sub");
  for (int i = 1; i <= 300; ++i) fs::create_hard_link(ws / "r", (i <= 3 ? ws / "sub" : ws) / ("l" + std::to_string(i)));
  put_at(ws / "big", 0, std::string(4096, 'a'));
  put_at(ws / "big", 512 * kMiB, std::string(4096, 'b'));
  REQUIRE(::truncate((ws / "big").c_str(), kGiB) == 0);
  put_at(ws / "holes", 0, "");
  REQUIRE(::truncate((ws / "holes").c_str(), 64 * kMiB) == 0);  // no data at all
}

// What the extraction of payload() must be.
void check_extracted(const fs::path& out) {
  auto ws = out / "fs/workspace";
  auto r = lstat_of(ws / "r");
  CHECK(r.st_nlink == 301);
  CHECK(lstat_of(ws / "sub/l3").st_ino == r.st_ino);
  CHECK(lstat_of(ws / "l300").st_ino == r.st_ino);
  CHECK(get_at(ws / "l7", 0, static_cast<size_t>(kMiB)) == random_mib());
  CHECK((lstat_of(ws / "r").st_mode & 07777) == 0644);
  auto big = lstat_of(ws / "big");
  CHECK(big.st_size == kGiB);
  CHECK(get_at(ws / "big", 0, 4096) == std::string(4096, 'a'));
  CHECK(get_at(ws / "big", 512 * kMiB, 4096) == std::string(4096, 'b'));
  CHECK(get_at(ws / "big", 4096, 4096) == std::string(4096, '\0'));
  CHECK(get_at(ws / "big", kGiB - 10, 10) == std::string(10, '\0'));
  CHECK(lstat_of(ws / "holes").st_size == 64 * kMiB);
  CHECK(get_at(out / "criu/core-1.img", 0, 5) == "image");
  CHECK(blocks_bytes(out) < static_cast<uint64_t>(2 * kMiB));  // 1 MiB and 8 KiB of data, once
}

ImportPolicy trusting(const SigningKey& key) {
  ImportPolicy p;
  p.trusted.push_back(key.public_key());
  return p;
}

}  // namespace

TEST_CASE("archive: hard links stay links and holes stay holes, through an archive and the chunk store") {
  sbx::test::TempDir t("archive-links");
  payload(t.path / "src");
  auto key = SigningKey::generate();
  REQUIRE(key.has_value());
  boost::json::object m{{"format", kFormatName}, {"format_version", kFormatVersion}};

  SUBCASE("an archive file: 1 MiB and headers, a manifest of format 4 listing the links") {
    auto info = write_archive((t.path / "src").string(), m, (t.path / "a.tar.zst").string(), 3, &*key);
    REQUIRE_MESSAGE(info.has_value(), info.error().message);
    CHECK(info->format_version == kLinksFormatVersion);
    CHECK(info->compressed_bytes < static_cast<uint64_t>(kMiB + kMiB / 4));  // was 1.17 MB for 1.3 GB of entries
    CHECK(info->raw_bytes > static_cast<uint64_t>(kGiB + 65 * kMiB));        // the contents' sizes, each inode once
    CHECK(info->raw_bytes < static_cast<uint64_t>(kGiB + 66 * kMiB));
    auto x = extract_archive((t.path / "a.tar.zst").string(), (t.path / "out").string(), trusting(*key));
    REQUIRE_MESSAGE(x.has_value(), x.error().message);
    CHECK(x->format_version == kLinksFormatVersion);
    // Walked in name order (a directory's entries before what its subdirectories hold), the
    // inode's first name is l10; every other is a link to it.
    auto& files = x->manifest.at("files").as_object();
    CHECK(files.at("fs/workspace/l10").at("type") == "file");
    CHECK(files.at("fs/workspace/r") == boost::json::object{{"type", "hardlink"}, {"target", "fs/workspace/l10"}});
    CHECK(files.at("fs/workspace/sub/l2").at("target") == "fs/workspace/l10");
    CHECK(files.at("fs/workspace/big").at("size") == kGiB);
    check_extracted(t.path / "out");
    CHECK(verify_archive((t.path / "a.tar.zst").string(), trusting(*key)).has_value());
  }
  SUBCASE("the chunk store: the same stream, stored once, extracted the same") {
    auto w = ChunkWriter::open((t.path / "store").string(), 3, false);
    REQUIRE(w.has_value());
    auto info = write_snapshot((t.path / "src").string(), m, {"", w->get()}, 3, &*key);
    REQUIRE_MESSAGE(info.has_value(), info.error().message);
    CHECK(info->chunks->stored_bytes < static_cast<uint64_t>(kMiB + kMiB / 4));
    auto x = extract_chunks((t.path / "store").string(), *info->chunks, (t.path / "out").string(), trusting(*key));
    REQUIRE_MESSAGE(x.has_value(), x.error().message);
    check_extracted(t.path / "out");
    // An export from the chunks is the same archive again.
    auto rebuilt = rebuild_archive((t.path / "store").string(), *info->chunks, (t.path / "e.tar.zst").string(), 3);
    REQUIRE_MESSAGE(rebuilt.has_value(), rebuilt.error().message);
    CHECK(fs::file_size(t.path / "e.tar.zst") < static_cast<uint64_t>(kMiB + kMiB / 4));
    auto y = extract_archive((t.path / "e.tar.zst").string(), (t.path / "out2").string(), trusting(*key));
    REQUIRE_MESSAGE(y.has_value(), y.error().message);
    check_extracted(t.path / "out2");
  }
  SUBCASE("a layer of neither keeps format 3, which older readers read") {
    put_at(t.path / "plain/criu/core-1.img", 0, "image");
    put_at(t.path / "plain/fs/workspace/a", 0, "a");
    auto info = write_archive((t.path / "plain").string(), m, (t.path / "a.tar.zst").string(), 3, &*key);
    REQUIRE(info.has_value());
    CHECK(info->format_version == kFormatVersion);
    CHECK(read_manifest((t.path / "a.tar.zst").string()).value().format_version == kFormatVersion);
  }
}

TEST_CASE("archive: files that add up to more than the box's bound are not archived, saying so") {
  sbx::test::TempDir t("archive-bound");
  payload(t.path / "src");
  auto key = SigningKey::generate();
  REQUIRE(key.has_value());
  boost::json::object m{{"format", kFormatName}, {"format_version", kFormatVersion}};
  auto info = write_snapshot((t.path / "src").string(), m, {(t.path / "a.tar.zst").string(), nullptr, kGiB}, 3, &*key);
  REQUIRE_FALSE(info.has_value());
  CHECK(info.error().code == "limit");
  CHECK_MESSAGE(info.error().message.find("archive the snapshot: its files hold more than 1073741824 bytes (holes "
                                          "included; fs/workspace/big takes it to 1073741829)") == 0,
                info.error().message);
  CHECK(info.error().message.find("what an archive may expand to (--max-archive-bytes)") != std::string::npos);
  CHECK_FALSE(fs::exists(t.path / "a.tar.zst"));
  // Links count once: under 1 GiB + 66 MiB it is written.
  CHECK(write_snapshot((t.path / "src").string(), m, {(t.path / "b.tar.zst").string(), nullptr, kGiB + 66 * kMiB}, 3,
                       &*key)
            .has_value());
}

TEST_CASE("archive: an extraction leaves each block of zeros a hole, whatever the archive held") {
  // An archive made before sparse entries (or by another writer) holds zeros in its stream: they
  // take no room once extracted either.
  sbx::test::TempDir t("archive-zeros");
  std::string data = std::string(8 * kMiB, '\0') + "tail" + std::string(4 * kMiB, '\0');
  put_at(t.path / "src/fs/workspace/z", 0, data);
  auto key = SigningKey::generate();
  REQUIRE(key.has_value());
  boost::json::object m{{"format", kFormatName}, {"format_version", kFormatVersion}};
  REQUIRE(write_archive((t.path / "src").string(), m, (t.path / "a.tar.zst").string(), 3, &*key).has_value());
  REQUIRE(extract_archive((t.path / "a.tar.zst").string(), (t.path / "out").string(), trusting(*key)).has_value());
  auto st = lstat_of(t.path / "out/fs/workspace/z");
  CHECK(st.st_size == static_cast<off_t>(data.size()));
  CHECK(static_cast<uint64_t>(st.st_blocks) * 512 <= 8192);
  CHECK(get_at(t.path / "out/fs/workspace/z", 8 * kMiB - 2, 8) == std::string("\0\0tail\0\0", 8));
}
