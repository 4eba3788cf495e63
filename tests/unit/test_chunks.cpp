// The chunk store: content-defined boundaries, storage that grows with what changed, the archive
// written from chunks, garbage collection, and a damaged chunk found by its hash.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include "archive/archive.hpp"
#include "archive/chunks.hpp"
#include "archive/hash.hpp"
#include "temp-dir.hpp"

#include <zstd.h>

namespace fs = std::filesystem;
using namespace sbx::archive;

namespace {

// One per test case: its own directory, gone at the end.
struct TempDir : sbx::test::TempDir {
  TempDir() : sbx::test::TempDir("chunks-test") {}
};

std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(g());
  return s;
}

ChunkList store(const fs::path& dir, const std::string& data, size_t piece = 1 << 20) {
  auto w = ChunkWriter::open(dir.string(), 3);
  REQUIRE_MESSAGE(w.has_value(), w.error().message);
  for (size_t at = 0; at < data.size(); at += piece) {
    auto r = (*w)->write(data.data() + at, std::min(piece, data.size() - at));
    REQUIRE_MESSAGE(r.has_value(), r.error().message);
  }
  auto l = (*w)->finish();
  REQUIRE_MESSAGE(l.has_value(), l.error().message);
  return std::move(*l);
}

sbx::base::Result<std::string> read_back(const fs::path& dir, ChunkList l) {
  auto r = ChunkReader::open(dir.string(), std::move(l));
  if (!r) return r.error();
  std::string out;
  for (;;) {
    auto v = (*r)->next();
    if (!v) return v.error();
    if (v->empty()) return out;
    out.append(*v);
  }
}

}  // namespace

TEST_CASE("chunks: boundaries depend on content, so an insertion moves only the chunks around it") {
  std::string a = random_bytes(8 << 20, 1);
  std::string b = a;
  b.insert(3 << 20, "inserted bytes");
  auto cuts = [](const std::string& s) {
    std::vector<std::string> out;
    size_t at = 0;
    while (at < s.size()) {
      size_t n = chunk_boundary(reinterpret_cast<const unsigned char*>(s.data()) + at, s.size() - at, true);
      REQUIRE(n >= std::min(kChunkMin, s.size() - at));
      REQUIRE(n <= kChunkMax);
      out.push_back(s.substr(at, n));
      at += n;
    }
    return out;
  };
  auto ca = cuts(a), cb = cuts(b);
  CHECK(ca.size() > (8u << 20) / kChunkMax);  // cut well below the maximum on random data
  std::set<std::string> in_a(ca.begin(), ca.end());
  size_t shared = 0;
  for (auto& c : cb) shared += in_a.contains(c);
  CHECK(shared >= cb.size() - 3);  // the chunk with the insertion and at most its neighbours differ
}

TEST_CASE("chunks: a second stream that changed 1 MiB of 16 adds about 1 MiB, and reads back whole") {
  TempDir t;
  std::string a = random_bytes(16 << 20, 2);
  auto la = store(t.path, a);
  CHECK(la.bytes == a.size());
  CHECK(la.new_chunks == la.chunks.size());
  CHECK(la.added_bytes >= a.size());  // random bytes do not compress
  std::string b = a;
  std::string changed = random_bytes(1 << 20, 3);
  b.replace(5 << 20, changed.size(), changed);
  // Written in other pieces than the first: boundaries do not depend on how the bytes arrive.
  auto lb = store(t.path, b, 4096 * 3 + 17);
  CHECK(lb.added_bytes < (1u << 20) + 2 * kChunkMax + 4096);
  CHECK(lb.added_bytes >= (1u << 20));
  auto back = read_back(t.path, lb);
  REQUIRE_MESSAGE(back.has_value(), back.error().message);
  CHECK(*back == b);
  CHECK(store_usage(t.path).bytes == la.added_bytes + lb.added_bytes);

  SUBCASE("collecting with only the second list live frees exactly the first's own chunks") {
    std::unordered_set<std::string> live;
    for (auto& c : lb.chunks) live.insert(c.sha256);
    auto r = collect_garbage(t.path.string(), live);
    REQUIRE(r.has_value());
    CHECK(r->second.bytes == lb.stored_bytes);
    CHECK(r->first.bytes == la.added_bytes + lb.added_bytes - lb.stored_bytes);
    CHECK(read_back(t.path, lb).value() == b);
    auto gone = read_back(t.path, la);
    REQUIRE_FALSE(gone.has_value());
    CHECK(gone.error().message.find("is missing from the store") != std::string::npos);
  }
  SUBCASE("a damaged chunk is named by its hash; the list round-trips through JSON") {
    auto l = chunk_list_from_json(to_json(lb));
    REQUIRE(l.has_value());
    CHECK(l->chunks.size() == lb.chunks.size());
    const std::string& victim = lb.chunks[lb.chunks.size() / 2].sha256;
    fs::path f = t.path / victim.substr(0, 2) / victim;
    std::string z;
    {
      std::ifstream in(f, std::ios::binary);
      z.assign(std::istreambuf_iterator<char>(in), {});
    }
    z[z.size() / 2] ^= 0x01;
    std::ofstream(f, std::ios::binary | std::ios::trunc) << z;
    auto bad = read_back(t.path, *l);
    REQUIRE_FALSE(bad.has_value());
    CHECK(bad.error().code == "bad_snapshot");
    CHECK(bad.error().message.find("chunk " + victim + " is corrupted") != std::string::npos);
  }
}

TEST_CASE("chunks: a damaged list is refused with what is wrong") {
  auto bad = [](const char* text) {
    auto r = chunk_list_from_json(boost::json::parse(text));
    REQUIRE_FALSE(r.has_value());
    return r.error().message;
  };
  CHECK(bad(R"({"format": "other"})").find("no format") != std::string::npos);
  std::string h(64, 'a');
  CHECK(bad((R"({"format": "sandboxer.chunks", "sha256": ")" + h + R"(", "bytes": 5, "chunks": [[")" + h + R"(", 4]]})")
                .c_str())
            .find("add up to 4 bytes, not 5") != std::string::npos);
  CHECK(
      bad((R"({"format": "sandboxer.chunks", "sha256": ")" + h + R"(", "bytes": 1, "chunks": [["../x", 1]]})").c_str())
          .find("not [sha256, size]") != std::string::npos);
}

TEST_CASE("chunks: a snapshot written to the store extracts, and its archive rebuilt from chunks is the same stream") {
  TempDir t;
  fs::create_directories(t.path / "src/criu");
  fs::create_directories(t.path / "src/fs/workspace");
  std::ofstream(t.path / "src/criu/pages-1.img", std::ios::binary) << random_bytes(3 << 20, 4);
  std::ofstream(t.path / "src/fs/workspace/a.txt") << "hello";
  auto key = SigningKey::generate();
  REQUIRE(key.has_value());
  ImportPolicy trust;
  trust.trusted.push_back(key->public_key());
  auto w = ChunkWriter::open((t.path / "store").string(), 3, true);  // with the stream's hash
  REQUIRE(w.has_value());
  boost::json::object m{{"format", kFormatName}, {"format_version", kFormatVersion}};
  auto info = write_snapshot((t.path / "src").string(), m, {"", w->get()}, 3, &*key);
  REQUIRE_MESSAGE(info.has_value(), info.error().message);
  REQUIRE(info->chunks.has_value());
  CHECK_FALSE(fs::exists(t.path / "a.tar.zst"));  // no archive file, and no archive compressed
  CHECK(info->sha256.empty());
  CHECK(info->manifest_sha256.size() == 64);
  CHECK(info->chunks->manifest_sha256 == info->manifest_sha256);  // the id
  CHECK(info->chunks->archive_sha256.empty());

  auto x = extract_chunks((t.path / "store").string(), *info->chunks, (t.path / "out").string(), trust);
  REQUIRE_MESSAGE(x.has_value(), x.error().message);
  CHECK(x->trusted);
  std::ifstream in(t.path / "out/fs/workspace/a.txt");
  CHECK(std::string(std::istreambuf_iterator<char>(in), {}) == "hello");

  auto rebuilt = rebuild_archive((t.path / "store").string(), *info->chunks, (t.path / "a.tar.zst").string(), 3);
  REQUIRE_MESSAGE(rebuilt.has_value(), rebuilt.error().message);
  // The export names the snapshot: its manifest is the one the id is the hash of.
  CHECK(rebuilt->sha256 == sha256_file((t.path / "a.tar.zst").string()).value());
  CHECK(archive_id((t.path / "a.tar.zst").string()).value() == snapshot_id_of(info->manifest_sha256));
  {
    // The list's hash is the tar stream's: the archive's bytes decompressed.
    std::ifstream zf(t.path / "a.tar.zst", std::ios::binary);
    std::string z((std::istreambuf_iterator<char>(zf)), {});
    std::string tar(8u << 20, '\0');
    size_t n = ZSTD_decompress(tar.data(), tar.size(), z.data(), z.size());
    REQUIRE_FALSE(ZSTD_isError(n));
    Sha256 h;
    h.update(tar.data(), n);
    CHECK(h.hex() == info->chunks->sha256);
  }
  auto y = extract_archive((t.path / "a.tar.zst").string(), (t.path / "out2").string(), trust);
  REQUIRE_MESSAGE(y.has_value(), y.error().message);
  SUBCASE("a list whose stream hash is not its chunks' is refused at the end of the stream") {
    auto l = *info->chunks;
    l.sha256 = std::string(64, '0');
    auto bad = extract_chunks((t.path / "store").string(), l, (t.path / "out3").string(), trust);
    REQUIRE_FALSE(bad.has_value());
    CHECK(bad.error().message.find("hashes to " + info->chunks->sha256 + ", not 000") != std::string::npos);
    CHECK_FALSE(fs::exists(t.path / "out3"));
    auto again = rebuild_archive((t.path / "store").string(), l, (t.path / "c.tar.zst").string(), 3);
    REQUIRE_FALSE(again.has_value());
    CHECK(again.error().message.find("hashes to " + info->chunks->sha256 + ", not 000") != std::string::npos);
    CHECK_FALSE(fs::exists(t.path / "c.tar.zst"));
  }
  SUBCASE("a format-2 list's archive that does not come out as its id is refused, and removed") {
    auto l = *info->chunks;
    l.manifest_sha256.clear();
    l.archive_sha256 = std::string(64, '0');
    auto wrong = rebuild_archive((t.path / "store").string(), l, (t.path / "b.tar.zst").string(), 3);
    REQUIRE_FALSE(wrong.has_value());
    CHECK(wrong.error().message.find("hashes to " + rebuilt->sha256 + ", not 000") != std::string::npos);
    CHECK_FALSE(fs::exists(t.path / "b.tar.zst"));
  }
  // The file exists already: refused, not overwritten.
  CHECK_FALSE(
      rebuild_archive((t.path / "store").string(), *info->chunks, (t.path / "a.tar.zst").string(), 3).has_value());
}

TEST_CASE("chunks: a format-3 snapshot's list needs no stream hash: its manifest's names it") {
  TempDir t;
  fs::create_directories(t.path / "src/criu");
  std::ofstream(t.path / "src/criu/pages-1.img", std::ios::binary) << random_bytes(1 << 20, 5);
  auto key = SigningKey::generate();
  REQUIRE(key.has_value());
  ImportPolicy trust;
  trust.trusted.push_back(key->public_key());
  auto w = ChunkWriter::open((t.path / "store").string(), 3, false);
  REQUIRE(w.has_value());
  boost::json::object m{{"format", kFormatName}, {"format_version", kFormatVersion}};
  auto info = write_snapshot((t.path / "src").string(), m, {"", w->get()}, 3, &*key);
  REQUIRE_MESSAGE(info.has_value(), info.error().message);
  CHECK(info->chunks->sha256.empty());
  auto json = to_json(*info->chunks);
  CHECK_FALSE(json.contains("sha256"));
  auto back = chunk_list_from_json(json);
  REQUIRE_MESSAGE(back.has_value(), back.error().message);
  CHECK(back->manifest_sha256 == info->manifest_sha256);
  auto x = extract_chunks((t.path / "store").string(), *back, (t.path / "out").string(), trust);
  REQUIRE_MESSAGE(x.has_value(), x.error().message);
  CHECK(x->manifest_sha256 == info->manifest_sha256);
  // Without either hash a list names nothing: refused.
  json.erase("manifest_sha256");
  auto bad = chunk_list_from_json(json);
  REQUIRE_FALSE(bad.has_value());
  CHECK(bad.error().message == "the chunk list is damaged: sha256");
  // A chunk changed in the store is still found, by its own hash.
  auto first = info->chunks->chunks.front().sha256;
  auto path = t.path / "store" / first.substr(0, 2) / first;
  std::string other = random_bytes(info->chunks->chunks.front().size, 6);
  std::string z(ZSTD_compressBound(other.size()), '\0');
  z.resize(ZSTD_compress(z.data(), z.size(), other.data(), other.size(), 3));
  fs::permissions(path, fs::perms::owner_write, fs::perm_options::add);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << z;
  auto damaged = extract_chunks((t.path / "store").string(), *back, (t.path / "out2").string(), trust);
  REQUIRE_FALSE(damaged.has_value());
  CHECK(damaged.error().message.find("chunk " + first + " is corrupted: it hashes to ") != std::string::npos);
  CHECK_FALSE(fs::exists(t.path / "out2"));
}

TEST_CASE("chunks: a delta carries only what its base lacks, and a crafted one is refused with the reason") {
  TempDir t;
  std::string a = random_bytes(4 << 20, 7);
  std::string b = a;
  std::string changed = random_bytes(256 << 10, 8);
  b.replace(1 << 20, changed.size(), changed);
  auto la = store(t.path / "src", a);
  auto lb = store(t.path / "src", b);
  la.manifest_sha256 = std::string(64, 'a');
  lb.manifest_sha256 = std::string(64, 'b');
  auto size = write_delta((t.path / "src").string(), "s-bbbbbbbbbbbbbbbb", lb, "s-aaaaaaaaaaaaaaaa", la,
                          (t.path / "d").string());
  REQUIRE_MESSAGE(size.has_value(), size.error().message);
  CHECK(*size < (256u << 10) + 2 * kChunkMax + 64 * 1024);
  CHECK(is_delta((t.path / "d").string()));
  auto h = read_delta_header((t.path / "d").string());
  REQUIRE_MESSAGE(h.has_value(), h.error().message);
  CHECK(h->base == "s-aaaaaaaaaaaaaaaa");
  CHECK(h->list.chunks.size() == lb.chunks.size());

  // A store without the base: refused, naming the base to import first.
  auto early = store_delta_chunks((t.path / "d").string(), *h, (t.path / "dst").string());
  REQUIRE_FALSE(early.has_value());
  CHECK(early.error().code == "missing_base");
  CHECK(early.error().message.find("import s-aaaaaaaaaaaaaaaa first") != std::string::npos);
  // With the base: every chunk is there, and the stream reads back.
  store(t.path / "dst", a);
  auto added = store_delta_chunks((t.path / "d").string(), *h, (t.path / "dst").string());
  REQUIRE_MESSAGE(added.has_value(), added.error().message);
  CHECK(read_back(t.path / "dst", lb).value() == b);

  auto crafted = [&](auto edit) {
    std::string bytes;
    {
      std::ifstream in(t.path / "d", std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    edit(bytes);
    std::ofstream(t.path / "e", std::ios::binary | std::ios::trunc) << bytes;
    auto hh = read_delta_header((t.path / "e").string());
    if (!hh) return hh.error().message;
    fs::remove_all(t.path / "fresh");
    store(t.path / "fresh", a);
    auto r = store_delta_chunks((t.path / "e").string(), *hh, (t.path / "fresh").string());
    return r ? std::string() : r.error().message;
  };
  CHECK(crafted([](std::string& s) { s[11] = '\x7f'; }).find("header length") != std::string::npos);
  CHECK(crafted([](std::string& s) { s.resize(s.size() - 10); }).find("ends inside chunk") != std::string::npos);
  CHECK(crafted([](std::string& s) { s += "x"; }).find("bytes follow its last chunk") != std::string::npos);
  CHECK(crafted([](std::string& s) { s[s.size() - 100] ^= 0x20; }).find("is corrupted") != std::string::npos);
  CHECK(crafted([](std::string& s) { s.replace(0, 8, "NOTDELTA"); }).find("does not begin with") != std::string::npos);
  // The corrupted chunk was not kept.
  for (auto& c : lb.chunks) {
    fs::path f = t.path / "fresh" / c.sha256.substr(0, 2) / c.sha256;
    if (!fs::exists(f)) continue;
    std::ifstream in(f, std::ios::binary);
    std::string z((std::istreambuf_iterator<char>(in)), {});
    std::string out(kChunkMax, '\0');
    size_t n = ZSTD_decompress(out.data(), out.size(), z.data(), z.size());
    REQUIRE_FALSE(ZSTD_isError(n));
  }
}

TEST_CASE("chunks: a receiver says which chunks it lacks, and a delta for it carries exactly those") {
  TempDir t;
  std::string a = random_bytes(4 << 20, 9);
  std::string b = a;
  std::string changed = random_bytes(256 << 10, 10);
  b.replace(2 << 20, changed.size(), changed);
  auto la = store(t.path / "dst", a);  // the receiver has a's chunks, under no snapshot of the sender
  auto lb = store(t.path / "src", b);
  lb.manifest_sha256 = std::string(64, 'b');
  auto asked = lacking((t.path / "dst").string(), raw_hashes(lb, 0, lb.chunks.size()));
  REQUIRE_MESSAGE(asked.has_value(), asked.error().message);
  CHECK(asked->bits.size() == (lb.chunks.size() + 7) / 8);
  std::set<std::string> have;
  for (auto& c : la.chunks) have.insert(c.sha256);
  uint64_t expect = 0;
  for (size_t i = 0; i < lb.chunks.size(); ++i) {
    bool lacks = (static_cast<unsigned char>(asked->bits[i / 8]) >> (i % 8)) & 1;
    CHECK(lacks == !have.contains(lb.chunks[i].sha256));
    expect += lacks;
  }
  CHECK(asked->count == expect);
  CHECK(expect > 0);
  CHECK(expect < lb.chunks.size() / 2);
  // A store that does not exist lacks everything; hashes that are not whole are refused.
  auto none = lacking((t.path / "nowhere").string(), raw_hashes(lb, 0, 3));
  REQUIRE(none.has_value());
  CHECK(none->count == 3);
  CHECK(none->bits == std::string(1, '\x07'));
  CHECK(lacking((t.path / "dst").string(), std::string(33, 'x')).error().code == "bad_request");
  // raw_hashes clamps to the list's end.
  CHECK(raw_hashes(lb, lb.chunks.size() - 1, 10).size() == kRawHash);

  auto size =
      write_delta_for((t.path / "src").string(), "s-bbbbbbbbbbbbbbbb", lb, asked->bits, (t.path / "d").string());
  REQUIRE_MESSAGE(size.has_value(), size.error().message);
  auto h = read_delta_header((t.path / "d").string());
  REQUIRE_MESSAGE(h.has_value(), h.error().message);
  CHECK(h->base.empty());
  std::set<std::string> included;
  for (auto& [sha, n] : h->included) included.insert(sha);
  for (size_t i = 0; i < lb.chunks.size(); ++i)
    CHECK(included.contains(lb.chunks[i].sha256) == !have.contains(lb.chunks[i].sha256));
  auto added = store_delta_chunks((t.path / "d").string(), *h, (t.path / "dst").string());
  REQUIRE_MESSAGE(added.has_value(), added.error().message);
  CHECK(read_back(t.path / "dst", lb).value() == b);

  // A receiver whose chunks went since it answered: refused, saying so (no base to name).
  auto empty = store_delta_chunks((t.path / "d").string(), *h, (t.path / "elsewhere").string());
  REQUIRE_FALSE(empty.has_value());
  CHECK(empty.error().code == "missing_chunks");
  CHECK(empty.error().message.find("send it again") != std::string::npos);
  // A bitmap of the wrong length is refused.
  auto wrong = write_delta_for((t.path / "src").string(), "s-bbbbbbbbbbbbbbbb", lb, "\x01", (t.path / "d2").string());
  REQUIRE_FALSE(wrong.has_value());
  CHECK(wrong.error().code == "bad_request");
}
