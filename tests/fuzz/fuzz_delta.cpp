// libFuzzer target: one snapshot delta through the importer's first steps (archive/chunks.cpp's
// header reader and the chunk check before a chunk is kept). The input is the delta file. Any
// crash, leak or sanitizer report is a bug, and so is a chunk kept in the store that does not hash
// to its name; a refusal is the expected way out.
#include <stdlib.h>
#include <unistd.h>
#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "archive/chunks.hpp"
#include "archive/hash.hpp"
#include "scratch.hpp"

using namespace sbx::archive;
namespace fs = std::filesystem;

namespace {

const std::string& src() {
  static const std::string p = scratch_dir("delta") + "/in.delta";
  return p;
}

const std::string& store_dir() {
  static const std::string p = scratch_dir("delta") + "/chunks";
  return p;
}

// Every chunk file kept in the store decompresses to bytes that hash to its name.
void check_store(const std::string& store) {
  std::error_code ec;
  for (auto& e : fs::recursive_directory_iterator(store, ec)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::string z((std::istreambuf_iterator<char>(in)), {});
    std::string out(kChunkMax, '\0');
    size_t n = ZSTD_decompress(out.data(), out.size(), z.data(), z.size());
    if (ZSTD_isError(n)) __builtin_trap();
    Sha256 h;
    h.update(out.data(), n);
    if (h.hex() != e.path().filename().string()) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream f(src(), std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  if (auto h = read_delta_header(src())) {
    (void)store_delta_chunks(src(), *h, store_dir());
    check_store(store_dir());
  }
  std::error_code ec;
  fs::remove_all(store_dir(), ec);
  return 0;
}
