// supervisor/stats.cpp's disk_used: a branch's disk as `stats` and `metrics` report it, walked
// where the agent writes.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "supervisor/stats.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
using sbx::test::TempDir;

namespace {

void put(const fs::path& p, size_t bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << std::string(bytes, 'x');
}

}  // namespace

TEST_CASE("disk_used: a symlink is counted as itself, never followed") {
  TempDir d("disk-used");
  put(d.path / "big/f", 1 << 20);
  put(d.path / "ws/small", 10);
  fs::create_directory_symlink(d.path / "big", d.path / "ws/link");
  uint64_t ws = sbx::supervisor::disk_used((d.path / "ws").string());
  CHECK(ws > 0);
  CHECK(ws < (64u << 10));
  CHECK(sbx::supervisor::disk_used((d.path / "big").string()) >= (1u << 20));
  // The dir itself a symlink: nothing.
  CHECK(sbx::supervisor::disk_used((d.path / "ws/link").string()) == 0);
}

TEST_CASE("disk_used: a directory swapped for a symlink while it is walked is not followed") {
  // The agent keeps exchanging a directory of its workspace with a symlink to a large host
  // directory. Walked by path (lstat, then opendir of the name) the walk sometimes went through
  // the link: 250 MB of the host's /usr counted for a 4 KB workspace.
  TempDir d("disk-used");
  auto host = d.path / "host", ws = d.path / "ws";
  for (int i = 0; i < 8; ++i) put(host / ("f" + std::to_string(i)), 1 << 20);
  for (int i = 0; i < 50; ++i) put(ws / "d" / ("f" + std::to_string(i)), 1);
  fs::create_directory_symlink(host, ws / "s");
  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    while (!stop) (void)::renameat2(AT_FDCWD, (ws / "d").c_str(), AT_FDCWD, (ws / "s").c_str(), RENAME_EXCHANGE);
  });
  uint64_t most = 0;
  for (int i = 0; i < 3000; ++i) most = std::max(most, sbx::supervisor::disk_used(ws.string()));
  stop = true;
  swapper.join();
  CHECK(most < (1u << 20));  // the host's 8 MiB never counted
}
