// libFuzzer target: one checkpoint archive through the importer (checkpoint/archive.cpp's tar and
// manifest reader, the signature check, the extraction beneath a directory fd). The input is the
// decompressed tar stream: it is framed with zstd here, so the fuzzer spends its time on the tar
// and the manifest, not on the compressor's checksum. Any crash, leak, sanitizer report or file
// written outside the extraction directory is a bug; a refusal is the expected way out.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "archive/archive.hpp"
#include "scratch.hpp"

using namespace sbx::archive;
namespace fs = std::filesystem;

namespace {

struct Dirs {
  std::string src = scratch_dir("archive") + "/in.tar.zst";
  std::string dst = scratch_dir("archive") + "/out";
};

const Dirs& dirs() {
  static Dirs d;
  return d;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Dirs& d = dirs();
  std::vector<char> z(ZSTD_compressBound(size));
  size_t n = ZSTD_compress(z.data(), z.size(), data, size, 1);
  if (ZSTD_isError(n)) return 0;
  int fd = ::open(d.src.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return 0;
  if (::write(fd, z.data(), n) != static_cast<ssize_t>(n)) {
    ::close(fd);
    return 0;
  }
  ::close(fd);
  ImportPolicy policy;
  policy.allow_unsigned = true;  // reach the extraction with unsigned inputs too
  policy.max_bytes = 64u << 20;
  auto x = extract_archive(d.src, d.dst, policy);
  if (!x && fs::exists(d.dst)) __builtin_trap();  // a refusal leaves nothing behind
  std::error_code ec;
  fs::remove_all(d.dst, ec);
  // Nothing but in.tar.zst may ever appear beside the extraction directory.
  for (auto& e : fs::directory_iterator(scratch_dir("archive"), ec))
    if (e.path().filename() != "in.tar.zst") __builtin_trap();
  return 0;
}
