# The libraries the layers link, found once for the main build and for the fuzz build (tests/fuzz).
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
