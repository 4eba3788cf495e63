#pragma once
// The one scratch directory of a fuzz target's process (/tmp/sbx-fuzz-NAME-XXXXXX), made at the
// first input, reused by every later one, and removed at the process's exit (libFuzzer's end
// calls exit(); a crash leaves it for a look).
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

struct ScratchDir {
  std::string path;
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

inline const std::string& scratch_dir(const char* name) {
  static const ScratchDir root{[name] {
    std::string tmpl = std::string("/tmp/sbx-fuzz-") + name + "-XXXXXX";
    return std::string(::mkdtemp(tmpl.data()));
  }()};
  return root.path;
}
