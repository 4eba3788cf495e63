// os::sync_tree, which brings a copy made while its source ran (a checkpoint's copy of a layer
// before the agent stops) to what the source holds once stopped: the result is what a new
// copy_tree would make, whatever changed between (written, renamed, linked, removed, retyped), and
// what did not change is kept, not copied again.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "mount-ns.hpp"
#include "os/files.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
namespace os = sbx::os;

namespace {

void put(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// put, where the path can be had (a step may have made a directory on the way a file).
void try_put(const fs::path& p, const std::string& text) {
  std::error_code ec;
  fs::create_directories(p.parent_path(), ec);
  if (!ec && fs::is_directory(p.parent_path())) std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Every entry below `root`: its type, mode, owner, size, data or target, and (for a file of
// several names) the first of its names in the tree: two trees describe the same when they hold
// the same, names of one inode included.
std::map<std::string, std::string> describe(const fs::path& root) {
  std::map<std::string, std::string> out;
  std::map<ino_t, std::string> first_name;
  std::vector<fs::path> paths;
  for (auto& e : fs::recursive_directory_iterator(root)) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  for (auto& p : paths) {
    struct stat st {};
    REQUIRE(::lstat(p.c_str(), &st) == 0);
    std::string rel = fs::relative(p, root).string();
    std::string d = std::to_string(st.st_mode) + " " + std::to_string(st.st_uid) + ":" + std::to_string(st.st_gid);
    if (S_ISREG(st.st_mode)) {
      d += " " + std::to_string(st.st_size) + " " + read(p);
      if (st.st_nlink > 1) d += " first " + first_name.emplace(st.st_ino, rel).first->second;
    } else if (S_ISLNK(st.st_mode)) {
      d += " -> " + fs::read_symlink(p).string();
    }
    out[rel] = d;
  }
  return out;
}

// A copy's file marked (an xattr no copy makes): still marked after a sync, it was kept, not copied
// again (an inode number is no proof: a file removed and made again may get its number back).
void mark(const fs::path& p) { REQUIRE(::setxattr(p.c_str(), "user.sbx-kept", "1", 1, 0) == 0); }
bool marked(const fs::path& p) {
  char v[4];
  return ::getxattr(p.c_str(), "user.sbx-kept", v, sizeof v) == 1;
}

// A source tree: directories, files, names of one inode, a symlink, a sparse file.
void make_source(const fs::path& src) {
  for (int d = 0; d < 6; ++d)
    for (int i = 0; i < 8; ++i)
      put(src / ("d" + std::to_string(d)) / ("f" + std::to_string(i)), std::string(100 + i * 37, 'a' + d));
  fs::create_hard_link(src / "d0/f0", src / "d1/link-of-d0f0");
  fs::create_hard_link(src / "d0/f0", src / "d5/another-link");
  fs::create_symlink("../d0/f1", src / "d2/sym");
  put(src / "sparse", "x");
  REQUIRE(::truncate((src / "sparse").c_str(), 1 << 20) == 0);
  fs::create_directories(src / "empty-dir");
}

os::SyncPolicy trusting() {
  os::SyncPolicy p;
  p.still_ns = p.fine_still_ns = 0;  // the tests' sources are made just before they are copied
  return p;
}

}  // namespace

TEST_CASE("sync_tree: an unchanged source keeps every entry of its copy, and writes nothing") {
  sbx::test::TempDir t("sync");
  make_source(t.path / "src");
  os::CopyRecord rec;
  auto first = os::copy_tree((t.path / "src").string(), (t.path / "dst").string(), {}, &rec);
  REQUIRE(first.has_value());
  CHECK(rec.entries.size() == 6 * 8 + 2 + 1 + 1);  // the links' names, the symlink, the sparse file
  std::vector<fs::path> files;
  for (auto& e : fs::recursive_directory_iterator(t.path / "dst"))
    if (e.is_regular_file() && !e.is_symlink()) files.push_back(e.path());
  for (auto& f : files) mark(f);
  auto r = os::sync_tree((t.path / "src").string(), (t.path / "dst").string(), rec, trusting());
  REQUIRE(r.has_value());
  CHECK(*r == *first);
  CHECK(files.size() == 6 * 8 + 2 + 1);
  for (auto& f : files) CHECK(marked(f));
  CHECK(describe(t.path / "dst") == describe(t.path / "src"));
}

TEST_CASE("sync_tree: whatever changed between, the copy is what a new copy would be; the rest is kept") {
  for (unsigned seed = 1; seed <= 40; ++seed) {
    CAPTURE(seed);
    sbx::test::TempDir t("sync");
    auto src = t.path / "src", dst = t.path / "dst";
    make_source(src);
    os::CopyRecord rec;
    REQUIRE(os::copy_tree(src.string(), dst.string(), {}, &rec).has_value());
    mark(dst / "d4/f7");  // no step below touches d4
    std::mt19937 rng(seed);
    auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
    auto file = [&] { return src / ("d" + std::to_string(pick(4))) / ("f" + std::to_string(pick(8))); };
    for (int step = 0; step < 8; ++step) {
      if (step == 4 && seed % 2 == 0) {  // half the seeds synced between, recorded again
        os::CopyRecord next;
        REQUIRE(os::sync_tree(src.string(), dst.string(), rec, trusting(), {}, &next).has_value());
        rec = std::move(next);
      }
      auto f = file();
      std::error_code ec;
      switch (pick(12)) {
        case 0: {  // the same size, other bytes, and the old mtime again (as cp -p or tar leave it)
          struct stat st {};
          if (::stat(f.c_str(), &st) != 0) break;
          int fd = ::open(f.c_str(), O_WRONLY);
          if (fd < 0) break;
          REQUIRE(::pwrite(fd, "ZZ", 2, 3) == 2);
          timespec times[2] = {st.st_atim, st.st_mtim};
          REQUIRE(::futimens(fd, times) == 0);
          ::close(fd);
          break;
        }
        case 1:
          if (fs::exists(f)) try_put(f, read(f) + "more");
          break;
        case 2:
          fs::permissions(f, fs::perms::owner_read, ec);
          break;
        case 3:
          fs::rename(f, f.parent_path() / "renamed", ec);
          break;
        case 4:
          fs::remove(f, ec);
          break;
        case 5:
          try_put(src / ("d" + std::to_string(pick(4))) / ("new" + std::to_string(step)), "new");
          break;
        case 6:
          fs::create_hard_link(f, src / "d3" / ("hl" + std::to_string(step)), ec);
          break;
        case 7:
          fs::remove(f, ec);
          fs::create_directories(f / "now-a-dir", ec);
          try_put(f / "now-a-dir/x", "x");
          break;
        case 8:
          fs::remove_all(src / "d2", ec);
          try_put(src / "d2", "d2 is a file now");
          break;
        case 9:
          fs::remove(f, ec);
          fs::create_symlink("/etc/passwd", f, ec);
          break;
        case 10:
          fs::rename(src / "d1", src / ("d1-moved" + std::to_string(step)), ec);
          break;
        case 11:
          ::renameat2(AT_FDCWD, file().c_str(), AT_FDCWD, file().c_str(), RENAME_EXCHANGE);
          break;
      }
    }
    auto r = os::sync_tree(src.string(), dst.string(), rec, trusting());
    REQUIRE(r.has_value());
    auto fresh = t.path / "fresh";
    auto want = os::copy_tree(src.string(), fresh.string());
    REQUIRE(want.has_value());
    CHECK(describe(dst) == describe(fresh));
    CHECK(marked(dst / "d4/f7"));  // not copied again
  }
}

TEST_CASE("sync_tree with a next record: a sync from it keeps what the one before copied anew, and only that") {
  sbx::test::TempDir t("sync");
  auto src = t.path / "src", dst = t.path / "dst";
  make_source(src);
  os::CopyRecord rec;
  REQUIRE(os::copy_tree(src.string(), dst.string(), {}, &rec).has_value());
  CHECK(rec.renewed == rec.entries.size());
  put(src / "d0/f1", "changed while copied");
  put(src / "d1/new", "made while copied");
  mark(dst / "d4/f7");
  os::CopyRecord next;
  REQUIRE(os::sync_tree(src.string(), dst.string(), rec, trusting(), {}, &next).has_value());
  CHECK(next.renewed == 2);
  CHECK(next.entries.size() == rec.entries.size() + 1);
  CHECK(next.started_ns >= rec.started_ns);
  CHECK(marked(dst / "d4/f7"));
  CHECK(describe(dst) == describe(src));
  // Synced again from that record: the two copied anew are kept now; what changed since is not.
  for (auto p : {"d0/f1", "d1/new", "d2/f3"}) mark(dst / p);
  put(src / "d2/f3", "changed after");
  os::CopyRecord last;
  REQUIRE(os::sync_tree(src.string(), dst.string(), next, trusting(), {}, &last).has_value());
  CHECK(last.renewed == 1);
  CHECK(marked(dst / "d0/f1"));
  CHECK(marked(dst / "d1/new"));
  CHECK(marked(dst / "d4/f7"));
  CHECK(!marked(dst / "d2/f3"));
  CHECK(describe(dst) == describe(src));
  // The control: synced from the first record, the file changed during the copy is copied again.
  mark(dst / "d0/f1");
  REQUIRE(os::sync_tree(src.string(), dst.string(), rec, trusting()).has_value());
  CHECK(!marked(dst / "d0/f1"));
  CHECK(describe(dst) == describe(src));
}

TEST_CASE("sync_tree: a source changed close to the record's start is copied again; so are those it is told to") {
  sbx::test::TempDir t("sync");
  auto src = t.path / "src", dst = t.path / "dst";
  make_source(src);
  os::CopyRecord rec;
  REQUIRE(os::copy_tree(src.string(), dst.string(), {}, &rec).has_value());
  mark(dst / "d0/f1");
  // Everything here was made within the window before the copy, and could hide a change.
  os::SyncPolicy wary;
  wary.still_ns = wary.fine_still_ns = 60'000'000'000;
  REQUIRE(os::sync_tree(src.string(), dst.string(), rec, wary).has_value());
  CHECK(!marked(dst / "d0/f1"));
  CHECK(describe(dst) == describe(src));
  // Told to: this file, whatever its times.
  REQUIRE(os::copy_tree(src.string(), (t.path / "dst2").string(), {}, &rec).has_value());
  auto policy = trusting();
  struct stat st {};
  REQUIRE(::stat((src / "d0/f2").c_str(), &st) == 0);
  policy.always.insert({st.st_dev, st.st_ino});
  mark(t.path / "dst2/d0/f2");
  mark(t.path / "dst2/d0/f3");
  REQUIRE(os::sync_tree(src.string(), (t.path / "dst2").string(), rec, policy).has_value());
  CHECK(!marked(t.path / "dst2/d0/f2"));
  CHECK(marked(t.path / "dst2/d0/f3"));
}

namespace {

// Makes `dir`/f, waits 0.3 s, copies `dir` with a record, marks the copy's f and syncs it with
// the default policy: whether f was kept.
bool kept_after_300ms(const fs::path& dir) {
  put(dir / "src/f", "made 0.3 s before the copy");
  ::usleep(300'000);
  os::CopyRecord rec;
  if (!os::copy_tree((dir / "src").string(), (dir / "dst").string(), {}, &rec)) return false;
  mark(dir / "dst/f");
  if (!os::sync_tree((dir / "src").string(), (dir / "dst").string(), rec, {})) return false;
  return marked(dir / "dst/f");
}

}  // namespace

TEST_CASE("sync_tree: the window a change may hide in is 0.1 s where times have fractions of a second, else 2 s") {
  sbx::test::TempDir t("sync");
  struct stat st {};
  put(t.path / "probe", "x");
  REQUIRE(::stat((t.path / "probe").c_str(), &st) == 0);
  if (st.st_ctim.tv_nsec != 0) CHECK(kept_after_300ms(t.path / "fine"));
  // The control: an ext4 of 128-byte inodes keeps seconds; a file made 0.3 s before is copied again.
  if (::geteuid() != 0 || ::access("/dev/loop-control", F_OK) != 0 ||
      std::system("command -v mkfs.ext4 >/dev/null") != 0)
    return;  // loop mounts need root and loop devices (the CI has both)
  auto img = t.path / "ext4.img";
  fs::create_directories(t.path / "coarse");
  REQUIRE(std::system(("mkfs.ext4 -q -F -I 128 -O ^has_journal " + img.string() + " 8M 2>/dev/null").c_str()) == 0);
  int failed = sbx::test::in_own_mount_ns([&](auto step) {
    step(std::system(("mount -o loop " + img.string() + " " + (t.path / "coarse").string()).c_str()) == 0, 3);
    struct stat cst {};
    put(t.path / "coarse/probe", "x");
    step(::stat((t.path / "coarse/probe").c_str(), &cst) == 0 && cst.st_ctim.tv_nsec == 0, 4);
    step(!kept_after_300ms(t.path / "coarse"), 5);
  });
  CHECK(failed == 0);  // else the step that failed
}

TEST_CASE("sync_tree: a write through a mapped page written before moves no time; compare_data sees it") {
  // A page's first write through a shared mapping moves the file's times (the fault); later ones,
  // until the page is written back (on tmpfs: never), do not. The control: trusting the times
  // alone keeps the copy of before the write.
  if (::geteuid() != 0) return;  // mounts need root (the CI runs as root)
  sbx::test::TempDir t("sync-mmap");
  fs::create_directories(t.path / "fs");
  int failed = sbx::test::in_own_mount_ns([&](auto step) {
    step(::mount("tmpfs", (t.path / "fs").c_str(), "tmpfs", 0, "size=16m") == 0, 3);
    auto src = t.path / "fs/src";
    put(src / "mapped", std::string(8192, 'a'));
    int fd = ::open((src / "mapped").c_str(), O_RDWR);
    step(fd >= 0, 4);
    auto* m = static_cast<char*>(::mmap(nullptr, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    step(m != MAP_FAILED, 5);
    m[0] = 'b';  // both pages written (and dirty, writable) before the copy
    m[4096] = 'b';
    ::usleep(20000);
    os::CopyRecord rec;
    step(os::copy_tree(src.string(), (t.path / "dst").string(), {}, &rec).has_value(), 6);
    step(os::copy_tree(src.string(), (t.path / "dst2").string(), {}, &rec).has_value(), 7);
    m[4096] = 'c';  // after the copy's read, through the same mapping: no fault, no time moved
    struct stat now {};
    step(::stat((src / "mapped").c_str(), &now) == 0 &&
             static_cast<int64_t>(now.st_ctim.tv_sec) * 1'000'000'000 + now.st_ctim.tv_nsec ==
                 rec.find("dst2/mapped")->ctime_ns,
         8);  // the premise: the write moved no time
    auto times = trusting();
    os::CopyRecord rec1;
    step(os::copy_tree(src.string(), (t.path / "dst3").string(), {}, &rec1).has_value(), 9);
    m[100] = 'd';
    step(os::sync_tree(src.string(), (t.path / "dst3").string(), rec1, times).has_value(), 10);
    step(read(t.path / "dst3/mapped")[100] == 'a', 11);  // the control: stale
    auto compare = trusting();
    compare.compare_data = true;
    os::CopyRecord rec2;
    step(os::copy_tree(src.string(), (t.path / "dst4").string(), {}, &rec2).has_value(), 12);
    m[200] = 'e';
    step(os::sync_tree(src.string(), (t.path / "dst4").string(), rec2, compare).has_value(), 13);
    step(read(t.path / "dst4/mapped") == read(src / "mapped"), 14);
    ::munmap(m, 8192);
    ::close(fd);
  });
  CHECK(failed == 0);  // else the step that failed
}

TEST_CASE("copy_tree: a file truncated and written again as it is copied is copied as it was then, not failed") {
  // A copy made while the agent runs (a checkpoint's before the stop) reads files it may be
  // rewriting: shrunk between the copy's seek to its data and the seek to that data's end, the
  // second seek fails with ENXIO, which failed the checkpoint ("seek in ...: No such device or
  // address"). What is read is kept; the file's moved ctime has the sync copy it again.
  sbx::test::TempDir t("sync-trunc");
  put(t.path / "src/f", std::string(64 << 10, 'a'));
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::string big(64 << 10, 'b');
    while (!stop) {
      int fd = ::open((t.path / "src/f").c_str(), O_WRONLY | O_TRUNC);
      if (fd < 0) continue;
      (void)!::write(fd, big.data(), big.size());
      ::close(fd);
    }
  });
  int failed = 0;
  std::string why;
  for (int i = 0; i < 3000 && !failed; ++i) {
    auto dst = t.path / ("dst" + std::to_string(i % 2));
    fs::remove_all(dst);
    if (auto r = os::copy_tree((t.path / "src").string(), dst.string()); !r) {
      ++failed;
      why = r.error().message;
    }
  }
  stop = true;
  writer.join();
  CHECK_MESSAGE(failed == 0, why);
}

TEST_CASE("copy_tree and sync_tree: a copy called off stops, code cancelled") {
  // A box that shuts down while its layer is copied (its agent running) does not wait for it.
  sbx::test::TempDir t("sync-cancel");
  make_source(t.path / "src");
  std::atomic<bool> off{true};
  os::CopyBound bound;
  bound.cancel = &off;
  auto r = os::copy_tree((t.path / "src").string(), (t.path / "dst").string(), bound);
  REQUIRE(!r.has_value());
  CHECK(r.error().code == "cancelled");
  CHECK(r.error().message == "copy " + (t.path / "src").string() + ": called off");
  os::CopyRecord rec;
  REQUIRE(os::copy_tree((t.path / "src").string(), (t.path / "dst2").string(), {}, &rec).has_value());
  auto s = os::sync_tree((t.path / "src").string(), (t.path / "dst2").string(), rec, trusting(), bound);
  REQUIRE(!s.has_value());
  CHECK(s.error().code == "cancelled");
  off = false;  // the control: the same bound, not called off
  CHECK(os::copy_tree((t.path / "src").string(), (t.path / "dst3").string(), bound).has_value());
  CHECK(os::sync_tree((t.path / "src").string(), (t.path / "dst2").string(), rec, trusting(), bound).has_value());
}

TEST_CASE("sync_tree: a record bounded in entries copies again what it left out, and the copy is right") {
  sbx::test::TempDir t("sync-bound");
  auto src = t.path / "src", dst = t.path / "dst";
  make_source(src);
  os::CopyRecord rec;
  rec.max_entries = 10;
  REQUIRE(os::copy_tree(src.string(), dst.string(), {}, &rec).has_value());
  CHECK(rec.full);
  CHECK(rec.entries.size() == 10);
  CHECK(rec.max_entries == 10);  // kept through the copy's reset of the record
  put(src / "d0/f3", "changed");
  REQUIRE(os::sync_tree(src.string(), dst.string(), rec, trusting()).has_value());
  CHECK(describe(dst) == describe(src));
}
