#pragma once
// The one scratch directory of a fuzz target's process (/tmp/sbx-fuzz-NAME-XXXXXX), made at the
// first input and reused by every later one.
#include <stdlib.h>

#include <string>

inline const std::string& scratch_dir(const char* name) {
  static const std::string root = [name] {
    std::string tmpl = std::string("/tmp/sbx-fuzz-") + name + "-XXXXXX";
    return std::string(::mkdtemp(tmpl.data()));
  }();
  return root;
}
