#pragma once
// A shared library loaded by its soname when first needed (libarchive, libwebsockets, OpenSSL),
// and its functions taken by name: one way to load each, and one wording for what failed.
#include <dlfcn.h>

#include <string>

#include "base/result.hpp"

namespace sbx::os {

class Library {
 public:
  /// dlopen(soname, RTLD_NOW | RTLD_LOCAL), as the loader finds any library (the caller's run
  /// path first). The error reads "load WHAT (SONAME): <the loader's reason>", with `code`.
  /// `soname` is a C string on purpose: a string literal given here stays whole in the binary,
  /// where scripts/bundle finds it (a std::string made from a short literal at the call site is
  /// built from immediates, and the literal is gone from the stripped binary).
  static base::Result<Library> open(std::string what, const char* soname, std::string code);

  /// Sets `fn` to the library's function `name`; else "load WHAT (SONAME): it has no NAME".
  template <class F>
  base::Result<void> get(F*& fn, const char* name) const {
    fn = reinterpret_cast<F*>(::dlsym(handle_, name));
    if (!fn) return base::fail(prefix() + "it has no " + name, code_);
    return {};
  }

 private:
  Library() = default;
  std::string prefix() const { return "load " + what_ + " (" + soname_ + "): "; }
  void* handle_ = nullptr;  // never closed: the functions stay in use until the process ends
  std::string what_, soname_, code_;
};

}  // namespace sbx::os
