#pragma once
// SHA-256 over a stream (OpenSSL's EVP), for the archive's and the chunk store's content hashes.
#include <openssl/evp.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "archive/signing.hpp"

namespace sbx::archive {

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* p, size_t n) { EVP_DigestUpdate(ctx_, p, n); }
  /// The digest as lowercase hex; the hash is finished.
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned len = 0;
    EVP_DigestFinal_ex(ctx_, md, &len);
    return hex_encode(md, len);
  }

 private:
  EVP_MD_CTX* ctx_;
};

/// SHA-256 on a thread of its own, for bytes the caller reads into its buffers and goes on using
/// (an extraction writes them to their file while they are hashed): one core reads, decompresses
/// and writes while another hashes, instead of one doing all of it in turn. Buffers come from a
/// small pool; one is handed out again only once hashed. One caller thread.
class ParallelSha256 {
 public:
  explicit ParallelSha256(size_t buffer_bytes, size_t buffers = 4);
  ~ParallelSha256();
  ParallelSha256(const ParallelSha256&) = delete;
  ParallelSha256& operator=(const ParallelSha256&) = delete;
  /// A buffer to fill (waits while every one is still being hashed).
  std::vector<char>& take();
  /// Hashes the first `n` bytes of `b` (from take()) after what was pushed before; n == 0 only
  /// returns it.
  void push(std::vector<char>& b, size_t n);
  /// The digest (lowercase hex) of everything pushed since the last digest; a new hash begins.
  std::string digest();

 private:
  void run();
  struct Item {
    std::vector<char>* buf;  // null: a digest is asked for
    size_t n;
  };
  std::vector<std::unique_ptr<std::vector<char>>> bufs_;
  std::vector<std::vector<char>*> free_;
  std::deque<Item> queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<std::string> digest_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest is ready
};

/// Whether `s` is a SHA-256 as Sha256::hex writes it: 64 lowercase hex digits (a chunk's name, an
/// archive's content hash).
bool is_sha256_hex(std::string_view s);

}  // namespace sbx::archive
