#pragma once
// A directory of the test's own under /tmp, removed with everything in it at the end of scope.
#include <stdlib.h>

#include <filesystem>
#include <string>

namespace sbx::test {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name) {
    std::string tmpl = "/tmp/sbx-" + name + "-XXXXXX";
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace sbx::test
