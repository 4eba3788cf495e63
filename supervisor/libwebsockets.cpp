#include "supervisor/libwebsockets.hpp"

#include <dlfcn.h>

#include <string>

namespace sbx::supervisor {

namespace {

base::Result<const LibWebsockets*> load() {
  // The libuv plugin libwebsockets then loads names it by soname: the loader gives the plugin this
  // copy (and libuv, the supervisor's own), local or not.
  void* h = ::dlopen(SBX_LWS_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = ::dlerror();
    return base::fail(std::string("load libwebsockets (" SBX_LWS_SONAME "): ") + (why ? why : "dlopen failed"),
                      "no_libwebsockets");
  }
  static LibWebsockets lib;
#define SBX_LWS_LOAD(name)                                           \
  lib.name = reinterpret_cast<decltype(&::name)>(::dlsym(h, #name)); \
  if (!lib.name) return base::fail("load libwebsockets (" SBX_LWS_SONAME "): it has no " #name, "no_libwebsockets");
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
