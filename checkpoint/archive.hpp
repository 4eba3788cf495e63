#pragma once
// The checkpoint archive: one tar stream, zstd-compressed (libarchive), holding the criu images
// (criu/), the branch's writable layer (fs/) and, as its last entry, manifest.json, which lists
// every other entry with its size and sha256. The snapshot id is derived from the sha256 of the
// whole archive file, so an archive names its own content.
#include <boost/json.hpp>
#include <cstdint>
#include <optional>
#include <string>

namespace sbx::checkpoint {

inline constexpr int kFormatVersion = 1;
inline constexpr const char* kFormatName = "sandboxer.checkpoint";

struct ArchiveInfo {
  std::string sha256;        // of the archive file
  uint64_t raw_bytes = 0;    // sum of the entries' sizes
  uint64_t compressed_bytes = 0;
};

/// Writes every file under `src_dir` (dirs, regular files, symlinks) and then `manifest` (with
/// "files" added) to `dst` as tar + zstd. Returns nullopt and sets `err` on failure.
std::optional<ArchiveInfo> write_archive(const std::string& src_dir, boost::json::object manifest,
                                         const std::string& dst, int level, std::string& err);

/// The sha256 of a file, as lowercase hex; nullopt (and `err`) when it cannot be read.
std::optional<std::string> sha256_file(const std::string& path, std::string& err);

/// Extracts `src` into `dst_dir` (which must not exist), checking every entry against the
/// manifest's size and sha256, and refusing paths that leave dst_dir. On any failure the partial
/// directory is removed and `err` says what was wrong. Returns the manifest.
std::optional<boost::json::object> extract_archive(const std::string& src, const std::string& dst_dir,
                                                   std::string& err);

/// Where an image says who it is (images/write-image-json): {"id": "sha256:...", "version", ...}.
inline constexpr const char* kImageJson = "/etc/sandboxer/image.json";

/// The image id from an image.json file, or nullopt where there is none (a plain host) or it
/// has no string "id".
std::optional<std::string> read_image_id(const std::string& path = kImageJson);

/// Why a snapshot with this manifest cannot be restored here, or nullopt when it can: a live
/// snapshot needs the same criu version as the one that dumped it (`criu_here` is nullopt where
/// there is no criu); any snapshot needs the same image, when both its manifest and this box
/// know their image id (a snapshot from a plain host, or a box outside an image, carries null).
std::optional<std::string> incompatibility(const boost::json::object& manifest,
                                           const std::optional<std::string>& criu_here,
                                           const std::optional<std::string>& image_here);

/// Recursive copy of a directory tree (dirs, regular files, symlinks; owner and mode of each kept)
/// into `dst`, which must not exist: a copy is never merged into what is there. Nothing below
/// `src` or `dst` is reached through a symlink (symlinks are copied as symlinks); other file types
/// (sockets, FIFOs, devices) are skipped. `src` itself must be a directory or a regular file, not
/// a symlink. Returns the bytes of regular files copied.
std::optional<uint64_t> copy_tree(const std::string& src, const std::string& dst, std::string& err);

/// rm -rf; errors are ignored.
void remove_tree(const std::string& path);

/// Bytes of regular files under `path`.
uint64_t tree_bytes(const std::string& path);

}  // namespace sbx::checkpoint
