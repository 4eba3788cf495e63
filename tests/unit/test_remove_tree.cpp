// os::remove_tree_at, which `sandboxer down --rm` removes a box's state dir with (its branches
// hold what the agent wrote): every entry reached from its parent's fd, no symlink followed, no
// mount entered, even while the tree changes under it.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "mount-ns.hpp"
#include "os/files.hpp"
#include "os/unique-fd.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
using sbx::os::remove_tree_at;

namespace {

void put(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

sbx::os::UniqueFd open_dir(const fs::path& p) {
  return sbx::os::UniqueFd(::open(p.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
}

// A directory outside the tree, with a file the tree's symlinks point at.
fs::path victim_in(const fs::path& base) {
  put(base / "victim/keep", "host file");
  return base / "victim";
}

}  // namespace

TEST_CASE("remove_tree_at: a tree goes whole; its symlinks go as themselves, what they name stays") {
  sbx::test::TempDir d("remove-tree");
  auto victim = victim_in(d.path);
  put(d.path / "state/tree/a/b/c/file", "x");
  put(d.path / "state/tree/top", "y");
  fs::create_directory_symlink(victim, d.path / "state/tree/a/to-dir");
  fs::create_symlink(victim / "keep", d.path / "state/tree/a/b/to-file");
  REQUIRE(::mkfifo((d.path / "state/tree/a/fifo").c_str(), 0600) == 0);
  fs::permissions(d.path / "state/tree/a/b", fs::perms(0500));  // root removes in it all the same
  put(d.path / "state/other", "stays");
  auto at = open_dir(d.path / "state");
  REQUIRE(at);
  auto r = remove_tree_at(at.get(), "tree", "state/tree");
  REQUIRE_MESSAGE(r.has_value(), r.error().message);
  CHECK_FALSE(fs::exists(fs::symlink_status(d.path / "state/tree")));
  CHECK(fs::exists(d.path / "state/other"));
  CHECK(fs::exists(victim / "keep"));
  // A symlink as the entry itself, and one already gone: no failure, nothing followed.
  fs::create_directory_symlink(victim, d.path / "state/link");
  REQUIRE(remove_tree_at(at.get(), "link", "state/link").has_value());
  CHECK(fs::exists(victim / "keep"));
  CHECK(remove_tree_at(at.get(), "gone", "state/gone").has_value());
  // Not an entry's name: refused.
  for (const char* bad : {"", ".", "..", "a/b"}) {
    auto e = remove_tree_at(at.get(), bad, "state/?");
    REQUIRE_FALSE(e.has_value());
    CHECK(e.error().message == "remove state/?: not an entry's name");
  }
}

TEST_CASE("remove_tree_at: a mount in the tree is not entered, and what is above it stays") {
  if (::geteuid() != 0) return;  // mounts need root (the CI runs as root)
  sbx::test::TempDir d("remove-tree");
  put(d.path / "state/tree/sub/file", "x");
  fs::create_directories(d.path / "state/tree/sub/tmpfs");
  put(d.path / "elsewhere/keep", "bound");
  int failed = sbx::test::in_own_mount_ns([&](auto step) {
    auto tree = d.path / "state/tree";
    step(::mount("tmpfs", (tree / "sub/tmpfs").c_str(), "tmpfs", 0, "size=1m") == 0, 3);
    std::ofstream(tree / "sub/tmpfs/inside") << "kept";
    auto at = open_dir(d.path / "state");
    auto r = remove_tree_at(at.get(), "tree", "state/tree");
    step(!r.has_value() &&
             r.error().message == "remove state/tree/sub/tmpfs: a filesystem is mounted there; not entered",
         4);
    step(fs::exists(tree / "sub/tmpfs/inside") && fs::exists(tree / "sub"), 5);
    step(::umount((tree / "sub/tmpfs").c_str()) == 0, 6);
    // A bind mount of the same filesystem (the same st_dev): a mount all the same. (The removal
    // above went on until the mount: the directory may be gone.)
    fs::create_directories(tree / "bind");
    step(::mount((d.path / "elsewhere").c_str(), (tree / "bind").c_str(), nullptr, MS_BIND, nullptr) == 0, 7);
    r = remove_tree_at(at.get(), "tree", "state/tree");
    step(!r.has_value() && r.error().message == "remove state/tree/bind: a filesystem is mounted there; not entered",
         8);
    step(fs::exists(d.path / "elsewhere/keep"), 9);
    step(::umount((tree / "bind").c_str()) == 0, 10);
    step(remove_tree_at(at.get(), "tree", "state/tree").has_value() && !fs::exists(tree), 11);
  });
  CHECK(failed == 0);  // else the step that failed
  CHECK(fs::exists(d.path / "elsewhere/keep"));
}

TEST_CASE("remove_tree_at: a directory swapped for a symlink while the tree is removed is not followed") {
  // Another process (an agent that outlived its box) swaps a directory of the tree with a symlink
  // to a directory outside whose files have the names of the tree's, again and again, while the
  // tree is removed: whatever the timing, the files outside stay. A remover that removes by path
  // (nftw's callback) removes them where the swap falls between its listing and its unlink.
  sbx::test::TempDir d("remove-tree");
  auto victim = victim_in(d.path);
  for (int i = 0; i < 20; ++i) put(victim / ("f" + std::to_string(i)), "host file");  // the names in the tree's
  std::atomic<bool> stop{false};
  for (int round = 0; round < 400; ++round) {
    auto tree = d.path / "state/tree";
    for (int i = 0; i < 20; ++i) put(tree / "d" / ("f" + std::to_string(i)), "x");
    fs::create_directory_symlink(victim, tree / "s");
    stop = false;
    std::thread swapper([&] {
      while (!stop) (void)::renameat2(AT_FDCWD, (tree / "d").c_str(), AT_FDCWD, (tree / "s").c_str(), RENAME_EXCHANGE);
    });
    auto at = open_dir(d.path / "state");
    (void)remove_tree_at(at.get(), "tree", "state/tree");  // may fail: an entry moved under it
    stop = true;
    swapper.join();
    for (int i = 0; i < 20; ++i) REQUIRE(fs::exists(victim / ("f" + std::to_string(i))));
    REQUIRE(fs::exists(victim / "keep"));
    fs::remove_all(tree);
  }
}
