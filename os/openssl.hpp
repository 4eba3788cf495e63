#pragma once
// OpenSSL's libssl and libcrypto, loaded when first used, not at every start: the broker's TLS
// (network "proxy"), the archives' SHA-256 and Ed25519 signatures. Linked, the two were ~0.7 ms of
// every exec of the supervisor and ~1.6 MiB of its resident memory, in boxes that use neither
// (issue 18).
//
// The callers keep calling OpenSSL by its own names, Boost.Asio's SSL headers among them:
// openssl.cpp defines each function below with the signature the OpenSSL headers declare (the
// compiler checks them against those declarations), with hidden visibility, forwarding to the
// function of the library loaded by its soname. They are not exported: a library that links
// OpenSSL (libwebsockets) binds to OpenSSL's own. A function missing here fails the link.
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <string>

#include "base/result.hpp"

namespace sbx::os {

// X(return type, name, (parameters), (arguments))
#define SBX_LIBSSL_FUNCTIONS(X)                                                                  \
  X(long, SSL_CTX_ctrl, (SSL_CTX * ctx, int cmd, long larg, void* parg), (ctx, cmd, larg, parg)) \
  X(void, SSL_CTX_free, (SSL_CTX * a0), (a0))                                                    \
  X(void*, SSL_CTX_get_default_passwd_cb_userdata, (SSL_CTX * ctx), (ctx))                       \
  X(void*, SSL_CTX_get_ex_data, (const SSL_CTX* ssl, int idx), (ssl, idx))                       \
  X(int, SSL_CTX_load_verify_locations, (SSL_CTX * ctx, const char* CAfile, const char* CApath), \
    (ctx, CAfile, CApath))                                                                       \
  X(SSL_CTX*, SSL_CTX_new, (const SSL_METHOD* meth), (meth))                                     \
  X(void, SSL_CTX_set_default_passwd_cb_userdata, (SSL_CTX * ctx, void* u), (ctx, u))            \
  X(int, SSL_CTX_set_default_verify_paths, (SSL_CTX * ctx), (ctx))                               \
  X(int, SSL_CTX_set_ex_data, (SSL_CTX * ssl, int idx, void* data), (ssl, idx, data))            \
  X(uint64_t, SSL_CTX_set_options, (SSL_CTX * ctx, uint64_t op), (ctx, op))                      \
  X(int, SSL_accept, (SSL * ssl), (ssl))                                                         \
  X(int, SSL_connect, (SSL * ssl), (ssl))                                                        \
  X(long, SSL_ctrl, (SSL * ssl, int cmd, long larg, void* parg), (ssl, cmd, larg, parg))         \
  X(void, SSL_free, (SSL * ssl), (ssl))                                                          \
  X(int, SSL_get_error, (const SSL* s, int ret_code), (s, ret_code))                             \
  X(void*, SSL_get_ex_data, (const SSL* ssl, int idx), (ssl, idx))                               \
  X(int, SSL_get_ex_data_X509_STORE_CTX_idx, (), ())                                             \
  X(int, SSL_get_shutdown, (const SSL* ssl), (ssl))                                              \
  X(SSL_verify_cb, SSL_get_verify_callback, (const SSL* s), (s))                                 \
  X(int, SSL_get_verify_mode, (const SSL* s), (s))                                               \
  X(SSL*, SSL_new, (SSL_CTX * ctx), (ctx))                                                       \
  X(int, SSL_read, (SSL * ssl, void* buf, int num), (ssl, buf, num))                             \
  X(void, SSL_set_bio, (SSL * s, BIO * rbio, BIO * wbio), (s, rbio, wbio))                       \
  X(int, SSL_set_ex_data, (SSL * ssl, int idx, void* data), (ssl, idx, data))                    \
  X(void, SSL_set_verify, (SSL * s, int mode, SSL_verify_cb callback), (s, mode, callback))      \
  X(int, SSL_write, (SSL * ssl, const void* buf, int num), (ssl, buf, num))                      \
  X(const SSL_METHOD*, TLS_client_method, (), ())                                                \
  X(const SSL_METHOD*, TLS_method, (), ())                                                       \
  X(const SSL_METHOD*, TLS_server_method, (), ())

#define SBX_LIBCRYPTO_FUNCTIONS(X)                                                                                    \
  X(long, BIO_ctrl, (BIO * bp, int cmd, long larg, void* parg), (bp, cmd, larg, parg))                                \
  X(size_t, BIO_ctrl_pending, (BIO * b), (b))                                                                         \
  X(int, BIO_free, (BIO * a), (a))                                                                                    \
  X(BIO*, BIO_new, (const BIO_METHOD* type), (type))                                                                  \
  X(int, BIO_new_bio_pair, (BIO * *bio1, size_t writebuf1, BIO * *bio2, size_t writebuf2),                            \
    (bio1, writebuf1, bio2, writebuf2))                                                                               \
  X(BIO*, BIO_new_mem_buf, (const void* buf, int len), (buf, len))                                                    \
  X(int, BIO_read, (BIO * b, void* data, int dlen), (b, data, dlen))                                                  \
  X(const BIO_METHOD*, BIO_s_mem, (), ())                                                                             \
  X(int, BIO_write, (BIO * b, const void* data, int dlen), (b, data, dlen))                                           \
  X(void, CRYPTO_free, (void* ptr, const char* file, int line), (ptr, file, line))                                    \
  X(void, ERR_clear_error, (), ())                                                                                    \
  X(void, ERR_error_string_n, (unsigned long e, char* buf, size_t len), (e, buf, len))                                \
  X(unsigned long, ERR_get_error, (), ())                                                                             \
  X(const char*, ERR_lib_error_string, (unsigned long e), (e))                                                        \
  X(const char*, ERR_reason_error_string, (unsigned long e), (e))                                                     \
  X(int, EVP_Digest,                                                                                                  \
    (const void* data, size_t count, unsigned char* md, unsigned int* size, const EVP_MD* type, ENGINE* impl),        \
    (data, count, md, size, type, impl))                                                                              \
  X(int, EVP_DigestFinal_ex, (EVP_MD_CTX * ctx, unsigned char* md, unsigned int* s), (ctx, md, s))                    \
  X(int, EVP_DigestInit_ex, (EVP_MD_CTX * ctx, const EVP_MD* type, ENGINE* impl), (ctx, type, impl))                  \
  X(int, EVP_DigestSign,                                                                                              \
    (EVP_MD_CTX * ctx, unsigned char* sigret, size_t* siglen, const unsigned char* tbs, size_t tbslen),               \
    (ctx, sigret, siglen, tbs, tbslen))                                                                               \
  X(int, EVP_DigestSignInit, (EVP_MD_CTX * ctx, EVP_PKEY_CTX * *pctx, const EVP_MD* type, ENGINE* e, EVP_PKEY* pkey), \
    (ctx, pctx, type, e, pkey))                                                                                       \
  X(int, EVP_DigestUpdate, (EVP_MD_CTX * ctx, const void* d, size_t cnt), (ctx, d, cnt))                              \
  X(int, EVP_DigestVerify,                                                                                            \
    (EVP_MD_CTX * ctx, const unsigned char* sigret, size_t siglen, const unsigned char* tbs, size_t tbslen),          \
    (ctx, sigret, siglen, tbs, tbslen))                                                                               \
  X(int, EVP_DigestVerifyInit,                                                                                        \
    (EVP_MD_CTX * ctx, EVP_PKEY_CTX * *pctx, const EVP_MD* type, ENGINE* e, EVP_PKEY* pkey),                          \
    (ctx, pctx, type, e, pkey))                                                                                       \
  X(void, EVP_MD_CTX_free, (EVP_MD_CTX * ctx), (ctx))                                                                 \
  X(EVP_MD_CTX*, EVP_MD_CTX_new, (), ())                                                                              \
  X(void, EVP_PKEY_CTX_free, (EVP_PKEY_CTX * ctx), (ctx))                                                             \
  X(EVP_PKEY_CTX*, EVP_PKEY_CTX_new_id, (int id, ENGINE* e), (id, e))                                                 \
  X(void, EVP_PKEY_free, (EVP_PKEY * pkey), (pkey))                                                                   \
  X(int, EVP_PKEY_get_id, (const EVP_PKEY* pkey), (pkey))                                                             \
  X(int, EVP_PKEY_get_raw_public_key, (const EVP_PKEY* pkey, unsigned char* pub, size_t* len), (pkey, pub, len))      \
  X(int, EVP_PKEY_keygen, (EVP_PKEY_CTX * ctx, EVP_PKEY * *ppkey), (ctx, ppkey))                                      \
  X(int, EVP_PKEY_keygen_init, (EVP_PKEY_CTX * ctx), (ctx))                                                           \
  X(EVP_PKEY*, EVP_PKEY_new_raw_public_key, (int type, ENGINE* e, const unsigned char* pub, size_t len),              \
    (type, e, pub, len))                                                                                              \
  X(const EVP_MD*, EVP_sha256, (), ())                                                                                \
  X(EVP_PKEY*, PEM_read_bio_PUBKEY, (BIO * out, EVP_PKEY * *x, pem_password_cb * cb, void* u), (out, x, cb, u))       \
  X(EVP_PKEY*, PEM_read_bio_PrivateKey, (BIO * out, EVP_PKEY * *x, pem_password_cb * cb, void* u), (out, x, cb, u))   \
  X(int, PEM_write_bio_PUBKEY, (BIO * out, const EVP_PKEY* x), (out, x))                                              \
  X(int, PEM_write_bio_PrivateKey,                                                                                    \
    (BIO * out, const EVP_PKEY* x, const EVP_CIPHER* enc, const unsigned char* kstr, int klen, pem_password_cb* cb,   \
     void* u),                                                                                                        \
    (out, x, enc, kstr, klen, cb, u))                                                                                 \
  X(X509*, X509_STORE_CTX_get_current_cert, (const X509_STORE_CTX* ctx), (ctx))                                       \
  X(int, X509_STORE_CTX_get_error_depth, (const X509_STORE_CTX* ctx), (ctx))                                          \
  X(void*, X509_STORE_CTX_get_ex_data, (const X509_STORE_CTX* ctx, int idx), (ctx, idx))                              \
  X(int, X509_check_host, (X509 * x, const char* chk, size_t chklen, unsigned int flags, char** peername),            \
    (x, chk, chklen, flags, peername))                                                                                \
  X(int, X509_check_ip_asc, (X509 * x, const char* ipasc, unsigned int flags), (x, ipasc, flags))

/// Loads libcrypto (by its soname, SBX_LIBCRYPTO_SONAME, as the loader finds any library), once;
/// or why it cannot be: the error names the soname and the loader's message (code no_openssl).
/// Thread-safe. A forwarding function called while it cannot be loaded throws std::runtime_error
/// with that message, so callers that can say what they needed it for check first.
const base::Result<void>& libcrypto();
/// libssl (SBX_LIBSSL_SONAME) and libcrypto, the same way.
const base::Result<void>& libssl();

}  // namespace sbx::os
