#include "supervisor/libwebsockets.hpp"

#include "os/library.hpp"

namespace sbx::supervisor {

namespace {

base::Result<const LibWebsockets*> load() {
  // The libuv plugin libwebsockets then loads names it by soname: the loader gives the plugin this
  // copy (and libuv, the supervisor's own), local or not.
  auto l = os::Library::open("libwebsockets", SBX_LWS_SONAME, "no_libwebsockets");
  if (!l) return l.error();
  static LibWebsockets lib;
#define SBX_LWS_LOAD(name) \
  if (auto r = l->get(lib.name, #name); !r) return r.error();
  SBX_LWS_FUNCTIONS(SBX_LWS_LOAD)
#undef SBX_LWS_LOAD
  return &lib;
}

}  // namespace

const base::Result<const LibWebsockets*>& libwebsockets() {
  static const base::Result<const LibWebsockets*> lib = load();  // once, under the static's guard
  return lib;
}

}  // namespace sbx::supervisor
