#include "archive/libarchive.hpp"

#include <dlfcn.h>

#include <string>

namespace sbx::archive {

namespace {

base::Result<const LibArchive*> load() {
  void* h = ::dlopen(SBX_LIBARCHIVE_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = ::dlerror();
    return base::fail(std::string("load libarchive (" SBX_LIBARCHIVE_SONAME "): ") + (why ? why : "dlopen failed"),
                      "no_libarchive");
  }
  static LibArchive lib;
#define SBX_LIBARCHIVE_LOAD(name)                                    \
  lib.name = reinterpret_cast<decltype(&::name)>(::dlsym(h, #name)); \
  if (!lib.name) return base::fail("load libarchive (" SBX_LIBARCHIVE_SONAME "): it has no " #name, "no_libarchive");
  SBX_LIBARCHIVE_FUNCTIONS(SBX_LIBARCHIVE_LOAD)
#undef SBX_LIBARCHIVE_LOAD
  return &lib;
}

}  // namespace

const base::Result<const LibArchive*>& libarchive() {
  static const base::Result<const LibArchive*> lib = load();  // once, under the static's guard
  return lib;
}

}  // namespace sbx::archive
