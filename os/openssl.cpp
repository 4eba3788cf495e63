#include "os/openssl.hpp"

#include <stdexcept>

#include "os/library.hpp"

namespace sbx::os {

namespace {

struct SslTable {
#define SBX_OPENSSL_MEMBER(ret, name, params, args) decltype(&::name) name = nullptr;
  SBX_LIBSSL_FUNCTIONS(SBX_OPENSSL_MEMBER)
};
struct CryptoTable {
  SBX_LIBCRYPTO_FUNCTIONS(SBX_OPENSSL_MEMBER)
#undef SBX_OPENSSL_MEMBER
};
SslTable ssl_table;
CryptoTable crypto_table;

#define SBX_OPENSSL_LOAD(table, ret, name, params, args) \
  if (auto r = l->get(table.name, #name); !r) return r.error();

base::Result<void> load_crypto() {
  auto l = Library::open("OpenSSL", SBX_LIBCRYPTO_SONAME, "no_openssl");
  if (!l) return l.error();
#define SBX_CRYPTO_LOAD(ret, name, params, args) SBX_OPENSSL_LOAD(crypto_table, ret, name, params, args)
  SBX_LIBCRYPTO_FUNCTIONS(SBX_CRYPTO_LOAD)
#undef SBX_CRYPTO_LOAD
  return {};
}

base::Result<void> load_ssl() {
  if (auto& c = libcrypto(); !c) return c;
  auto l = Library::open("OpenSSL", SBX_LIBSSL_SONAME, "no_openssl");
  if (!l) return l.error();
#define SBX_SSL_LOAD(ret, name, params, args) SBX_OPENSSL_LOAD(ssl_table, ret, name, params, args)
  SBX_LIBSSL_FUNCTIONS(SBX_SSL_LOAD)
#undef SBX_SSL_LOAD
  return {};
}
#undef SBX_OPENSSL_LOAD

const CryptoTable& crypto() {
  if (auto& r = libcrypto(); !r) throw std::runtime_error(r.error().message);
  return crypto_table;
}

const SslTable& ssl() {
  if (auto& r = libssl(); !r) throw std::runtime_error(r.error().message);
  return ssl_table;
}

}  // namespace

const base::Result<void>& libcrypto() {
  static const base::Result<void> r = load_crypto();  // once, under the static's guard
  return r;
}

const base::Result<void>& libssl() {
  static const base::Result<void> r = load_ssl();
  return r;
}

}  // namespace sbx::os

// The forwarding functions, by OpenSSL's names, in the global namespace as declared.
#define SBX_SSL_FORWARD(ret, name, params, args) \
  extern "C" __attribute__((visibility("hidden"))) ret name params { return sbx::os::ssl().name args; }
#define SBX_CRYPTO_FORWARD(ret, name, params, args) \
  extern "C" __attribute__((visibility("hidden"))) ret name params { return sbx::os::crypto().name args; }
SBX_LIBSSL_FUNCTIONS(SBX_SSL_FORWARD)
SBX_LIBCRYPTO_FUNCTIONS(SBX_CRYPTO_FORWARD)
