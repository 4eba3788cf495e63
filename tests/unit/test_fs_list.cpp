// fs.list's pages (supervisor::ListWindows): every name once, in byte order, whatever the
// directory's size against a window; the window spares the next pages a read of the directory
// while it is unchanged, and is read again once it changed; windows go when their listing ends,
// when newer ones need the room, or unused for a while.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <string>
#include <vector>

#include "mount-ns.hpp"
#include "supervisor/fs-ops.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
using sbx::supervisor::FsRoots;
using sbx::supervisor::ListPage;
using sbx::supervisor::ListWindows;

namespace {

void touch(const fs::path& p) {
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  ::close(fd);
}

std::string name_of(const ListPage& page, size_t i) {
  return std::string(page.entries.at(i).as_object().at("name").as_string());
}

// Every page of /workspace/d, `limit` a request, through `w` (or, without, each page through
// windows of its own: each reads the directory); `between` runs after each page but the last, given its number.
template <typename Between>
std::vector<std::string> list_all(const FsRoots& roots, size_t limit, ListWindows* w, Between between,
                                  size_t* pages = nullptr) {
  std::vector<std::string> got;
  std::string after;
  for (size_t n = 1;; ++n) {
    ListWindows fresh;
    auto page = (w ? *w : fresh).page(roots, "/workspace/d", limit, after, n);
    for (size_t i = 0; i < page.entries.size(); ++i) got.push_back(name_of(page, i));
    if (pages) *pages = n;
    if (!page.more) return got;
    REQUIRE(!page.entries.empty());
    after = got.back();
    between(n);
    REQUIRE(n < 100000);
  }
}

std::vector<std::string> list_all(const FsRoots& roots, size_t limit, ListWindows* w, size_t* pages = nullptr) {
  return list_all(
      roots, limit, w, [](size_t) {}, pages);
}

std::vector<std::string> make_names(const fs::path& d, size_t count, size_t width) {
  fs::create_directories(d);
  std::vector<std::string> names;
  for (size_t i = 0; i < count; ++i) {
    auto n = std::to_string(i * 7919 % count);
    n.insert(0, width - n.size(), 'n');
    touch(d / n);
    names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

FsRoots roots_of(const sbx::test::TempDir& t) { return {.workspace = t.path.string(), .tmp = t.path.string()}; }

// Windows that trust a directory's times however lately it changed: the tests' directories are
// made just before they are listed (the temp dir's filesystem has fine-grained timestamps).
ListWindows trusting(size_t bytes = ListWindows::kBytes) { return ListWindows(bytes, 0, 0); }

}  // namespace

TEST_CASE("the pages of an unchanged directory come from one read of it") {
  sbx::test::TempDir t("fs-list");
  auto names = make_names(t.path / "d", 5000, 8);
  auto roots = roots_of(t);
  ListWindows w = trusting();
  size_t pages = 0;
  CHECK(list_all(roots, 100, &w, &pages) == names);
  CHECK(pages == 50);
  CHECK(w.reads() == 1);
  // The listing ended: its window is given up, and the next listing reads the directory anew.
  CHECK(w.size() == 0);
  CHECK(list_all(roots, 1000, &w) == names);
  CHECK(w.reads() == 2);
  // Without the window kept, each page reads the directory: the same pages.
  CHECK(list_all(roots, 100, nullptr) == names);
}

TEST_CASE("a directory of fine timestamps still for a moment serves its pages from one read") {
  // Its times have fractions: changed 0.3 s before the read, it is trusted (kFineTimesStillNs).
  // The control: the window of a filesystem of seconds (kTimesStillNs) reads it for each page.
  sbx::test::TempDir t("fs-list-fine");
  auto names = make_names(t.path / "d", 2000, 8);
  struct stat st {};
  REQUIRE(::stat((t.path / "d").c_str(), &st) == 0);
  if (st.st_ctim.tv_nsec == 0) return;  // a temp dir of whole seconds
  ::usleep(300'000);
  auto roots = roots_of(t);
  ListWindows coarse(ListWindows::kBytes, sbx::os::kTimesStillNs, sbx::os::kTimesStillNs);
  CHECK(list_all(roots, 100, &coarse) == names);
  // (A machine that stalled past the 2 s since the change leaves the control nothing to show.)
  int64_t changed = std::max(sbx::os::ns_of(st.st_mtim), sbx::os::ns_of(st.st_ctim));
  if (sbx::os::realtime_ns() - changed < sbx::os::kTimesStillNs) CHECK(coarse.reads() == 20);
  ListWindows w;
  size_t pages = 0;
  CHECK(list_all(roots, 100, &w, &pages) == names);
  CHECK(pages == 20);
  CHECK(w.reads() == 1);
}

TEST_CASE("a directory larger than the window is read again as the pages pass it") {
  sbx::test::TempDir t("fs-list");
  auto names = make_names(t.path / "d", 3000, 60);
  auto roots = roots_of(t);
  ListWindows w = trusting(64 << 10);  // ~700 names of 60 bytes
  size_t pages = 0;
  CHECK(list_all(roots, 250, &w, &pages) == names);
  CHECK(pages == 12);
  CHECK(w.reads() >= 4);
  CHECK(w.reads() <= 6);
  // Pages larger than the window: each gives what the window holds, and says more follow.
  ListWindows small = trusting(16 << 10);
  CHECK(list_all(roots, 1000, &small, &pages) == names);
  CHECK(pages > 3);
}

TEST_CASE("a directory changed between pages is read again: made and removed names are seen") {
  sbx::test::TempDir t("fs-list");
  auto names = make_names(t.path / "d", 1000, 6);
  auto roots = roots_of(t);
  ListWindows w = trusting();
  auto got = list_all(roots, 100, &w, [&](size_t page) {
    if (page == 2) {
      touch(t.path / "d" / "zzz-made-after");
      fs::remove(t.path / "d" / names.back());
    }
  });
  auto want = names;
  want.pop_back();
  want.push_back("zzz-made-after");
  CHECK(got == want);
  CHECK(w.reads() == 2);
}

TEST_CASE("a window serves only the listing it was read for") {
  sbx::test::TempDir t("fs-list");
  auto names = make_names(t.path / "d", 300, 6);
  make_names(t.path / "e", 300, 7);
  auto roots = roots_of(t);
  ListWindows w = trusting();
  auto first = w.page(roots, "/workspace/d", 100, "", 0);
  REQUIRE(first.more);
  auto after = name_of(first, 99);
  // Another directory asked past the same name: read for itself.
  auto other = w.page(roots, "/workspace/e", 100, after, 0);
  CHECK(name_of(other, 0).size() == 7);
  CHECK(w.reads() == 2);
  // A page asked past another name than the last given: read again, from there.
  auto again = w.page(roots, "/workspace/d", 10, names[5], 0);
  CHECK(name_of(again, 0) == names[6]);
  CHECK(w.reads() == 3);
  // The first listing goes on from its own window.
  auto next = w.page(roots, "/workspace/d", 100, after, 0);
  CHECK(name_of(next, 0) == names[100]);
  CHECK(w.reads() == 3);
}

TEST_CASE("windows are bounded in number and go when unused") {
  sbx::test::TempDir t("fs-list");
  auto names = make_names(t.path / "d", 50, 3);
  auto roots = roots_of(t);
  ListWindows w = trusting();
  // Listings left after their first page (clients gone): at most kWindows kept, the oldest given
  // up. The listing i asks past names[3i] and was given names[3i + 1].
  constexpr size_t n = ListWindows::kWindows + 2;
  for (size_t i = 0; i < n; ++i) w.page(roots, "/workspace/d", 1, names[3 * i], i);
  CHECK(w.size() == ListWindows::kWindows);
  CHECK(w.reads() == n);
  w.page(roots, "/workspace/d", 1, names[1], 100);  // the first listing's window was given up: read
  CHECK(w.reads() == n + 1);
  w.page(roots, "/workspace/d", 1, names[3 * (n - 1) + 1], 200);  // the last one's is kept
  CHECK(w.reads() == n + 1);
  w.expire(100 + ListWindows::kIdleMs - 1);
  CHECK(w.size() == 2);  // the two used at 100 and 200
  w.expire(200 + ListWindows::kIdleMs);
  CHECK(w.size() == 0);
}

namespace {

// A listing in pages of 100 of /workspace/<d> (300 names made now, in the same second as the read
// of its first page), through `w`, with a name sorting last made after that first page: whether the
// listing gave it; none when the name was not made within the second of the directory's last
// change before (to be tried again: it then moved the directory's mtime), -1 on a failed call.
int made_after_the_first_page_is_listed(const FsRoots& roots, const std::string& d, ListWindows& w) {
  auto dir = fs::path(roots.workspace) / d;
  timespec now{};
  for (::clock_gettime(CLOCK_REALTIME, &now); now.tv_nsec > 300'000'000; ::clock_gettime(CLOCK_REALTIME, &now))
    ::usleep(5000);
  std::error_code ec;
  fs::create_directory(dir, ec);
  for (int i = 0; i < 300 && !ec; ++i) {
    int fd = ::open((dir / ("n" + std::to_string(1000 + i))).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    ::close(fd);
  }
  struct stat before {};
  if (ec || ::stat(dir.c_str(), &before) != 0 || before.st_mtim.tv_nsec != 0) return -1;  // seconds only
  bool listed = false;
  std::string after;
  for (int page_no = 0;; ++page_no) {
    auto page = w.page(roots, "/workspace/" + d, 100, after, 0);
    for (auto& e : page.entries) listed = listed || e.as_object().at("name").as_string() == "zzz-made-after";
    if (!page.more) break;
    after = page.entries.back().as_object().at("name").as_string();
    if (page_no > 0) continue;
    int fd = ::open((dir / "zzz-made-after").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    struct stat st {};
    if (fd < 0 || ::stat(dir.c_str(), &st) != 0) return -1;
    ::close(fd);
    if (st.st_mtim.tv_sec != before.st_mtim.tv_sec) return 2;
  }
  return listed ? 1 : 0;
}

}  // namespace

TEST_CASE("a name made in the tick of a page's read is listed on a filesystem of coarse timestamps") {
  // An ext4 of 128-byte inodes keeps its timestamps in seconds: a name made after a page's read in
  // the same second leaves the directory's mtime and ctime as they were. The control, on the same
  // filesystem: windows trusting those times miss the name.
  if (::geteuid() != 0 || ::access("/dev/loop-control", F_OK) != 0 ||
      std::system("command -v mkfs.ext4 >/dev/null") != 0)
    return;  // loop mounts need root and loop devices (the CI has both)
  sbx::test::TempDir t("fs-list-coarse");
  fs::create_directories(t.path / "fs");
  auto img = t.path / "ext4.img";
  REQUIRE(std::system(("mkfs.ext4 -q -F -I 128 -O ^has_journal " + img.string() + " 8M 2>/dev/null").c_str()) == 0);
  int failed = sbx::test::in_own_mount_ns([&](auto step) {
    step(std::system(("mount -o loop " + img.string() + " " + (t.path / "fs").string()).c_str()) == 0, 3);
    FsRoots roots{.workspace = (t.path / "fs").string(), .tmp = (t.path / "fs").string()};
    int got = 2, control = 2;
    for (int i = 0; i < 5 && got == 2; ++i) {
      ListWindows w;
      got = made_after_the_first_page_is_listed(roots, "d" + std::to_string(i), w);
    }
    step(got == 1, 4);
    for (int i = 0; i < 5 && control == 2; ++i) {
      ListWindows w(ListWindows::kBytes, 0);
      control = made_after_the_first_page_is_listed(roots, "c" + std::to_string(i), w);
    }
    step(control == 0, 5);
  });
  CHECK(failed == 0);  // else the step that failed
}

TEST_CASE("a whole listing holds at most its bound: a larger directory is to be asked for in pages") {
  sbx::test::TempDir t("fs-list");
  make_names(t.path / "d", 101, 4);
  auto roots = roots_of(t);
  CHECK(sbx::supervisor::fs_list(roots, "/workspace/d", 101).size() == 101);
  try {
    sbx::supervisor::fs_list(roots, "/workspace/d", 100);
    FAIL("a listing past its bound");
  } catch (const sbx::protocol::RequestError& e) {
    CHECK(e.code == "limit");
    CHECK(std::string(e.what()) ==
          "/workspace/d: holds more than 100 entries: ask for it in pages (fs.list with limit, then after the last "
          "name)");
  }
}
