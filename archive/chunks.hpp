#pragma once
// The chunk store: a byte stream (a snapshot's tar stream) cut into content-defined chunks, each
// stored once by its sha256 and zstd-compressed, so snapshots of one agent share what did not
// change between them (checkpoint/README.md, "The chunk store").
//
// Layout: DIR/<first 2 hex>/<64 hex>, each file one zstd frame (with its content checksum) of
// the chunk whose sha256 is its name. A stream is a ChunkList: the chunks in order, with the
// stream's own sha256 and size. Chunk boundaries come from a gear hash over the content
// (FastCDC's normalized chunking: 16 KiB minimum, about 64 KiB on average, 256 KiB maximum), so
// an insertion or a change moves the boundaries only around it and the rest of the stream cuts
// into the same chunks as before.
#include <boost/json.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "base/result.hpp"
#include "os/unique-fd.hpp"

namespace sbx::archive {

inline constexpr size_t kChunkMin = 16u << 10;
inline constexpr size_t kChunkAvg = 64u << 10;
inline constexpr size_t kChunkMax = 256u << 10;

struct ChunkRef {
  std::string sha256;  // of the chunk's bytes (not of the compressed file)
  uint32_t size = 0;
};

struct ChunkList {
  std::vector<ChunkRef> chunks;
  std::string sha256;           // of the whole stream, when it was hashed (format-2 snapshots' lists)
  uint64_t bytes = 0;           // the stream's size
  std::string manifest_sha256;  // of the snapshot's manifest.json, its id (format 3 on)
  std::string archive_sha256;   // or of the stream as an archive (compressed), a format-2 snapshot's id
  /// The hash that names the snapshot the stream is, or "" for a stream of no snapshot.
  const std::string& id_sha256() const { return manifest_sha256.empty() ? archive_sha256 : manifest_sha256; }
  // What storing it did: the compressed bytes of every chunk it references (its size alone, were
  // it the only stream), of the chunks it added to the store, and how many it added.
  uint64_t stored_bytes = 0;
  uint64_t added_bytes = 0;
  uint64_t new_chunks = 0;
};

/// The length of the first chunk of `data` (the whole of it when no boundary is found before its
/// end and `at_end`; 0 when more bytes are needed to decide). Exposed for tests.
size_t chunk_boundary(const unsigned char* data, size_t n, bool at_end);

/// Cuts a stream into chunks and stores the ones the store lacks. Not thread-safe; one per stream.
class ChunkWriter {
 public:
  ChunkWriter() = default;
  /// Opens (creating it 0700 if needed) the store at `dir`; `level` is zstd's. `hash_stream`:
  /// the list has the whole stream's sha256, which a reader checks. A snapshot of format 3 needs
  /// none: each chunk is named by its hash, and the extraction checks every entry against the
  /// manifest whose hash is the id (a pass of ~0.55 s per GiB saved at the seal and the restore).
  static base::Result<std::unique_ptr<ChunkWriter>> open(const std::string& dir, int level, bool hash_stream = true);
  base::Result<void> write(const void* p, size_t n);
  /// Stores the last chunk and syncs the store's filesystem: the list is durable once returned.
  base::Result<ChunkList> finish();
  ~ChunkWriter();
  ChunkWriter(const ChunkWriter&) = delete;
  ChunkWriter& operator=(const ChunkWriter&) = delete;

 private:
  base::Result<void> store(const unsigned char* p, size_t n);
  os::UniqueFd dir_;
  int level_ = 3;
  void* cctx_ = nullptr;  // ZSTD_CCtx
  void* sha_ = nullptr;   // the stream's Sha256
  std::vector<unsigned char> cur_;
  std::vector<char> zbuf_;
  ChunkList list_;
};

/// Reads a stream back from the store, checking every chunk against its hash and the whole
/// against the list's (when it has one): a missing or corrupted chunk is an error naming it.
class ChunkReader {
 public:
  static base::Result<std::unique_ptr<ChunkReader>> open(const std::string& dir, ChunkList list);
  /// The next bytes of the stream: a view valid until the next call, empty at the end.
  base::Result<std::string_view> next();
  ~ChunkReader();
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;
  ChunkReader() = default;

 private:
  os::UniqueFd dir_;
  ChunkList list_;
  size_t at_ = 0;
  void* dctx_ = nullptr;  // ZSTD_DCtx
  void* sha_ = nullptr;
  std::vector<char> in_, out_;
};

boost::json::object to_json(const ChunkList& l);
/// A list as to_json wrote it, or what is wrong with it (code bad_snapshot).
base::Result<ChunkList> chunk_list_from_json(const boost::json::value& v);

// ---- deltas: a snapshot for a store that has another (its base) ----
//
// A delta file is "SBXDELTA", a 4-byte little-endian header length, the header (JSON:
// {"format": "sandboxer.delta", "version": 1, "snapshot", "base", "list": <the snapshot's chunk
// list>, "included": [[sha256, compressed bytes], ...]}), then the compressed files of the
// included chunks in that order: the snapshot's chunks the base does not have.

inline constexpr std::string_view kDeltaMagic = "SBXDELTA";

/// Writes the delta of snapshot `id` (its list `list`) against `base` (its list `base_list`) from
/// the store at `dir` to `dst` (which must not exist); its size.
base::Result<uint64_t> write_delta(const std::string& dir, const std::string& id, const ChunkList& list,
                                   const std::string& base, const ChunkList& base_list, const std::string& dst);
/// The same for a receiver that said which chunks it has (snapshot.lacks): `lacks` has one bit
/// per chunk of `list`, in order, least significant bit first; a clear bit leaves that chunk out.
/// The delta's base is "". Errors: bad_request when `lacks` is not ceil(chunks / 8) bytes.
base::Result<uint64_t> write_delta_for(const std::string& dir, const std::string& id, const ChunkList& list,
                                       std::string_view lacks, const std::string& dst);

/// The length in bytes of a chunk hash as the chunk negotiation carries it (raw SHA-256).
inline constexpr size_t kRawHash = 32;
/// Which of `hashes` (kRawHash bytes each) the store at `dir` lacks: one bit per hash, in order,
/// least significant bit first, set when the store has no such chunk. A store that does not exist
/// lacks them all. Errors: bad_request when `hashes` is not a whole number of hashes.
struct Lacking {
  std::string bits;
  uint64_t count = 0;  // how many bits are set
};
base::Result<Lacking> lacking(const std::string& dir, std::string_view hashes);
/// The raw hashes (kRawHash bytes each) of chunks [from, from + count) of `list` (clamped to its
/// end), as snapshot.chunks sends them.
std::string raw_hashes(const ChunkList& list, size_t from, size_t count);

struct DeltaHeader {
  std::string snapshot, base;
  ChunkList list;
  std::vector<std::pair<std::string, uint64_t>> included;  // sha256, compressed bytes
  uint64_t body_offset = 0;                                // where the chunks begin
};

/// Whether the file at `path` begins as a delta does.
bool is_delta(const std::string& path);
/// The header of the delta at `path`, checked (code bad_snapshot).
base::Result<DeltaHeader> read_delta_header(const std::string& path);
/// Stores the delta's included chunks in the store at `dir`, each checked (zstd, size, hash)
/// before it is kept, then checks the store has every chunk of its list: else an error naming how
/// many are missing and the base to import first (code missing_base), or, for a delta of no base
/// (write_delta_for), that chunks this store said it had are gone (code missing_chunks). The
/// chunks it added.
base::Result<uint64_t> store_delta_chunks(const std::string& path, const DeltaHeader& h, const std::string& dir);

struct StoreUsage {
  uint64_t chunks = 0;
  uint64_t bytes = 0;  // the chunk files' sizes
};

/// Deletes every chunk of the store at `dir` not named in `live`, and any temporary a writer left
/// (call it only when no ChunkWriter is open on the store); what was removed and what remains.
base::Result<std::pair<StoreUsage, StoreUsage>> collect_garbage(const std::string& dir,
                                                                const std::unordered_set<std::string>& live);

/// What the store at `dir` holds.
StoreUsage store_usage(const std::string& dir);

}  // namespace sbx::archive
