#include "archive/signing.hpp"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "os/openssl.hpp"
#include "os/sys.hpp"

namespace sbx::archive {

namespace {

std::string ssl_error() {
  unsigned long e = ERR_get_error();
  if (!e) return "unknown OpenSSL error";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  ERR_clear_error();
  return buf;
}

std::string raw_public(EVP_PKEY* k) {
  std::string raw(32, '\0');
  size_t len = raw.size();
  if (EVP_PKEY_get_raw_public_key(k, reinterpret_cast<unsigned char*>(raw.data()), &len) != 1) return {};
  raw.resize(len);
  return raw;
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
using Bio = std::unique_ptr<BIO, BioDeleter>;

std::string bio_text(BIO* b) {
  char* p = nullptr;
  long n = BIO_get_mem_data(b, &p);
  return n > 0 ? std::string(p, static_cast<size_t>(n)) : std::string();
}

}  // namespace

std::string hex_encode(const unsigned char* p, size_t n) {
  static constexpr char h[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += h[p[i] >> 4];
    out += h[p[i] & 15];
  }
  return out;
}

std::string PublicKey::fingerprint() const {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  EVP_Digest(raw.data(), raw.size(), md, &len, EVP_sha256(), nullptr);
  return "ed25519:" + hex_encode(md, 16);
}

bool PublicKey::verify(std::string_view msg, std::string_view sig) const {
  EVP_PKEY* k = EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr,
                                            reinterpret_cast<const unsigned char*>(raw.data()), raw.size());
  if (!k) {
    ERR_clear_error();
    return false;
  }
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  bool ok = ctx && EVP_DigestVerifyInit(ctx, nullptr, nullptr, nullptr, k) == 1 &&
            EVP_DigestVerify(ctx, reinterpret_cast<const unsigned char*>(sig.data()), sig.size(),
                             reinterpret_cast<const unsigned char*>(msg.data()), msg.size()) == 1;
  EVP_MD_CTX_free(ctx);
  EVP_PKEY_free(k);
  ERR_clear_error();
  return ok;
}

SigningKey::SigningKey(void* pkey) : pkey_(pkey) { pub_.raw = raw_public(static_cast<EVP_PKEY*>(pkey)); }
SigningKey::~SigningKey() { EVP_PKEY_free(static_cast<EVP_PKEY*>(pkey_)); }
SigningKey::SigningKey(SigningKey&& o) noexcept : pkey_(o.pkey_), pub_(std::move(o.pub_)) { o.pkey_ = nullptr; }
SigningKey& SigningKey::operator=(SigningKey&& o) noexcept {
  if (this != &o) {
    EVP_PKEY_free(static_cast<EVP_PKEY*>(pkey_));
    pkey_ = o.pkey_;
    pub_ = std::move(o.pub_);
    o.pkey_ = nullptr;
  }
  return *this;
}

base::Result<SigningKey> SigningKey::load(const std::string& path) {
  if (const auto& lib = os::libcrypto(); !lib) return lib.error();
  auto text = os::read_file(path);
  if (!text) return base::fail("read " + path + ": " + text.error().message());
  Bio bio(BIO_new_mem_buf(text->data(), static_cast<int>(text->size())));
  EVP_PKEY* k = bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr) : nullptr;
  if (!k) return base::fail(path + ": not a PEM private key (" + ssl_error() + ")");
  if (EVP_PKEY_get_id(k) != EVP_PKEY_ED25519) {
    EVP_PKEY_free(k);
    return base::fail(path + ": not an Ed25519 key (make one with: openssl genpkey -algorithm ed25519)");
  }
  return SigningKey(k);
}

base::Result<SigningKey> SigningKey::generate() {
  if (const auto& lib = os::libcrypto(); !lib) return lib.error();
  // EVP_PKEY_Q_keygen is variadic, which os/openssl.cpp cannot forward: its steps, one by one.
  std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)> ctx(EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, nullptr),
                                                                  &EVP_PKEY_CTX_free);
  EVP_PKEY* k = nullptr;
  if (!ctx || EVP_PKEY_keygen_init(ctx.get()) != 1 || EVP_PKEY_keygen(ctx.get(), &k) != 1 || !k)
    return base::fail("generate an Ed25519 key: " + ssl_error());
  return SigningKey(k);
}

base::Result<std::string> SigningKey::sign(std::string_view msg) const {
  std::string sig(64, '\0');
  size_t len = sig.size();
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  bool ok = ctx && EVP_DigestSignInit(ctx, nullptr, nullptr, nullptr, static_cast<EVP_PKEY*>(pkey_)) == 1 &&
            EVP_DigestSign(ctx, reinterpret_cast<unsigned char*>(sig.data()), &len,
                           reinterpret_cast<const unsigned char*>(msg.data()), msg.size()) == 1;
  EVP_MD_CTX_free(ctx);
  if (!ok) return base::fail("sign a manifest: " + ssl_error());
  sig.resize(len);
  return sig;
}

std::string SigningKey::private_pem() const {
  Bio bio(BIO_new(BIO_s_mem()));
  PEM_write_bio_PrivateKey(bio.get(), static_cast<EVP_PKEY*>(pkey_), nullptr, nullptr, 0, nullptr, nullptr);
  return bio_text(bio.get());
}

std::string SigningKey::public_pem() const {
  Bio bio(BIO_new(BIO_s_mem()));
  PEM_write_bio_PUBKEY(bio.get(), static_cast<EVP_PKEY*>(pkey_));
  return bio_text(bio.get());
}

base::Result<PublicKey> load_trust_key(const std::string& path) {
  if (const auto& lib = os::libcrypto(); !lib) return lib.error();
  auto text = os::read_file(path);
  if (!text) return base::fail("read " + path + ": " + text.error().message());
  Bio bio(BIO_new_mem_buf(text->data(), static_cast<int>(text->size())));
  EVP_PKEY* k = PEM_read_bio_PUBKEY(bio.get(), nullptr, nullptr, nullptr);
  if (!k) {
    ERR_clear_error();
    Bio again(BIO_new_mem_buf(text->data(), static_cast<int>(text->size())));
    k = PEM_read_bio_PrivateKey(again.get(), nullptr, nullptr, nullptr);
  }
  if (!k) return base::fail(path + ": not a PEM public or private key (" + ssl_error() + ")");
  PublicKey pub{raw_public(k)};
  bool ed = EVP_PKEY_get_id(k) == EVP_PKEY_ED25519;
  EVP_PKEY_free(k);
  if (!ed || pub.raw.size() != 32) return base::fail(path + ": not an Ed25519 key");
  return pub;
}

ArchiveKeys::ArchiveKeys(std::string signing, std::vector<std::string> trust, std::string user_dir)
    : signing_path_(std::move(signing)), trust_paths_(std::move(trust)), user_dir_(std::move(user_dir)) {}

base::Result<void> ArchiveKeys::check_files() const {
  auto regular = [](const std::string& opt, const std::string& path) -> base::Result<void> {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return base::sys_fail(opt + " " + path, errno);
    if (!S_ISREG(st.st_mode)) return base::fail(opt + " " + path + ": not a regular file");
    return {};
  };
  // The user's key has had its own checks (ensure_user_key, UserKey::Check), and is made at its
  // first use when it is not there yet.
  if (!signing_path_.empty() && user_dir_.empty())
    if (auto r = regular("--signing-key", signing_path_); !r) return r;
  for (auto& f : trust_paths_)
    if (auto r = regular("--trust-key", f); !r) return r;
  return {};
}

base::Result<std::shared_ptr<const SigningKey>> ArchiveKeys::signing() const {
  if (!signing_) {
    if (!user_dir_.empty())
      if (auto made = ensure_user_key(user_dir_, UserKey::Make); !made)
        return *(signing_ = base::fail("the user's archive key: " + made.error().message));
    auto key = signing_path_.empty() ? SigningKey::generate() : SigningKey::load(signing_path_);
    if (key)
      signing_ = std::make_shared<const SigningKey>(std::move(*key));
    else
      signing_ = base::fail("--signing-key " + key.error().message);
  }
  return *signing_;
}

base::Result<std::vector<PublicKey>> ArchiveKeys::trusted() const {
  if (!trusted_) {
    std::vector<PublicKey> keys;
    for (auto& f : trust_paths_) {
      auto pub = load_trust_key(f);
      if (!pub) return *(trusted_ = base::fail("--trust-key " + pub.error().message));
      keys.push_back(*pub);
    }
    auto own = signing();
    if (!own) return *(trusted_ = own.error());
    keys.push_back((*own)->public_key());
    trusted_ = std::move(keys);
  }
  return *trusted_;
}

std::string user_key_dir() {
  auto home = os::state_home();
  // No private home to be had: ensure_user_key then says why (its directory is refused).
  return (home ? *home : "/tmp/sandboxer-" + std::to_string(::geteuid())) + "/keys";
}

base::Result<std::string> ensure_user_key(const std::string& dir, UserKey use) {
  std::string priv = dir + "/signing.pem", pub = dir + "/signing.pub";
  // Whoever can write the key store chooses which archives criu restores: it is this user's
  // alone, and so is the key in it.
  std::string parent = dir.substr(0, dir.rfind('/'));
  if (auto r = os::make_dirs(parent, 0700); !r) return base::fail("create " + parent + ": " + r.error().message());
  for (const std::string& d : {parent, dir})
    if (auto r = os::own_private_dir(d); !r) return r.error();
  struct stat st {};
  if (::lstat(priv.c_str(), &st) != 0) {
    if (use == UserKey::Check) return priv;
    // First use: a whole key in a temporary file, then linked into place (link fails when a
    // concurrent first use got there first: then its key is the one).
    auto key = SigningKey::generate();
    if (!key) return key.error();
    std::string tmp = priv + ".tmp-" + os::random_hex(6);
    os::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) return base::sys_fail("create " + tmp, errno);
    ::fchmod(fd.get(), 0600);
    auto w = os::write_all(fd.get(), key->private_pem());
    if (w && ::fsync(fd.get()) != 0) w = os::last_error();
    fd.reset();
    if (!w || (::link(tmp.c_str(), priv.c_str()) != 0 && errno != EEXIST)) {
      auto e = base::fail("write " + priv + ": " + (w ? std::strerror(errno) : w.error().message()));
      ::unlink(tmp.c_str());
      return e;
    }
    ::unlink(tmp.c_str());
  } else if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    return base::fail(priv + ": not a regular file of this user's alone (mode 0600)");
  } else if (use != UserKey::Load) {
    return priv;
  }
  auto key = SigningKey::load(priv);
  if (!key) return key.error();
  // The public half beside it, for boxes elsewhere (Docker) to trust; the same text every time.
  auto have = os::read_file(pub);
  if (!have || *have != key->public_pem())
    if (auto r = os::write_file_atomic(pub, key->public_pem(), 0644); !r)
      return base::fail("write " + pub + ": " + r.error().message());
  // In place: base::Error, an aggregate, is constructible from a string as well.
  return priv;
}

}  // namespace sbx::archive
