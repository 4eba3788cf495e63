#include "os/library.hpp"

namespace sbx::os {

base::Result<Library> Library::open(std::string what, const char* soname, std::string code) {
  Library l;
  l.what_ = std::move(what);
  l.soname_ = soname;
  l.code_ = std::move(code);
  l.handle_ = ::dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  if (!l.handle_) {
    const char* why = ::dlerror();
    return base::fail(l.prefix() + (why ? why : "dlopen failed"), l.code_);
  }
  return l;
}

}  // namespace sbx::os
