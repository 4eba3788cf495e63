#pragma once
// The checkpoint archive (format 2, checkpoint/README.md): one tar stream, zstd-compressed,
// whose first entry is manifest.json (every other entry with its type, and a file's size and
// sha256), whose second is signature.json (an Ed25519 signature of the manifest's bytes), and
// then the criu images (criu/) and the branch's writable layer (fs/). The snapshot id is derived
// from the sha256 of manifest.json's bytes (format 3), which list every entry with its type and a
// file's size and sha256, so an archive names its own content whatever bytes its compression
// made; format 2, still read, took the sha256 of the whole archive file instead. The signature
// says which box made it. A reader verifies the signature before it writes a single byte of the
// payload, then checks each entry against the signed manifest as it streams.
#include <boost/json.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "archive/chunks.hpp"
#include "archive/signing.hpp"
#include "base/result.hpp"

namespace sbx::archive {

inline constexpr int kFormatVersion = 3;
/// Format 3 with hard links: a name listed {"type": "hardlink", "target": PATH} (a file listed
/// before it) is a tar hard link entry to PATH. An archive holds them where its payload had names of
/// one inode, and says 4 then; an older reader refuses it at its manifest.
inline constexpr int kLinksFormatVersion = 4;
/// The oldest format still read: 2, whose snapshot id is the sha256 of the archive file.
inline constexpr int kOldestFormatVersion = 2;
inline constexpr const char* kFormatName = "sandboxer.checkpoint";
/// The box-wide bound on what one archive may expand to (--max-archive-bytes).
inline constexpr uint64_t kDefaultMaxArchiveBytes = 64ull << 30;

/// What an import trusts, and how far an archive may expand.
struct ImportPolicy {
  std::vector<PublicKey> trusted;  // an archive signed by one of these is trusted
  bool allow_unsigned = false;     // else an unsigned or untrusted archive is refused
  uint64_t max_bytes = kDefaultMaxArchiveBytes;
  /// Inodes an extraction leaves free on its destination's filesystem: one whose manifest lists
  /// more entries than the rest is refused before its payload (code no_space).
  uint64_t keep_inodes = 0;
};

/// An archive extracted and checked.
struct Extracted {
  boost::json::object manifest;
  bool trusted = false;       // a trusted key verified its signature
  std::string signer;         // that key's fingerprint
  std::string why_untrusted;  // else why not (accepted only under allow_unsigned)
  int format_version = 0;
  std::string manifest_sha256;  // of manifest.json's bytes: the snapshot's id from format 3 on
};

/// Whether an archive of this format is named by its manifest's hash (3 on), not its file's (2).
inline bool named_by_manifest(int format_version) { return format_version >= 3; }

/// The id of a snapshot whose manifest (format 3 on) or archive file (format 2) hashes to `sha256`.
inline std::string snapshot_id_of(std::string_view sha256) { return "s-" + std::string(sha256.substr(0, 16)); }

struct ArchiveInfo {
  std::string manifest_sha256;          // of manifest.json's bytes: the snapshot's id
  std::string sha256;                   // of the archive file, when one was written
  uint64_t raw_bytes = 0;               // sum of the entries' sizes (holes included; an inode's once)
  int format_version = kFormatVersion;  // the manifest's: kLinksFormatVersion where it lists hard links
  uint64_t compressed_bytes = 0;
  std::optional<ChunkList> chunks;  // where the stream went to the chunk store
};

/// Where write_snapshot writes: an archive file (none when empty), the chunk store (none when
/// null), or both; and what its files may add up to (holes included, an inode's once): a snapshot
/// past it is not written (code limit), as no box with that --max-archive-bytes could extract it.
struct SnapshotOut {
  std::string archive;
  ChunkWriter* chunks = nullptr;
  uint64_t max_bytes = UINT64_MAX;
};

/// Writes `manifest` (with "files" added: every dir, regular file and symlink under `src_dir`),
/// its signature by `key` (none when null: an unsigned archive), then those entries, to `dst` as
/// tar + zstd; or what failed. A file with holes is a pax sparse entry (GNU sparse 1.0: its data
/// extents only, which any libarchive or GNU tar reads back whole), and a further name of an inode
/// a hard link entry to its first (format 4, kLinksFormatVersion): what the archive holds is what
/// the payload takes, not the sum of its sizes. Its manifest lists sizes and hashes of the whole
/// contents, as before.
base::Result<ArchiveInfo> write_archive(const std::string& src_dir, boost::json::object manifest,
                                        const std::string& dst, int level, const SigningKey* key);

/// write_archive's manifest, signature and payload, as one tar stream to `to`.
base::Result<ArchiveInfo> write_snapshot(const std::string& src_dir, boost::json::object manifest,
                                         const SnapshotOut& to, int level, const SigningKey* key);

/// Writes the tar stream `list` of the chunk store at `store_dir` as an archive file `dst` (which
/// must not exist): an export of a snapshot kept as chunks. Every chunk is checked on the way, and
/// the stream against the list's hash. A format-2 snapshot's archive is checked against
/// list.archive_sha256, its id (zstd writes the same bytes for the same stream and parameters;
/// another libzstd may not, and that is an error saying so); a later format needs no such check.
base::Result<ArchiveInfo> rebuild_archive(const std::string& store_dir, ChunkList list, const std::string& dst,
                                          int level);

/// Cuts the tar stream of the archive file `src` into the chunk store at `store_dir`: the list of
/// a snapshot kept as an archive, for a delta against it (with its manifest's hash, or for a
/// format-2 archive the file's).
base::Result<ChunkList> chunk_archive(const std::string& src, const std::string& store_dir);

/// The sha256 of a file, as lowercase hex, or why it cannot be read.
base::Result<std::string> sha256_file(const std::string& path);

/// Extracts `src` into `dst_dir` (which must not exist; it is created 0700): the manifest and its
/// signature first (refused, before any payload byte is written, when no key of `policy`
/// verifies it, unless policy.allow_unsigned), then every entry checked against the manifest
/// (listed, same type, size and sha256) beneath a directory fd with no symlink followed
/// (symlinks are made last), no devices, absolute or `..` paths, no hard links but those a format-4
/// manifest lists to a file extracted before them (linked beneath the same fd), and the expansion
/// bounded by the manifest's sizes and policy.max_bytes. Every 4 KiB block of zeros in a file is
/// left a hole, not written: a sparse file comes out as sparse as it went in. On any failure the partial directory is
/// removed and the error says what was wrong; its code is "untrusted" when no trusted key signed
/// the archive, "no_space" when its destination has too few inodes (policy.keep_inodes), else
/// "bad_snapshot".
base::Result<Extracted> extract_archive(const std::string& src, const std::string& dst_dir, const ImportPolicy& policy);
/// extract_archive from the tar stream `list` of the chunk store at `store_dir`: a missing or
/// corrupted chunk is an error naming it (code bad_snapshot).
base::Result<Extracted> extract_chunks(const std::string& store_dir, ChunkList list, const std::string& dst_dir,
                                       const ImportPolicy& policy);

/// The head of the archive file `src`: its manifest, checked as extract_archive checks it (but
/// not its signature), with its format and hash; no payload is read. Code bad_snapshot.
base::Result<Extracted> read_manifest(const std::string& src);

/// extract_archive without writing anything: every entry checked against the manifest, and the
/// signature against `policy` (an untrusted one is an error unless policy.allow_unsigned).
base::Result<Extracted> verify_archive(const std::string& src, const ImportPolicy& policy);

/// The snapshot id the archive file `src` names (its manifest's hash; a format-2 archive's own),
/// every entry checked against its manifest, the signature not (an importer checks it).
base::Result<std::string> archive_id(const std::string& src);

/// Where an image says who it is (images/write-image-json): {"id": "sha256:...", "version", ...}.
inline constexpr const char* kImageJson = "/etc/sandboxer/image.json";

/// The image id from an image.json file, or nullopt where there is none (a plain host) or it
/// has no string "id".
std::optional<std::string> read_image_id(const std::string& path = kImageJson);

/// Whether a snapshot with this manifest can be restored here, else why not (code "incompatible"):
/// a live snapshot needs the same criu version as the one that dumped it (`criu_here` is nullopt where
/// there is no criu); any snapshot needs the same image, when both its manifest and this box
/// know their image id (a snapshot from a plain host, or a box outside an image, carries null).
base::Result<void> incompatibility(const boost::json::object& manifest, const std::optional<std::string>& criu_here,
                                   const std::optional<std::string>& image_here);

/// Whether `id` has the shape of a snapshot id ("s-" and 16 lowercase hex digits).
bool valid_snapshot_id(std::string_view id);

/// Whether libarchive and libcrypto load here (both are loaded at their first use: libarchive.hpp,
/// os/openssl.hpp): else why not, naming the soname (code no_libarchive or no_openssl). Writing
/// and extracting archives fail the same way.
base::Result<void> library_loadable();

}  // namespace sbx::archive
