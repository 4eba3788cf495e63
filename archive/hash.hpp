#pragma once
// SHA-256 over a stream (OpenSSL's EVP), for the archive's and the chunk store's content hashes.
#include <openssl/evp.h>

#include <string>

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

}  // namespace sbx::archive
