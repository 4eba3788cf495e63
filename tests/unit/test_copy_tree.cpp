// os::copy_tree and copy_tree_into, which copy a branch's layer into a snapshot and a snapshot
// into a copy: what they write to disk is what the source takes (hard links stay links, holes
// stay holes), and never more than their bound. (Their refusal to follow a symlink or to merge
// into what is there: test_archive.cpp.)
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "mount-ns.hpp"
#include "os/files.hpp"
#include "os/unique-fd.hpp"
#include "sparse-files.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
namespace os = sbx::os;

using namespace sbx::test;

namespace {

void put(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

std::string mib_of(char c) { return std::string(static_cast<size_t>(kMiB), c); }

// A layer as the audit's agent left it: 1 MiB linked 300 times (three of the names in another
// directory), and a 1 GiB file whose only data is 4 KiB at its start and 4 KiB at 512 MiB.
void attack_layer(const fs::path& src) {
  put(src / "r", mib_of('r'));
  fs::create_directories(src / "sub");
  for (int i = 1; i <= 300; ++i)
    fs::create_hard_link(src / "r", (i <= 3 ? src / "sub" : src) / ("l" + std::to_string(i)));
  put_at(src / "big", 0, std::string(4096, 'a'));
  put_at(src / "big", 512 * kMiB, std::string(4096, 'b'));
  REQUIRE(::truncate((src / "big").c_str(), kGiB) == 0);
}

// What the copy of attack_layer must be: the same names of one inode, the same sparse file.
void check_copy_of_attack(const fs::path& dst) {
  auto r = lstat_of(dst / "r");
  CHECK(r.st_nlink == 301);
  CHECK(lstat_of(dst / "sub/l1").st_ino == r.st_ino);
  CHECK(lstat_of(dst / "l300").st_ino == r.st_ino);
  CHECK(get_at(dst / "sub/l2", 0, static_cast<size_t>(kMiB)) == mib_of('r'));
  auto big = lstat_of(dst / "big");
  CHECK(big.st_size == kGiB);
  CHECK(static_cast<uint64_t>(big.st_blocks) * 512 < static_cast<uint64_t>(kMiB));  // 8 KiB of data, in blocks
  CHECK(get_at(dst / "big", 0, 4096) == std::string(4096, 'a'));
  CHECK(get_at(dst / "big", 4096, 4096) == std::string(4096, '\0'));
  CHECK(get_at(dst / "big", 512 * kMiB, 4096) == std::string(4096, 'b'));
  CHECK(get_at(dst / "big", kGiB - 4096, 4096) == std::string(4096, '\0'));
  CHECK(blocks_bytes(dst) < static_cast<uint64_t>(2 * kMiB));
}

}  // namespace

TEST_CASE("copy_tree: names of one inode stay one inode, and holes stay holes") {
  sbx::test::TempDir t("copy-tree");
  attack_layer(t.path / "src");
  REQUIRE(blocks_bytes(t.path / "src") < static_cast<uint64_t>(2 * kMiB));  // what the source takes

  SUBCASE("copy_tree: 1 MiB and 8 KiB written, where 1.3 GB were") {
    auto n = os::copy_tree((t.path / "src").string(), (t.path / "dst").string());
    REQUIRE_MESSAGE(n.has_value(), n.error().message);
    CHECK(*n == static_cast<uint64_t>(kMiB + 8192));
    check_copy_of_attack(t.path / "dst");
    CHECK(lstat_of(t.path / "dst/r").st_ino != lstat_of(t.path / "src/r").st_ino);  // a copy, not the source
  }
  SUBCASE("copy_tree_into, as a copy's workspace gets its files") {
    fs::create_directories(t.path / "dst");
    auto n = os::copy_tree_into((t.path / "src").string(), (t.path / "dst").string());
    REQUIRE_MESSAGE(n.has_value(), n.error().message);
    CHECK(*n == static_cast<uint64_t>(kMiB + 8192));
    check_copy_of_attack(t.path / "dst");
  }
  SUBCASE("a copy of the copy is the same again (a restore copies from the snapshot the same way)") {
    REQUIRE(os::copy_tree((t.path / "src").string(), (t.path / "snap").string()).has_value());
    auto n = os::copy_tree((t.path / "snap").string(), (t.path / "dst").string());
    REQUIRE_MESSAGE(n.has_value(), n.error().message);
    check_copy_of_attack(t.path / "dst");
  }
  SUBCASE("link_tree keeps its meaning: every name a link to the source's own inode") {
    auto n = os::link_tree((t.path / "src").string(), (t.path / "dst").string());
    REQUIRE_MESSAGE(n.has_value(), n.error().message);
    auto r = lstat_of(t.path / "src/r");
    CHECK(lstat_of(t.path / "dst/sub/l1").st_ino == r.st_ino);
    CHECK(lstat_of(t.path / "dst/big").st_ino == lstat_of(t.path / "src/big").st_ino);
    CHECK(lstat_of(t.path / "src/r").st_nlink == 602);
  }
  SUBCASE("a hard link to a file outside the tree is a copy of its own (only names within the tree are linked)") {
    put(t.path / "outside", "shared with the outside");
    fs::create_hard_link(t.path / "outside", t.path / "src/in");
    REQUIRE(os::copy_tree((t.path / "src").string(), (t.path / "dst").string()).has_value());
    CHECK(lstat_of(t.path / "dst/in").st_nlink == 1);
    CHECK(get_at(t.path / "dst/in", 0, 23) == "shared with the outside");
  }
}

TEST_CASE("copy_tree: stops before the data that would pass its bound, saying what passed what") {
  sbx::test::TempDir t("copy-bound");
  os::CopyBound bound{static_cast<uint64_t>(2 * kMiB + kMiB / 2), "the branch's disk ceiling (resources.disk)",
                      "limit"};

  SUBCASE("three files of 1 MiB under 2.5 MiB: refused at the third, whose data is not written") {
    for (const char* n : {"a", "b", "c"}) put(t.path / "src" / n, mib_of(n[0]));
    auto r = os::copy_tree((t.path / "src").string(), (t.path / "dst").string(), bound);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == "limit");
    CHECK_MESSAGE(
        r.error().message.find(": its next 1048576 bytes of data would take the copy past 2621440 bytes "
                               "(2097152 written), the branch's disk ceiling (resources.disk)") != std::string::npos,
        r.error().message);
    CHECK(r.error().message.starts_with("copy " + (t.path / "src").string() + "/"));
    CHECK(blocks_bytes(t.path / "dst") <= static_cast<uint64_t>(2 * kMiB + 64 * 1024));
  }
  SUBCASE("the attack's layer fits under 2.5 MiB: links and holes are not written") {
    attack_layer(t.path / "src");
    auto r = os::copy_tree((t.path / "src").string(), (t.path / "dst").string(), bound);
    REQUIRE_MESSAGE(r.has_value(), r.error().message);
    check_copy_of_attack(t.path / "dst");
  }
  SUBCASE("copy_tree_into is bounded the same way") {
    for (const char* n : {"a", "b", "c"}) put(t.path / "src" / n, mib_of(n[0]));
    fs::create_directories(t.path / "dst");
    auto r = os::copy_tree_into((t.path / "src").string(), (t.path / "dst").string(), bound);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == "limit");
    CHECK(r.error().message.find("would take the copy past 2621440 bytes") != std::string::npos);
  }
}

TEST_CASE("copy_tree: a file of 1 TiB, all hole but a byte, is copied as sparse as it was, within a 2.5 MiB bound") {
  // Into a 64 MiB tmpfs of a mount namespace of the test's own: a copy that filled the holes (the
  // old one wrote the file's size) fails there at ENOSPC instead of filling the host's disk.
  if (::geteuid() != 0) return;  // mounts need root (the CI runs as root)
  sbx::test::TempDir t("copy-huge");
  fs::create_directories(t.path / "src");
  fs::create_directories(t.path / "fs");
  put_at(t.path / "src/huge", 0, "x");
  REQUIRE(::truncate((t.path / "src/huge").c_str(), kGiB << 10) == 0);
  int failed = sbx::test::in_own_mount_ns([&](auto step) {
    step(::mount("tmpfs", (t.path / "fs").c_str(), "tmpfs", 0, "size=64m") == 0, 3);
    auto r = os::copy_tree((t.path / "src").string(), (t.path / "fs/dst").string(),
                           {static_cast<uint64_t>(2 * kMiB + kMiB / 2), "a bound", "limit"});
    step(r.has_value(), 4);
    step(*r <= 65536, 5);  // its one byte's block (extents are whole blocks)
    struct stat st {};
    step(::stat((t.path / "fs/dst/huge").c_str(), &st) == 0 && st.st_size == (kGiB << 10), 6);
    step(static_cast<uint64_t>(st.st_blocks) * 512 < static_cast<uint64_t>(kMiB), 7);
    step(get_at(t.path / "fs/dst/huge", 0, 2) == std::string("x\0", 2), 8);
  });
  CHECK(failed == 0);  // else the step that failed
}

TEST_CASE("copy_tree: empty files cost no bytes, but the copy leaves its bound's inodes free") {
  // Into a tmpfs of 2000 inodes: 3000 empty files (and directories, symlinks) fit no byte bound's
  // notice, and the copy stops with no_space while at least keep_inodes are still free. The
  // control, in the same namespace: the same copy without keep_inodes runs out (ENOSPC).
  if (::geteuid() != 0) return;  // mounts need root (the CI runs as root)
  sbx::test::TempDir t("copy-inodes");
  for (int d = 0; d < 30; ++d) {
    fs::create_directories(t.path / "src" / std::to_string(d));
    for (int i = 0; i < 100; ++i) put(t.path / "src" / std::to_string(d) / std::to_string(i), "");
    fs::create_symlink("0", t.path / "src" / std::to_string(d) / "link");
  }
  fs::create_directories(t.path / "fs");
  int failed = sbx::test::in_own_mount_ns([&](auto step) {
    step(::mount("tmpfs", (t.path / "fs").c_str(), "tmpfs", 0, "size=64m,nr_inodes=2000") == 0, 3);
    os::CopyBound bound{.bytes = kMiB, .what = "a bound", .keep_inodes = 500, .inodes_what = "kept for the test"};
    auto r = os::copy_tree((t.path / "src").string(), (t.path / "fs/a").string(), bound);
    step(!r.has_value(), 4);
    step(r.error().code == "no_space", 5);
    step(r.error().message.find(": its next inodes would leave fewer than 500 free where it is copied to (") !=
             std::string::npos,
         6);
    step(r.error().message.ends_with(" made by the copy), kept for the test"), 7);
    struct statvfs vfs {};
    step(::statvfs((t.path / "fs").c_str(), &vfs) == 0 && vfs.f_favail >= 500, 8);
    // The control: no inodes kept, the copy runs out of them.
    bound.keep_inodes = 0;
    auto c = os::copy_tree((t.path / "src").string(), (t.path / "fs/b").string(), bound);
    step(!c.has_value() && c.error().message.find("No space left on device") != std::string::npos, 9);
  });
  CHECK(failed == 0);  // else the step that failed
}

TEST_CASE("copy_tree: two copies at once leave the kept space free between them") {
  // Two copies of 40 MiB each, at once, into a 100 MiB tmpfs that keeps 40 MiB: the space is read
  // before each extent, so one of them (or both) stops (no_space) and at least the kept room, less an extent
  // each wrote meanwhile, stays free. The control, in the same namespace: each given the free
  // space less 40 MiB once, at its start (as before), both finish, 20 MiB left.
  if (::geteuid() != 0) return;  // mounts need root (the CI runs as root)
  sbx::test::TempDir t("copy-two");
  for (int i = 0; i < 40; ++i) put(t.path / "src" / std::to_string(i), mib_of(static_cast<char>('a' + i % 26)));
  fs::create_directories(t.path / "fs");
  int failed = sbx::test::in_own_mount_ns([&](auto step) {
    step(::mount("tmpfs", (t.path / "fs").c_str(), "tmpfs", 0, "size=100m") == 0, 3);
    auto free_bytes = [&] {
      struct statvfs vfs {};
      step(::statvfs((t.path / "fs").c_str(), &vfs) == 0, 4);
      return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    };
    auto two = [&](const os::CopyBound& bound, const char* a, const char* b) {
      sbx::base::Result<uint64_t> ra = 0, rb = 0;
      std::thread other([&] { rb = os::copy_tree((t.path / "src").string(), (t.path / "fs" / b).string(), bound); });
      ra = os::copy_tree((t.path / "src").string(), (t.path / "fs" / a).string(), bound);
      other.join();
      return std::pair{std::move(ra), std::move(rb)};
    };
    const uint64_t keep = 40 * kMiB;
    os::CopyBound kept{.keep_bytes = keep, .keep_what = "kept for the test"};
    auto [a, b] = two(kept, "a", "b");
    step(!a.has_value() || !b.has_value(), 5);  // one of them, or both as they went side by side
    auto& refused = a ? b : a;
    step(refused.error().code == "no_space", 6);
    step(refused.error().message.find(" bytes free where it is copied to (") != std::string::npos, 7);
    step(free_bytes() >= keep - 2 * kMiB, 8);
    fs::remove_all(t.path / "fs/a");
    fs::remove_all(t.path / "fs/b");
    // The control: the room read once.
    os::CopyBound once{.bytes = free_bytes() - keep, .what = "the room read once", .code = "no_space"};
    auto [c, d] = two(once, "c", "d");
    step(c.has_value() && d.has_value(), 9);
    step(free_bytes() < keep - 10 * kMiB, 10);
  });
  CHECK(failed == 0);  // else the step that failed
}
