#pragma once
// Files with holes for the tests of what keeps them (os::copy_tree, the archive): written and read
// at offsets, and the bytes a tree takes on its filesystem.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <set>
#include <string>

#include "os/unique-fd.hpp"

namespace sbx::test {

inline constexpr off_t kMiB = off_t(1) << 20;
inline constexpr off_t kGiB = off_t(1) << 30;

// `text` at `at` in the file `p` (made if missing, with its directories), leaving the rest as it
// is: a hole where nothing was written.
inline void put_at(const std::filesystem::path& p, off_t at, const std::string& text) {
  std::filesystem::create_directories(p.parent_path());
  os::UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
  REQUIRE(fd);
  REQUIRE(::pwrite(fd.get(), text.data(), text.size(), at) == static_cast<ssize_t>(text.size()));
}

inline std::string get_at(const std::filesystem::path& p, off_t at, size_t n) {
  os::UniqueFd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
  std::string s(n, '?');
  if (!fd || ::pread(fd.get(), s.data(), n, at) != static_cast<ssize_t>(n)) return "<unreadable>";
  return s;
}

inline struct stat lstat_of(const std::filesystem::path& p) {
  struct stat st {};
  REQUIRE(::lstat(p.c_str(), &st) == 0);
  return st;
}

// The bytes a tree takes on its filesystem: every inode's blocks, once.
inline uint64_t blocks_bytes(const std::filesystem::path& root) {
  uint64_t total = 0;
  std::set<ino_t> seen;
  for (auto& e : std::filesystem::recursive_directory_iterator(root)) {
    auto st = lstat_of(e.path());
    if (seen.insert(st.st_ino).second) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

}  // namespace sbx::test
