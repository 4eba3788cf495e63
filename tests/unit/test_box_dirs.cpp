// The record of the state dirs outside the default root (os/box-dirs.hpp), which `sandboxer ps
// --all` reads: what it lists, when it is compacted, what it refuses, and records made by many
// writers while others compact it.
#include <doctest/doctest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "os/box-dirs.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
using sbx::os::holds_box_json;
using sbx::os::record_box_dir;
using sbx::os::recorded_box_dirs;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// A state dir (a directory with a box.json) at `p`.
std::string state_dir(const fs::path& p) {
  fs::create_directories(p);
  std::ofstream(p / "box.json") << "{}\n";
  return p.string();
}

std::vector<std::string> listed(const fs::path& home) {
  auto r = recorded_box_dirs(home, holds_box_json);
  REQUIRE_MESSAGE(r.has_value(), r.error().message);
  return *r;
}

}  // namespace

TEST_CASE("box dirs: each recorded once, in order; repeats and gone dirs rewritten away") {
  sbx::test::TempDir d("box-dirs");
  fs::path home = d.path / "home";
  CHECK(listed(home).empty());  // no state home yet: nothing, and nothing made
  CHECK_FALSE(fs::exists(home));
  auto a = state_dir(d.path / "a"), b = state_dir(d.path / "b with \"quotes\"\nand a newline");
  auto c = state_dir(d.path / "c");
  for (auto& dir : {a, b, a, c}) REQUIRE(record_box_dir(home, dir).has_value());
  struct stat st {};
  REQUIRE(::stat((home / "box-dirs").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK((fs::status(home).permissions() & fs::perms::all) == fs::perms::owner_all);
  CHECK(listed(home) == std::vector<std::string>{a, b, c});
  // The repeat is gone from the file: a compaction's first line, then each dir once.
  auto text = slurp(home / "box-dirs");
  CHECK(text.starts_with("{\"compacted\":"));
  CHECK(std::count(text.begin(), text.end(), '\n') == 4);
  fs::remove_all(b);
  CHECK(listed(home) == std::vector<std::string>{a, c});
  CHECK(slurp(home / "box-dirs").find("quotes") == std::string::npos);
  // A directory without box.json is no state dir; nor is a symlink to one.
  fs::remove(fs::path(c) / "box.json");
  fs::create_directory_symlink(a, d.path / "link");
  REQUIRE(record_box_dir(home, (d.path / "link").string()).has_value());
  CHECK(listed(home) == std::vector<std::string>{a});
}

TEST_CASE("box dirs: a line cut short (a full disk) is dropped, the rest kept") {
  sbx::test::TempDir d("box-dirs");
  fs::path home = d.path / "home";
  auto a = state_dir(d.path / "a"), b = state_dir(d.path / "b");
  REQUIRE(record_box_dir(home, a).has_value());
  std::ofstream(home / "box-dirs", std::ios::app) << "{\"dir\":\"/half";
  REQUIRE(record_box_dir(home, b).has_value());  // on a line of its own, not the cut one's end
  CHECK(listed(home) == std::vector<std::string>{a, b});
  for (auto bad : {"not json\n", "[1,2]\n", "{\"dir\":\"relative/path\"}\n", "{\"dir\":7}\n"})
    std::ofstream(home / "box-dirs", std::ios::app) << bad;
  CHECK(listed(home) == std::vector<std::string>{a, b});
  auto text = slurp(home / "box-dirs");
  CHECK(std::count(text.begin(), text.end(), '\n') == 3);
}

TEST_CASE("box dirs: compacted by the supervisor at twice its last length, not before") {
  sbx::test::TempDir d("box-dirs");
  fs::path home = d.path / "home";
  auto a = state_dir(d.path / "a");
  std::string gone = (d.path / "gone").string();
  // Below the threshold nothing is read back: the gone dir stays in the file.
  REQUIRE(record_box_dir(home, gone, 1 << 20).has_value());
  REQUIRE(record_box_dir(home, a, 1 << 20).has_value());
  CHECK(slurp(home / "box-dirs").find("gone") != std::string::npos);
  // Past it, the record is compacted: the gone dir is dropped, the length noted.
  REQUIRE(record_box_dir(home, a, 64).has_value());
  auto text = slurp(home / "box-dirs");
  CHECK(text.find("gone") == std::string::npos);
  CHECK(text.starts_with("{\"compacted\":"));
  // Not again until it has doubled: one more record of `gone` stays (the file is not yet twice
  // as long); records of `a` then make it twice as long, and that one compacts it again.
  REQUIRE(record_box_dir(home, gone, 64).has_value());
  CHECK(slurp(home / "box-dirs").find("gone") != std::string::npos);
  int appended = 0;
  for (auto size = fs::file_size(home / "box-dirs"); appended < 10 && fs::file_size(home / "box-dirs") >= size;
       ++appended) {
    size = fs::file_size(home / "box-dirs");
    REQUIRE(record_box_dir(home, a, 64).has_value());
  }
  CHECK(appended < 10);  // it shrank: compacted again
  CHECK(slurp(home / "box-dirs").find("gone") == std::string::npos);
}

TEST_CASE("box dirs: anything but this user's own regular file at the record's place is refused") {
  sbx::test::TempDir d("box-dirs");
  fs::path home = d.path / "home";
  auto a = state_dir(d.path / "a");
  REQUIRE(record_box_dir(home, a).has_value());
  fs::path rec = home / "box-dirs";
  // A symlink: not followed (its target keeps its text), neither to write nor to read.
  fs::path target = d.path / "target";
  std::ofstream(target) << "untouched\n";
  fs::remove(rec);
  fs::create_symlink(target, rec);
  auto r = record_box_dir(home, a);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().message == rec.string() + " is a symlink: not a record this user's boxes keep");
  CHECK_FALSE(recorded_box_dirs(home, holds_box_json).has_value());
  CHECK(slurp(target) == "untouched\n");
  // A file others may write.
  fs::remove(rec);
  std::ofstream(rec) << "{\"dir\":\"" << a << "\"}\n";
  REQUIRE(::chmod(rec.c_str(), 0666) == 0);
  r = record_box_dir(home, a);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().message == rec.string() +
                                 " is a file others may write, or not this user's: not a record this "
                                 "user's boxes keep");
  // A FIFO: refused at once, not waited on.
  fs::remove(rec);
  REQUIRE(::mkfifo(rec.c_str(), 0600) == 0);
  r = record_box_dir(home, a);
  REQUIRE_FALSE(r.has_value());
  CHECK(r.error().message == rec.string() + " is a FIFO: not a record this user's boxes keep");
  // A state home others may enter is narrowed to this user's, as every use of it is.
  fs::remove(rec);
  fs::permissions(home, fs::perms::all);
  REQUIRE(record_box_dir(home, a).has_value());
  CHECK((fs::status(home).permissions() & fs::perms::all) == fs::perms::owner_all);
}

TEST_CASE("box dirs: on a full disk the list is the same, the record as it was; a compaction says why not") {
  sbx::test::TempDir d("box-dirs");
  auto a = state_dir(d.path / "a"), b = state_dir(d.path / "b");
  // In a child with a mount namespace of its own, the state home a tmpfs with room for its root
  // and the record only: no inode for the temporary a rewrite needs.
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    fs::path home = d.path / "home";
    auto fail = [](int code) { ::_exit(code); };
    if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) fail(2);
    if (::mkdir(home.c_str(), 0700) != 0 || ::mount("tmpfs", home.c_str(), "tmpfs", 0, "nr_inodes=2,mode=0700") != 0)
      fail(3);
    for (auto& dir : {a, b, a})
      if (!record_box_dir(home, dir)) fail(4);
    auto before = slurp(home / "box-dirs");
    auto got = recorded_box_dirs(home, holds_box_json);
    if (!got || *got != std::vector<std::string>{a, b}) fail(5);
    if (slurp(home / "box-dirs") != before) fail(6);
    auto r = record_box_dir(home, b, 1);  // past the mark: the compaction cannot be written
    if (r || r.error().message != "rewrite " + (home / "box-dirs").string() + ": No space left on device") fail(7);
    if (slurp(home / "box-dirs") != before + "{\"dir\":\"" + b + "\"}\n") fail(8);  // the record itself is kept
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);  // else the step that failed
}

TEST_CASE("box dirs: records from many writers while others compact are all kept") {
  sbx::test::TempDir d("box-dirs");
  fs::path home = d.path / "home";
  constexpr int kWriters = 4, kEach = 150;
  std::vector<std::string> dirs;
  for (int i = 0; i < kWriters * kEach; ++i) dirs.push_back(state_dir(d.path / ("s" + std::to_string(i))));
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWriters; ++w)
    threads.emplace_back([&, w] {
      for (int i = 0; i < kEach; ++i)  // a low mark: the writers compact it over and over
        if (auto r = record_box_dir(home, dirs[w * kEach + i], 2048); !r) {
          ++failures;
          MESSAGE(r.error().message);
        }
    });
  std::thread reader([&] {
    while (!done)
      if (auto r = recorded_box_dirs(home, holds_box_json); !r) {
        ++failures;
        MESSAGE(r.error().message);
      }
  });
  for (auto& t : threads) t.join();
  done = true;
  reader.join();
  CHECK(failures == 0);
  auto got = listed(home);
  std::sort(got.begin(), got.end());
  std::sort(dirs.begin(), dirs.end());
  CHECK(got == dirs);
}
