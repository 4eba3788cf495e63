#include "archive/libarchive.hpp"

#include "os/library.hpp"

namespace sbx::archive {

namespace {

base::Result<const LibArchive*> load() {
  auto l = os::Library::open("libarchive", SBX_LIBARCHIVE_SONAME, "no_libarchive");
  if (!l) return l.error();
  static LibArchive lib;
#define SBX_LIBARCHIVE_LOAD(name) \
  if (auto r = l->get(lib.name, #name); !r) return r.error();
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
