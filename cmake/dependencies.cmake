# The libraries the layers link, found once for the main build and for the fuzz build (tests/fuzz).
#
# Linked from the static archives Debian ships where that is sound (SBX_STATIC_DEPS, on unless under
# the sanitizers): Boost, libseccomp, libzstd, libcap (sandbox/CMakeLists.txt), libstdc++ and
# libgcc; spdlog and fmt (which Debian ships as shared libraries only) compiled once from their
# headers (cmake/spdlog.cpp), so that no shared object left needs libstdc++. A process start pays
# the dynamic loader for every shared object (mapping, symbol lookup, relocated pages); from an
# archive the linker takes only the objects the binary calls (docs/architecture.md, "Start-up").
# Shared stay: libwebsockets (Debian's dlopens its libuv event plugin, which links the shared
# libwebsockets and libuv by soname: a static copy in the binary would run beside a second one;
# sandboxer-init loads it at --listen only) and what it needs (libuv, OpenSSL, zlib; it brings its
# own shared libcap), libidn2 (no archive of libunistring), glibc: all C. A fix to an archived
# library needs a rebuild of sandboxer, as of an image. OpenSSL's and libidn2's headers are used at
# build time; the binaries load libssl and libcrypto (os/openssl.hpp) and libidn2
# (egress/egress-policy.cpp) by soname at their first use. libm is not linked at all
# (-Wl,--as-needed in CMakeLists.txt).
option(SBX_STATIC_DEPS "Link Boost, libseccomp, libzstd, libcap and libstdc++ from their static archives" ON)
if(SBX_SANITIZE)
  set(SBX_STATIC_DEPS OFF)
endif()
if(SBX_STATIC_DEPS)
  set(Boost_USE_STATIC_LIBS ON)
endif()
find_package(Boost 1.81.0 EXACT REQUIRED CONFIG COMPONENTS json filesystem)
find_package(spdlog REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(LIBUV REQUIRED IMPORTED_TARGET libuv)
pkg_check_modules(LWS REQUIRED IMPORTED_TARGET libwebsockets)
pkg_check_modules(SECCOMP REQUIRED IMPORTED_TARGET libseccomp)
pkg_check_modules(LIBCAP REQUIRED IMPORTED_TARGET libcap)
pkg_check_modules(ZSTD REQUIRED IMPORTED_TARGET libzstd)
# The egress broker: TLS to upstreams (Boost.Beast over Asio + OpenSSL), IDNA for host names.
# Checkpoint archives are tar streams compressed with zstd (libarchive) and hashed with SHA-256.
find_package(OpenSSL REQUIRED)
find_package(Threads REQUIRED)
pkg_check_modules(IDN2 REQUIRED IMPORTED_TARGET libidn2)
pkg_check_modules(LIBARCHIVE REQUIRED IMPORTED_TARGET libarchive)

# PkgConfig::<target>'s shared libraries replaced by the archives beside them (lib<name>.a).
function(sbx_link_static target)
  get_target_property(libs ${target} INTERFACE_LINK_LIBRARIES)
  set(out)
  foreach(l IN LISTS libs)
    string(REGEX REPLACE "\\.so$" ".a" a "${l}")
    if(l MATCHES "\\.so$" AND EXISTS "${a}")
      list(APPEND out "${a}")
    else()
      list(APPEND out "${l}")
    endif()
  endforeach()
  set_target_properties(${target} PROPERTIES INTERFACE_LINK_LIBRARIES "${out}")
endfunction()

if(SBX_STATIC_DEPS)
  sbx_link_static(PkgConfig::SECCOMP)
  sbx_link_static(PkgConfig::ZSTD)
endif()

# dep_spdlog: what the layers link for logging. With SBX_STATIC_DEPS, spdlog and fmt compiled once
# from their headers into this static library (cmake/spdlog.cpp: Debian ships no archive of
# either), and libstdc++ from its archive in every program; otherwise Debian's shared libspdlog
# and libfmt.
if(SBX_STATIC_DEPS)
  add_library(dep_spdlog STATIC ${CMAKE_CURRENT_LIST_DIR}/spdlog.cpp)
  target_compile_definitions(dep_spdlog PUBLIC SPDLOG_COMPILED_LIB SPDLOG_FMT_EXTERNAL)
  target_include_directories(dep_spdlog SYSTEM
                             PUBLIC $<TARGET_PROPERTY:spdlog::spdlog_header_only,INTERFACE_INCLUDE_DIRECTORIES>
                                    $<TARGET_PROPERTY:fmt::fmt,INTERFACE_INCLUDE_DIRECTORIES>)
  target_link_libraries(dep_spdlog PUBLIC Threads::Threads)
  add_link_options(-static-libstdc++ -static-libgcc)
else()
  add_library(dep_spdlog INTERFACE)
  target_link_libraries(dep_spdlog INTERFACE spdlog::spdlog)
endif()

# sbx_soname(OUT LIB): the soname of the shared library file LIB (objdump -p), for code that loads
# it with dlopen by that name (archive/libarchive.hpp, supervisor/libwebsockets.hpp). Fatal when
# it has none.
function(sbx_soname out lib)
  execute_process(COMMAND ${CMAKE_OBJDUMP} -p ${lib} OUTPUT_VARIABLE dyn RESULT_VARIABLE rc)
  string(REGEX MATCH "SONAME +([^\n ]+)" match "${dyn}")
  if(NOT rc EQUAL 0 OR NOT CMAKE_MATCH_1)
    message(FATAL_ERROR "no SONAME in ${lib} (objdump -p): cannot load it by its soname")
  endif()
  set(${out} ${CMAKE_MATCH_1} PARENT_SCOPE)
endfunction()
