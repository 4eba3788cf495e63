#pragma once
// Signed checkpoint archives: Ed25519 keys (OpenSSL), loaded from PEM files the host gives a box.
// A box signs the manifest of every archive it writes with its signing key (--signing-key) and
// imports or restores only archives whose signature one of its trusted keys (--trust-key, and its
// own key's public half) verifies. The CLI keeps one key pair per user (user_key_dir()), made on
// first use, and hands it to every box it starts; a box given no key uses the same pair.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.hpp"

namespace sbx::archive {

/// An Ed25519 public key: its 32 raw bytes.
struct PublicKey {
  std::string raw;
  /// "ed25519:" and the first 32 hex digits of the sha256 of the raw key: what messages show.
  std::string fingerprint() const;
  /// Whether `sig` is this key's Ed25519 signature of `msg`.
  bool verify(std::string_view msg, std::string_view sig) const;
};

/// An Ed25519 private key, which signs.
class SigningKey {
 public:
  ~SigningKey();
  SigningKey(const SigningKey&) = delete;
  SigningKey& operator=(const SigningKey&) = delete;
  SigningKey(SigningKey&&) noexcept;
  SigningKey& operator=(SigningKey&&) noexcept;

  /// Reads a PEM private key (PKCS#8, as `openssl genpkey -algorithm ed25519` writes it).
  static base::Result<SigningKey> load(const std::string& path);
  /// A fresh random key.
  static base::Result<SigningKey> generate();

  const PublicKey& public_key() const { return pub_; }
  /// The 64-byte signature of `msg`, or OpenSSL's reason.
  base::Result<std::string> sign(std::string_view msg) const;
  /// The private key as PEM (PKCS#8), and the public key as PEM (SubjectPublicKeyInfo).
  std::string private_pem() const;
  std::string public_pem() const;

 private:
  explicit SigningKey(void* pkey);
  void* pkey_ = nullptr;  // EVP_PKEY*
  PublicKey pub_;
};

/// A trusted key from a file: a PEM public key, or a PEM private key (its public half).
base::Result<PublicKey> load_trust_key(const std::string& path);

/// A box's archive keys, read when first needed (its first checkpoint, import or restore) and not
/// at start: parsing a PEM key loads most of OpenSSL, some 2 MiB every box would keep for nothing
/// (README, "Benchmarks": the supervisor's peak RSS). At start the files are only checked to exist as regular files, so
/// a missing key still stops the box at once; a key that does not parse is reported, naming its file, by the first
/// operation that needs it. Used from one thread (the box's loop) only.
class ArchiveKeys {
 public:
  /// `signing`: the signing key's file, empty for a fresh key of this box alone (made on first
  /// use); `trust`: the --trust-key files; `user_dir`: set when `signing` is the user's pair in
  /// that directory, made at the first use when it is not there yet (ensure_user_key, Make).
  ArchiveKeys(std::string signing, std::vector<std::string> trust, std::string user_dir = {});
  /// Whether every file exists and is a regular file: the cheap check done at start. The error
  /// names the option and the file.
  base::Result<void> check_files() const;
  /// The signing key, loaded (or made) on the first call; the same error on every later call.
  base::Result<std::shared_ptr<const SigningKey>> signing() const;
  /// The trusted keys: the --trust-key files' and the signing key's public half.
  base::Result<std::vector<PublicKey>> trusted() const;

 private:
  std::string signing_path_;
  std::vector<std::string> trust_paths_;
  std::string user_dir_;
  mutable std::optional<base::Result<std::shared_ptr<const SigningKey>>> signing_;
  mutable std::optional<base::Result<std::vector<PublicKey>>> trusted_;
};

/// Where the per-user key pair lives: $XDG_STATE_HOME/sandboxer/keys (else
/// ~/.local/state/sandboxer/keys), the directory 0700, holding signing.pem (0600) and signing.pub.
std::string user_key_dir();

/// What ensure_user_key does with the pair. Every use first makes the directory (0700) and checks
/// it is this user's alone, and checks an existing private key's file (regular, this user's,
/// 0600).
enum class UserKey {
  Load,   ///< made when missing, then parsed, its public half written beside it (the CLI)
  Make,   ///< made when missing; an existing one is not parsed (a box's first checkpoint, import or restore)
  Check,  ///< nothing made or parsed (a box at start: it makes the key at its first use)
};

/// The per-user key pair in `dir`, as `use` says (a key made has its private half created with
/// O_EXCL and 0600, so two first uses at once end with one key). Returns the private key's path,
/// which with Check may not exist yet.
base::Result<std::string> ensure_user_key(const std::string& dir, UserKey use = UserKey::Load);

/// Lowercase hex of `n` bytes.
std::string hex_encode(const unsigned char* p, size_t n);

}  // namespace sbx::archive
