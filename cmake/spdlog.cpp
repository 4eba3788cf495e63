// spdlog and fmt compiled once, into the static library dep_spdlog (cmake/dependencies.cmake).
//
// Debian ships both as headers and shared libraries only, and the binaries link no shared C++
// library (SBX_STATIC_DEPS). Their header-only forms made every file that logs compile the whole
// of spdlog's logger, sinks and pattern formatter and fmt's formatting core again; their compiled
// forms (SPDLOG_COMPILED_LIB, no FMT_HEADER_ONLY) leave declarations in those files, and this one
// file holds the definitions, from the implementation headers Debian ships beside the others
// (`*-inl.h`). The explicit instantiations at the end are what the link of every program asks
// for: the templates whose definitions those headers leave to the library.
#ifndef SPDLOG_COMPILED_LIB
#error "cmake/spdlog.cpp is built with SPDLOG_COMPILED_LIB (dep_spdlog, cmake/dependencies.cmake)"
#endif
#ifdef FMT_HEADER_ONLY
#error "cmake/spdlog.cpp is built without FMT_HEADER_ONLY: it is fmt's compiled form"
#endif

#include <fmt/format-inl.h>

#include <spdlog/common-inl.h>
#include <spdlog/details/backtracer-inl.h>
#include <spdlog/details/console_globals.h>
#include <spdlog/details/log_msg-inl.h>
#include <spdlog/details/log_msg_buffer-inl.h>
#include <spdlog/details/os-inl.h>
#include <spdlog/details/periodic_worker-inl.h>
#include <spdlog/details/registry-inl.h>
#include <spdlog/logger-inl.h>
#include <spdlog/pattern_formatter-inl.h>
#include <spdlog/sinks/ansicolor_sink-inl.h>
#include <spdlog/sinks/sink-inl.h>
#include <spdlog/spdlog-inl.h>

// Declared `extern template` by fmt/format.h when fmt is not header-only.
FMT_BEGIN_NAMESPACE
namespace detail {
template FMT_API auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template FMT_API auto decimal_point_impl(locale_ref) -> char;
}  // namespace detail
FMT_END_NAMESPACE

// The sink supervisor/main.cpp makes: its members are defined in ansicolor_sink-inl.h alone.
template class spdlog::sinks::ansicolor_stderr_sink<spdlog::details::console_mutex>;
