#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "journal/journal.hpp"
#include "os/sys.hpp"
#include "temp-dir.hpp"

namespace journal = sbx::journal;

using namespace sbx::journal;
namespace fs = std::filesystem;

namespace {
struct LoopFixture {
  uv_loop_t loop;
  fs::path dir;
  LoopFixture() {
    uv_loop_init(&loop);
    dir = fs::temp_directory_path() / ("sbx-journal-" + sbx::os::random_hex(4));
  }
  ~LoopFixture() {
    uv_run(&loop, UV_RUN_DEFAULT);
    CHECK(uv_loop_close(&loop) == 0);  // no handle leaked
    fs::remove_all(dir);
  }
  std::vector<std::pair<uint64_t, std::string>> read_all(uint64_t since = 0) {
    std::vector<std::pair<uint64_t, std::string>> out;
    auto r = journal::Journal::read(dir.string(), since, [&](uint64_t s, std::string_view l) {
      out.emplace_back(s, std::string(l));
      return true;
    });
    REQUIRE(r);
    return out;
  }
  // Opens the journal again (its recovery), checks where its seq continues, appends one event, and
  // returns every line then on disk.
  std::vector<std::pair<uint64_t, std::string>> reopen_and_append(uint64_t last) {
    {
      auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
      REQUIRE(j);
      CHECK((*j)->last_seq() == last);
      (*j)->append({{"type", "after"}});
    }
    return read_all();
  }
  static std::vector<uint64_t> seqs_of(const std::vector<std::pair<uint64_t, std::string>>& all) {
    std::vector<uint64_t> seqs;
    for (auto& [s, l] : all) seqs.push_back(s);
    return seqs;
  }
};
}  // namespace

TEST_CASE_FIXTURE(LoopFixture, "journal: seq is strictly increasing across sealed segments") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test", .segment_bytes = 4096});
    REQUIRE(j);
    int seen = 0;
    (*j)->add_listener([&](const journal::Event& e) { CHECK(e.seq == static_cast<uint64_t>(++seen)); });
    for (int i = 0; i < 500; ++i) (*j)->append({{"type", "t"}, {"i", i}});
    (*j)->flush();
  }
  auto all = read_all();
  REQUIRE(all.size() == 500);
  for (size_t i = 0; i < all.size(); ++i) CHECK(all[i].first == i + 1);
  bool compressed = false;
  for (auto& e : fs::directory_iterator(dir)) compressed |= e.path().string().ends_with(".zst");
  CHECK(compressed);
  CHECK(read_all(490).size() == 10);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a torn tail is dropped and reported, seq continues") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
    REQUIRE(j);
    for (int i = 0; i < 3; ++i) (*j)->append({{"type", "t"}});
  }
  // Simulate a crash mid-write.
  fs::path seg;
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".jsonl") seg = e.path();
  {
    int fd = ::open(seg.c_str(), O_WRONLY | O_APPEND);
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, "{\"seq\":4,\"ts\":\"x", 16) == 16);
    ::close(fd);
  }
  auto all = reopen_and_append(3);
  REQUIRE(all.size() == 5);
  CHECK(all[3].second.find("journal.recovered") != std::string::npos);
  CHECK(all[3].second.find("\"dropped_bytes\":16") != std::string::npos);
  CHECK(all[4].first == 5);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: recovery skips an unreadable line and keeps every event after it") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
    REQUIRE(j);
    for (int i = 0; i < 5; ++i) (*j)->append({{"type", "t"}, {"i", i}});
  }
  fs::path seg;
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".jsonl") seg = e.path();
  auto text = sbx::os::read_file(seg.string());
  REQUIRE(text);
  // Damage the second line in place (a bad block): same length, no longer JSON.
  size_t second = text->find('\n') + 1;
  size_t end = text->find('\n', second);
  for (size_t i = second + 10; i < end; ++i) (*text)[i] = '#';
  REQUIRE(sbx::os::write_file_atomic(seg.string(), *text));
  auto all = reopen_and_append(5);
  // 2 is gone; 3, 4 and 5 stay (before: recovery cut the segment at the bad line); the report
  // takes 6.
  CHECK(seqs_of(all) == std::vector<uint64_t>{1, 3, 4, 5, 6, 7});
  CHECK(all[4].second.find("\"skipped_lines\":1") != std::string::npos);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: recovery skips a bad line and cuts a torn tail in one pass") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
    REQUIRE(j);
    for (int i = 0; i < 4; ++i) (*j)->append({{"type", "t"}, {"i", i}});
  }
  fs::path seg = dir / "00000000000000000001.jsonl";
  auto text = sbx::os::read_file(seg.string());
  REQUIRE(text);
  // Line 3 damaged in place (its seq still readable: only a parse finds it), then a torn write.
  size_t third = text->find('\n', text->find('\n') + 1) + 1;
  size_t end = text->find('\n', third);
  (*text)[end - 1] = ',';
  size_t bad = end - third + 1;
  *text += "{\"seq\":5,\"ts\":";
  REQUIRE(sbx::os::write_file_atomic(seg.string(), *text));
  auto all = reopen_and_append(4);
  CHECK(seqs_of(all) == std::vector<uint64_t>{1, 2, 4, 5, 6});
  CHECK(all[3].second.find("\"dropped_bytes\":" + std::to_string(bad + 14)) != std::string::npos);
  CHECK(all[3].second.find("\"skipped_lines\":1") != std::string::npos);
  // The rewritten segment is whole lines only.
  auto after = sbx::os::read_file(seg.string());
  REQUIRE(after);
  CHECK(after->back() == '\n');
  CHECK(after->find("\"i\":2") == std::string::npos);
}

namespace {
// The active segment of `dir` (its first), with the first `from` in it replaced by `to`: damage on
// disk, found by the next open's line-by-line check (a new inode: the last run's note of its clean
// end no longer matches).
void damage_segment(const fs::path& dir, std::string_view from, std::string_view to) {
  fs::path seg = dir / "00000000000000000001.jsonl";
  auto text = sbx::os::read_file(seg.string());
  REQUIRE(text);
  size_t at = text->find(from);
  REQUIRE(at != std::string::npos);
  text->replace(at, from.size(), to);
  REQUIRE(sbx::os::write_file_atomic(seg.string(), *text));
}

std::vector<uint64_t> seq_range(uint64_t from, uint64_t to) {
  std::vector<uint64_t> out;
  for (uint64_t s = from; s <= to; ++s) out.push_back(s);
  return out;
}

std::vector<uint64_t> operator+(std::vector<uint64_t> a, const std::vector<uint64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The journal.recovered event among `all`.
boost::json::object recovered_of(const std::vector<std::pair<uint64_t, std::string>>& all) {
  for (auto& [s, l] : all) {
    auto v = boost::json::parse(l).as_object();
    if (v.at("type") != "journal.recovered") continue;
    CHECK(v.at("branch") == "main");  // every event has one
    return v;
  }
  FAIL("no journal.recovered");
  return {};
}

// Its `skipped` list, {line, seq, reason} of each dropped line, as JSON text.
std::string skipped_of(const std::vector<std::pair<uint64_t, std::string>>& all) {
  auto rec = recovered_of(all);
  auto* list = rec.if_contains("skipped");
  return list ? boost::json::serialize(*list) : "(none)";
}
}  // namespace

TEST_CASE_FIXTURE(LoopFixture, "journal: recovery drops a line whose seq jumped ahead and keeps every event after it") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
    REQUIRE(j);
    for (int i = 0; i < 32; ++i) (*j)->append({{"type", "t"}, {"i", i}});
  }
  // One bit flipped on disk (1 is 0x31, 9 is 0x39): line 10 now says seq 90. Before, recovery kept
  // that line and dropped the 22 good ones after it (none above 90), and numbering went on at 91.
  damage_segment(dir, "{\"seq\":10,", "{\"seq\":90,");
  auto all = reopen_and_append(32);
  CHECK(seqs_of(all) == seq_range(1, 9) + seq_range(11, 34));
  CHECK(recovered_of(all).at("skipped_lines") == 1);
  CHECK(skipped_of(all) == R"([{"line":10,"seq":90,"reason":"out_of_order"}])");
}

TEST_CASE_FIXTURE(LoopFixture, "journal: recovery drops only the damaged lines, whichever way a seq went") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
    REQUIRE(j);
    for (int i = 0; i < 32; ++i) (*j)->append({{"type", "t"}, {"i", i}});
  }
  SUBCASE("ahead by one, then the old sequence again (5 read as 7: 4, 7, 6, 7, 8)") {
    // Before: the damaged 7 was kept, and the good 6 and 7 after it dropped.
    damage_segment(dir, "{\"seq\":5,", "{\"seq\":7,");
    auto all = reopen_and_append(32);
    CHECK(seqs_of(all) == seq_range(1, 4) + seq_range(6, 34));
    CHECK(skipped_of(all) == R"([{"line":5,"seq":7,"reason":"duplicate"}])");
  }
  SUBCASE("back to a seq seen before (20 read as 12)") {
    damage_segment(dir, "{\"seq\":20,", "{\"seq\":12,");
    auto all = reopen_and_append(32);
    CHECK(seqs_of(all) == seq_range(1, 19) + seq_range(21, 34));
    CHECK(skipped_of(all) == R"([{"line":20,"seq":12,"reason":"duplicate"}])");
  }
  SUBCASE("back below the segment's first seq (10 read as 0)") {
    damage_segment(dir, "{\"seq\":10,", "{\"seq\":0,");
    auto all = reopen_and_append(32);
    CHECK(seqs_of(all) == seq_range(1, 9) + seq_range(11, 34));
    CHECK(skipped_of(all) == R"([{"line":10,"seq":0,"reason":"out_of_order"}])");
  }
  SUBCASE("the last line ahead: kept, as nothing tells it from a jump the journal made") {
    damage_segment(dir, "{\"seq\":32,", "{\"seq\":72,");
    auto all = reopen_and_append(72);
    CHECK(seqs_of(all) == seq_range(1, 31) + std::vector<uint64_t>{72, 73});
  }
  SUBCASE("two lines ahead, one unreadable and a torn tail, at once") {
    damage_segment(dir, "{\"seq\":3,", "{\"seq\":93,");
    damage_segment(dir, "{\"seq\":17,", "{\"seq\":97,");
    damage_segment(dir, "{\"seq\":25,", "{\"seq\":25#");
    int fd = ::open((dir / "00000000000000000001.jsonl").c_str(), O_WRONLY | O_APPEND);
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, "{\"seq\":33,\"ts\":\"x", 16) == 16);
    ::close(fd);
    auto all = reopen_and_append(32);
    CHECK(seqs_of(all) == seq_range(1, 2) + seq_range(4, 16) + seq_range(18, 24) + seq_range(26, 34));
    CHECK(skipped_of(all) ==
          R"([{"line":3,"seq":93,"reason":"out_of_order"},{"line":17,"seq":97,"reason":"out_of_order"},)"
          R"({"line":25,"seq":25,"reason":"unreadable"}])");
    CHECK(recovered_of(all).at("skipped_lines") == 3);
  }
}

TEST_CASE_FIXTURE(LoopFixture, "journal: recovery keeps a jump ahead the journal made itself") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
    REQUIRE(j);
    for (int i = 0; i < 5; ++i) (*j)->append({{"type", "t"}});
    (*j)->skip_to(100);  // a box restored from an archive continues its parent's seq
    for (int i = 0; i < 3; ++i) (*j)->append({{"type", "t"}});
  }
  // No note of a clean end (a run that was killed): every line is checked.
  auto hwm = sbx::os::read_file((dir / "seq.hwm").string());
  REQUIRE(hwm);
  REQUIRE(sbx::os::write_file_atomic((dir / "seq.hwm").string(), hwm->substr(0, 21)));
  auto all = reopen_and_append(103);
  CHECK(seqs_of(all) == seq_range(1, 5) + seq_range(101, 104));
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a restart after a compressed newest segment continues after its last line") {
  const std::string pad(1000, 'x');
  uint64_t last = 0;
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test", .segment_bytes = 2u << 20});
    REQUIRE(j);
    // Up to the append that seals the first segment: the newest is then compressed, in frames of
    // ~512 KiB, and no second segment is open.
    do last = (*j)->append({{"type", "t"}, {"pad", pad}});
    while (fs::file_size(dir / "00000000000000000001.jsonl") < (2u << 20));
    (*j)->flush();
  }
  REQUIRE(fs::exists(dir / "00000000000000000001.jsonl.zst"));
  REQUIRE(!fs::exists(dir / "00000000000000000001.jsonl"));
  REQUIRE(last > 1000);  // 2 MiB: four frames
  auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test", .segment_bytes = 2u << 20});
  REQUIRE(j);
  CHECK((*j)->last_seq() == last);
  CHECK((*j)->append({{"type", "t"}}) == last + 1);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: seq never goes back below the high-water mark") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
    REQUIRE(j);
    (*j)->append({{"type", "t"}});
  }
  // A run handed out seqs up to 40 to events that waited for a full disk and died with them.
  REQUIRE(sbx::os::write_file_atomic((dir / "seq.hwm").string(), "00000000000000000040\n"));
  auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test"});
  REQUIRE(j);
  CHECK((*j)->last_seq() == 40);
  CHECK((*j)->append({{"type", "t"}}) == 41);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: the disk cap drops the oldest sealed segments and says so") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b", .segment_bytes = 2048, .disk_cap = 4096});
    REQUIRE(j);
    for (int i = 0; i < 2000; ++i) {
      (*j)->append({{"type", "t"}, {"pad", sbx::os::random_hex(32)}});
      if (i % 100 == 0) uv_run(&loop, UV_RUN_NOWAIT);
    }
    (*j)->flush();
    (*j)->append({{"type", "last"}});
  }
  auto all = read_all();
  REQUIRE_FALSE(all.empty());
  CHECK(all.front().first > 1);
  bool truncated = false;
  for (auto& [s, l] : all) truncated |= l.find("journal.truncated") != std::string::npos;
  CHECK(truncated);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a read resumes where the last one stopped, in plain and sealed segments") {
  auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test", .segment_bytes = 8192});
  REQUIRE(j);
  for (int i = 0; i < 300; ++i) (*j)->append({{"type", "t"}, {"i", i}});
  // In steps of 7 events from a position, as a client catching up reads: every seq once, in
  // order, across segments compressed meanwhile.
  journal::Journal::ReadPos pos;
  uint64_t since = 0;
  std::vector<uint64_t> got;
  for (int step = 0; since < 300; ++step) {
    int n = 0;
    auto r = journal::Journal::read(
        dir.string(), since,
        [&](uint64_t s, std::string_view) {
          got.push_back(s);
          since = s;
          return ++n < 7;
        },
        &pos);
    REQUIRE(r);
    if (step == 10) (*j)->flush();  // let the sealed segments be compressed
    if (step == 5) (*j)->append({{"type", "t"}, {"late", true}});
  }
  REQUIRE(got.size() >= 300);
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == i + 1);
  CHECK(pos.segment > 0);  // the last read ended in the plain active segment
  // A position is only good for a since at or after it: from an earlier since, without it.
  auto again = read_all(3);
  CHECK(again.front().first == 4);
  (*j)->flush();
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a compressed segment is read on from the frame of the last line") {
  auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test", .segment_bytes = 2u << 20});
  REQUIRE(j);
  const std::string pad(1000, 'x');
  for (int i = 0; i < 2500; ++i) (*j)->append({{"type", "t"}, {"i", i}, {"pad", pad}});
  (*j)->flush();  // the first segment (2 MiB) sealed and compressed
  REQUIRE(std::filesystem::exists(dir / "00000000000000000001.jsonl.zst"));
  journal::Journal::ReadPos pos;
  uint64_t since = 0, zst_resumes = 0;
  std::vector<uint64_t> got;
  while (since < 2500) {
    if (pos.zst && pos.offset > 0) ++zst_resumes;
    int n = 0;
    REQUIRE(journal::Journal::read(
        dir.string(), since,
        [&](uint64_t s, std::string_view l) {
          CHECK(l.find("\"pad\"") != std::string_view::npos);
          got.push_back(s);
          since = s;
          return ++n < 100;
        },
        &pos));
  }
  REQUIRE(got.size() == 2500);
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == i + 1);
  // Frames of ~512 KiB in a 2 MiB segment: reads after the first frame start past it.
  CHECK(zst_resumes >= 10);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a listener gets the line in place after the headroom, as written") {
  {
    auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test", .headroom = 16});
    REQUIRE(j);
    std::vector<std::string> seen;
    (*j)->add_listener([&](const journal::Event& e) {
      CHECK(e.headroom == 16);
      CHECK(e.buf->size() == 16 + e.line.size());
      CHECK(e.line.data() == e.buf->data() + 16);  // the same bytes, not a copy
      seen.emplace_back(e.line);
    });
    (*j)->append({{"type", "proc.output"}, {"data", "a\nb\t\"c\"\n"}});
    (*j)->append({{"type", "x"}});
    REQUIRE(seen.size() == 2);
    auto lines = read_all();
    REQUIRE(lines.size() == 2);
    CHECK(lines[0].second == seen[0]);
    CHECK(lines[1].second == seen[1]);
    CHECK(boost::json::parse(seen[0]).at("data") == "a\nb\t\"c\"\n");
  }
}

namespace {
// The sealed segments of `dir`, plain and compressed, by name: a segment whose .zst exists counts
// as compressed even while its plain file is still there (renamed, not yet unlinked).
std::pair<int, int> sealed_counts(const fs::path& dir) {
  std::set<std::string> plain, zst;
  for (auto& e : fs::directory_iterator(dir)) {
    auto n = e.path().filename().string();
    if (n.ends_with(".jsonl.zst")) zst.insert(n.substr(0, n.size() - 10));
    if (n.ends_with(".jsonl")) plain.insert(n.substr(0, n.size() - 6));
  }
  for (auto& z : zst) plain.erase(z);
  return {static_cast<int>(plain.size()) - 1, static_cast<int>(zst.size())};  // less the active segment
}

std::string counts(const fs::path& dir) {
  auto [plain, zst] = sealed_counts(dir);
  return std::to_string(plain) + " plain, " + std::to_string(zst) + " zst";
}

// Appends events of ~100 bytes until `segments` more segments (of 4096 bytes) were sealed, and one
// after them.
void seal(journal::Journal& j, const fs::path& dir, int segments) {
  auto [p0, z0] = sealed_counts(dir);
  while (sealed_counts(dir).first + sealed_counts(dir).second < p0 + z0 + segments)
    j.append({{"type", "t"}, {"pad", sbx::os::random_hex(40)}});
  j.append({{"type", "t"}});  // a new active segment (one is opened at the first line after a seal)
}
}  // namespace

TEST_CASE_FIXTURE(LoopFixture, "journal: sealed segments wait for a quiet turn of the loop to be compressed") {
  auto j =
      journal::Journal::open(&loop, {.dir = dir.string(), .box = "b", .segment_bytes = 4096, .compress_quiet_ms = 50});
  REQUIRE(j);
  (*j)->append({{"type", "first"}});  // the active segment, which sealed_counts leaves out
  seal(**j, dir, 2);
  // Lines keep coming: every turn of the quiet timer sees new ones, and nothing is compressed.
  for (int i = 0; i < 20; ++i) {
    (*j)->append({{"type", "t"}, {"i", i}});
    uv_run(&loop, UV_RUN_NOWAIT);
    ::usleep(10000);
  }
  CHECK(counts(dir) == "2 plain, 0 zst");
  // Quiet: compressed on the thread pool after a turn with no line written.
  for (int i = 0; i < 500 && sealed_counts(dir).second < 2; ++i) {
    uv_run(&loop, UV_RUN_NOWAIT);
    ::usleep(10000);
  }
  CHECK(counts(dir) == "0 plain, 2 zst");
  (*j)->flush();
  j->reset();
}

TEST_CASE_FIXTURE(LoopFixture, "journal: past four sealed segments waiting, they are compressed without a quiet turn") {
  // A quiet turn would take a minute: whatever is compressed here was not waiting for one.
  auto j = journal::Journal::open(&loop,
                                  {.dir = dir.string(), .box = "b", .segment_bytes = 4096, .compress_quiet_ms = 60000});
  REQUIRE(j);
  (*j)->append({{"type", "first"}});
  seal(**j, dir, 4);
  for (int i = 0; i < 20; ++i) {  // control: four wait
    uv_run(&loop, UV_RUN_NOWAIT);
    ::usleep(5000);
  }
  CHECK(counts(dir) == "4 plain, 0 zst");
  seal(**j, dir, 1);
  for (int i = 0; i < 500 && sealed_counts(dir).second < 5; ++i) {
    uv_run(&loop, UV_RUN_NOWAIT);
    ::usleep(10000);
  }
  CHECK(counts(dir) == "0 plain, 5 zst");
  // The end compresses what still waits.
  seal(**j, dir, 1);
  CHECK(counts(dir) == "1 plain, 5 zst");
  (*j)->flush();
  CHECK(counts(dir) == "0 plain, 6 zst");
  j->reset();
}

namespace {
// The note of a clean end: the second line of seq.hwm ("" when there is none).
std::string clean_note(const fs::path& dir) {
  auto text = sbx::os::read_file((dir / "seq.hwm").string());
  REQUIRE(text);
  return text->size() > 21 ? text->substr(21) : std::string();
}

// `n` events in a journal closed cleanly: the path of its active segment.
fs::path write_and_close(uv_loop_t* loop, const fs::path& dir, int n) {
  auto j = journal::Journal::open(loop, {.dir = dir.string(), .box = "b-test"});
  REQUIRE(j);
  for (int i = 0; i < n; ++i) (*j)->append({{"type", "t"}, {"i", i}});
  return dir / "00000000000000000001.jsonl";
}
}  // namespace

TEST_CASE_FIXTURE(LoopFixture,
                  "journal: a clean end leaves a note the next open trusts instead of checking each line") {
  fs::path seg = write_and_close(&loop, dir, 4);
  REQUIRE(!clean_note(dir).empty());
  // Line 2 damaged in place (same inode, same length, its mtime put back): only a line-by-line
  // check would find it. With the note, the open does not look: seq goes on after 4, no report.
  struct stat before {};
  REQUIRE(::stat(seg.c_str(), &before) == 0);
  auto damage = [&] {
    auto text = sbx::os::read_file(seg.string());
    REQUIRE(text);
    size_t second = text->find('\n') + 1;
    int fd = ::open(seg.c_str(), O_WRONLY);
    REQUIRE(fd >= 0);
    REQUIRE(::pwrite(fd, "#####", 5, static_cast<off_t>(second + 12)) == 5);
    ::close(fd);
    timespec times[2] = {before.st_atim, before.st_mtim};
    REQUIRE(::utimensat(AT_FDCWD, seg.c_str(), times, 0) == 0);
  };
  damage();
  auto all = reopen_and_append(4);
  CHECK(seqs_of(all) == std::vector<uint64_t>{1, 2, 3, 4, 5});
  // The note was cut off as it was read; this run's clean end left a new one.
  REQUIRE(!clean_note(dir).empty());
  // The control: the same damage without a note (a run that was killed) is found and skipped.
  auto hwm = sbx::os::read_file((dir / "seq.hwm").string());
  REQUIRE(hwm);
  REQUIRE(sbx::os::write_file_atomic((dir / "seq.hwm").string(), hwm->substr(0, 21)));
  REQUIRE(::stat(seg.c_str(), &before) == 0);
  damage();
  all = reopen_and_append(5);
  CHECK(seqs_of(all) == std::vector<uint64_t>{1, 3, 4, 5, 6, 7});
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a note that does not match its segment is not trusted") {
  SUBCASE("the segment grew after the note (a later run that was killed mid-write)") {
    fs::path seg = write_and_close(&loop, dir, 3);
    int fd = ::open(seg.c_str(), O_WRONLY | O_APPEND);
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, "{\"seq\":4,\"ts\":\"x", 16) == 16);
    ::close(fd);
    auto all = reopen_and_append(3);
    CHECK(seqs_of(all) == std::vector<uint64_t>{1, 2, 3, 4, 5});
    CHECK(all[3].second.find("\"dropped_bytes\":16") != std::string::npos);
  }
  SUBCASE("the note names another last seq") {
    write_and_close(&loop, dir, 3);
    auto hwm = sbx::os::read_file((dir / "seq.hwm").string());
    REQUIRE(hwm);
    std::string edited = hwm->substr(0, hwm->rfind(' ')) + " 2\n";
    REQUIRE(sbx::os::write_file_atomic((dir / "seq.hwm").string(), edited));
    CHECK(seqs_of(reopen_and_append(3)) == std::vector<uint64_t>{1, 2, 3, 4});
  }
  SUBCASE("the segment was replaced (another inode)") {
    fs::path seg = write_and_close(&loop, dir, 3);
    auto text = sbx::os::read_file(seg.string());
    REQUIRE(text);
    text->resize(text->size() - 5);  // torn, in a new file
    REQUIRE(sbx::os::write_file_atomic(seg.string(), *text));
    auto all = reopen_and_append(2);
    CHECK(seqs_of(all) == std::vector<uint64_t>{1, 2, 3, 4});
    CHECK(all[2].second.find("journal.recovered") != std::string::npos);
  }
  CHECK(!clean_note(dir).empty());
}

TEST_CASE_FIXTURE(LoopFixture, "journal: last_line is the newest segment's last line, past an empty newest segment") {
  fs::create_directories(dir);
  CHECK_FALSE(Journal::last_line(dir.string()).has_value());
  REQUIRE(sbx::os::write_file_atomic((dir / "00000000000000000001.jsonl").string(),
                                     "{\"seq\":1,\"type\":\"a\"}\n{\"seq\":2,\"type\":\"box.exited\"}\n"));
  CHECK(Journal::last_line(dir.string()) == "{\"seq\":2,\"type\":\"box.exited\"}");
  // A segment just begun holds no line yet: the one before it has the last.
  REQUIRE(sbx::os::write_file_atomic((dir / "00000000000000000003.jsonl").string(), ""));
  CHECK(Journal::last_line(dir.string()) == "{\"seq\":2,\"type\":\"box.exited\"}");
  REQUIRE(sbx::os::write_file_atomic((dir / "00000000000000000003.jsonl").string(), "{\"seq\":3,\"type\":\"b\"}\n"));
  CHECK(Journal::last_line(dir.string()) == "{\"seq\":3,\"type\":\"b\"}");
}

namespace {
// A journal of `n` events of ~1 KiB in segments of 1 MiB, every one sealed and compressed but the
// newest (each in zstd frames of ~512 KiB): the segments' first seqs, in order.
std::vector<uint64_t> sealed_journal(uv_loop_t* loop, const fs::path& dir, int n) {
  {
    auto j = journal::Journal::open(loop, {.dir = dir.string(), .box = "b-test", .segment_bytes = 1u << 20});
    REQUIRE(j);
    const std::string pad(1000, 'x');
    for (int i = 0; i < n; ++i) (*j)->append({{"type", "t"}, {"i", i}, {"pad", pad}});
    (*j)->flush();
  }
  std::vector<uint64_t> firsts;
  for (auto& e : fs::directory_iterator(dir)) {
    auto name = e.path().filename().string();
    if (name.ends_with(".jsonl") || name.ends_with(".jsonl.zst")) firsts.push_back(std::stoull(name));
  }
  std::sort(firsts.begin(), firsts.end());
  return firsts;
}

std::string zst_name(uint64_t first) {
  std::string digits = std::to_string(first);
  return std::string(20 - digits.size(), '0') + digits + ".jsonl.zst";
}

// Where each zstd frame of the file at `path` starts.
std::vector<size_t> frame_offsets(const fs::path& path) {
  auto data = sbx::os::read_file(path.string());
  REQUIRE(data);
  std::vector<size_t> out;
  for (size_t off = 0; off < data->size();) {
    size_t n = ZSTD_findFrameCompressedSize(data->data() + off, data->size() - off);
    REQUIRE(!ZSTD_isError(n));
    out.push_back(off);
    off += n;
  }
  return out;
}

void overwrite(const fs::path& path, size_t at, std::string_view bytes) {
  int fd = ::open(path.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  REQUIRE(::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(at)) == static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}
}  // namespace

TEST_CASE_FIXTURE(LoopFixture, "journal: a compressed segment cut short is an error, not the end of its lines") {
  auto firsts = sealed_journal(&loop, dir, 3500);
  REQUIRE(firsts.size() >= 4);
  fs::path cut = dir / zst_name(firsts[1]);
  auto frames = frame_offsets(cut);
  REQUIRE(frames.size() >= 2);
  fs::resize_file(cut, frames[1] + 100);  // inside its second frame
  // Before, the read ended that segment at the cut as if it had no more lines, went on with the
  // next one and succeeded: the lines past the cut were gone, and nothing said so.
  std::vector<uint64_t> got;
  auto r = journal::Journal::read(dir.string(), 0, [&](uint64_t s, std::string_view) {
    got.push_back(s);
    return true;
  });
  REQUIRE_FALSE(r);
  CHECK(r.error().value() == EBADMSG);
  REQUIRE(!got.empty());
  CHECK(got.back() < firsts[2] - 1);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a read goes past a segment it cannot read and says which seqs it holds") {
  auto firsts = sealed_journal(&loop, dir, 3500);
  REQUIRE(firsts.size() >= 4);
  const uint64_t total = 3500;
  fs::path bad = dir / zst_name(firsts[1]);
  auto frames = frame_offsets(bad);
  REQUIRE(frames.size() >= 2);
  bool whole = false;  // nothing of the segment can be read
  SUBCASE("its first frame damaged: none of its lines") {
    overwrite(bad, 0, std::string(4, '\0'));
    whole = true;
  }
  SUBCASE("its second frame damaged: the first frame's lines, then none") {
    overwrite(bad, frames[1], std::string(4, '\0'));
  }
  SUBCASE("cut short inside its second frame") { fs::resize_file(bad, frames[1] + 100); }
  SUBCASE("its first frame's checksum wrong: none of its lines") {
    // Its data decodes: before, its lines were given, then the checksum failed.
    overwrite(bad, frames[1] - 4, std::string(4, '\0'));
    whole = true;
  }
  std::vector<uint64_t> got;
  std::vector<journal::Journal::Gap> gaps;
  auto each = [&](uint64_t s, std::string_view) {
    got.push_back(s);
    return true;
  };
  auto gap = [&](const journal::Journal::Gap& g) {
    gaps.push_back(g);
    return true;
  };
  REQUIRE(journal::Journal::read(dir.string(), 0, each, nullptr, gap));
  REQUIRE(gaps.size() == 1);
  auto g = gaps[0];
  CHECK(g.segment == zst_name(firsts[1]));
  CHECK(g.error.value() == EBADMSG);
  CHECK(g.last == firsts[2] - 1);
  if (whole)
    CHECK(g.first == firsts[1]);
  else
    CHECK((g.first > firsts[1] && g.first < g.last));
  // Every other seq once, in order: those before the damage, then every one after the segment.
  CHECK(got == seq_range(1, g.first - 1) + seq_range(firsts[2], total));
  CHECK(journal::Journal::describe(g) == "segment " + zst_name(firsts[1]) + " cannot be read (Bad message): seqs " +
                                             std::to_string(g.first) + " to " + std::to_string(g.last) + " skipped");
  auto ev = boost::json::parse(journal::Journal::unreadable_event(g, g.last, "b-test")).as_object();
  CHECK(ev.at("seq") == g.last);
  CHECK(ev.at("type") == "journal.unreadable");
  CHECK(ev.at("box") == "b-test");
  CHECK(ev.at("first_seq") == g.first);
  CHECK(ev.at("last_seq") == g.last);
  CHECK(ev.at("segment").as_string() == zst_name(firsts[1]));
  CHECK(ev.at("error") == "Bad message");
  CHECK(ev.at("branch") == "main");

  // From a since inside what it lost: the gap starts after since.
  gaps.clear();
  got.clear();
  REQUIRE(journal::Journal::read(dir.string(), g.first + 5, each, nullptr, gap));
  REQUIRE(gaps.size() == 1);
  CHECK(gaps[0].first == g.first + 6);
  CHECK(got == seq_range(firsts[2], total));
  // A reader that goes on in steps from where it stopped, and after a gap from its last seq (as
  // the WebSocket replay does): every seq it can read once, and the gap once.
  gaps.clear();
  got.clear();
  journal::Journal::ReadPos pos;
  uint64_t since = 0;
  for (int steps = 0; since < total && steps < 1000; ++steps) {
    int n = 0;
    REQUIRE(journal::Journal::read(
        dir.string(), since,
        [&](uint64_t s, std::string_view) {
          got.push_back(s);
          since = s;
          return ++n < 100;
        },
        &pos,
        [&](const journal::Journal::Gap& lost) {
          gaps.push_back(lost);
          since = lost.last;
          return ++n < 100;
        }));
  }
  REQUIRE(gaps.size() == 1);
  CHECK(gaps[0].first == g.first);
  CHECK(got == seq_range(1, g.first - 1) + seq_range(firsts[2], total));
  // Without `gap`, the read still ends with the segment's error.
  CHECK_FALSE(journal::Journal::read(dir.string(), 0, each));
}

TEST_CASE("journal: a segment whose last read ends a frame gets no frame of nothing after it") {
  // 512 lines of 1 KiB: the fourth 128 KiB read ends the first frame at the segment's last byte.
  // The frame of nothing written after it hid the segment's last line from a look from the end.
  sbx::test::TempDir t("zst-frames");
  fs::path plain = t.path / "00000000000000000001.jsonl";
  std::string text;
  for (int i = 1; i <= 512; ++i) {
    std::string l = "{\"seq\":" + std::to_string(i) + ",\"d\":\"";
    l.append(1024 - l.size() - 3, 'a').append("\"}\n");
    text += l;
  }
  REQUIRE(text.size() == 512u << 10);
  { std::ofstream(plain, std::ios::binary) << text; }
  REQUIRE(journal::zstd_compress_file(plain.string(), plain.string() + ".zst"));
  std::ifstream in(plain.string() + ".zst", std::ios::binary);
  std::string z((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t frames = 0;
  for (size_t off = 0; off < z.size(); ++frames) {
    size_t n = ZSTD_findFrameCompressedSize(z.data() + off, z.size() - off);
    REQUIRE_FALSE(ZSTD_isError(n));
    off += n;
  }
  CHECK(frames == 1);  // was 2: the lines', then one of nothing
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a newest segment that cannot be read is a gap whose end is not known") {
  auto firsts = sealed_journal(&loop, dir, 3500);
  REQUIRE(firsts.size() >= 4);
  // The newest segment compressed too (a box that ended right after a seal), then damaged.
  fs::path plain = dir / zst_name(firsts.back());
  plain.replace_extension();  // .jsonl
  REQUIRE(journal::zstd_compress_file(plain.string(), plain.string() + ".zst"));
  fs::remove(plain);
  overwrite(dir / zst_name(firsts.back()), 0, std::string(4, '\0'));
  std::vector<journal::Journal::Gap> gaps;
  uint64_t last = 0;
  REQUIRE(journal::Journal::read(
      dir.string(), 0,
      [&](uint64_t s, std::string_view) {
        last = s;
        return true;
      },
      nullptr,
      [&](const journal::Journal::Gap& g) {
        gaps.push_back(g);
        return true;
      }));
  CHECK(last == firsts.back() - 1);
  REQUIRE(gaps.size() == 1);
  CHECK(gaps[0].first == firsts.back());
  CHECK(gaps[0].last == 0);
  CHECK(journal::Journal::describe(gaps[0]).ends_with(": its seqs from " + std::to_string(firsts.back()) +
                                                      " on skipped"));
}

TEST_CASE_FIXTURE(LoopFixture,
                  "journal: a restart after a newest compressed segment cut short goes on after its last line") {
  auto firsts = sealed_journal(&loop, dir, 3500);
  fs::path plain = dir / zst_name(firsts.back());
  plain.replace_extension();
  fs::remove(plain);  // the newest is then the last sealed one, compressed
  fs::path newest = dir / zst_name(firsts[firsts.size() - 2]);
  auto frames = frame_offsets(newest);
  REQUIRE(frames.size() >= 2);
  fs::resize_file(newest, frames[1] + 100);
  // Readers take the cut for damage; the open, as before, takes the last line the segment still
  // holds for the journal's last (and does not refuse the box's start).
  uint64_t last = 0;
  (void)journal::Journal::read(dir.string(), 0, [&](uint64_t s, std::string_view) {
    last = s;
    return true;
  });
  REQUIRE(last > firsts[firsts.size() - 2]);
  auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test", .segment_bytes = 1u << 20});
  REQUIRE(j);
  CHECK((*j)->last_seq() == last);
}

TEST_CASE_FIXTURE(LoopFixture, "journal: a restart after a newest compressed segment that does not decode goes on") {
  auto firsts = sealed_journal(&loop, dir, 3500);
  fs::path plain = dir / zst_name(firsts.back());
  plain.replace_extension();
  fs::remove(plain);  // the newest is then the last sealed one, compressed
  uint64_t first = firsts[firsts.size() - 2];
  fs::path newest = dir / zst_name(first);
  uint64_t last = 0;
  REQUIRE(journal::Journal::read(dir.string(), 0, [&](uint64_t s, std::string_view) {
    last = s;
    return true;
  }));
  auto frames = frame_offsets(newest);
  REQUIRE(frames.size() >= 3);
  uint64_t expected = 0;
  bool known = true;
  SUBCASE("its first frame's header damaged: the last frame still gives its last seq") {
    overwrite(newest, 0, std::string(4, '\0'));
    expected = last;
  }
  SUBCASE("its first frame damaged, a frame of nothing at its end: the last frame with lines gives it") {
    // As zstd_compress_file wrote a segment whose last read ended a frame, before 2026-12-08.
    overwrite(newest, 0, std::string(4, '\0'));
    std::string empty(ZSTD_compressBound(0), '\0');
    empty.resize(ZSTD_compress(empty.data(), empty.size(), nullptr, 0, 3));
    std::ofstream(newest, std::ios::binary | std::ios::app) << empty;
    expected = last;
  }
  SUBCASE("its last frame damaged: the seq goes past all a sealed segment can hold") {
    overwrite(newest, frames.back(), std::string(4, '\0'));
    expected = first - 1 + (1u << 20) / 32 + 1;
    known = false;
  }
  // Before, the open failed with "Bad message": the box did not start.
  auto j = journal::Journal::open(&loop, {.dir = dir.string(), .box = "b-test", .segment_bytes = 1u << 20});
  REQUIRE(j);
  CHECK((*j)->last_seq() == expected);
  CHECK((*j)->append({{"type", "after"}}) == expected + 2);  // journal.recovered first
  (*j)->flush();
  std::vector<boost::json::object> tail;
  (void)journal::Journal::read(dir.string(), expected, [&](uint64_t, std::string_view l) {
    tail.push_back(boost::json::parse(l).as_object());
    return true;
  });
  REQUIRE(tail.size() == 2);
  CHECK(tail[0].at("type") == "journal.recovered");
  CHECK(tail[0].at("segment").as_string() == zst_name(first).substr(0, 20));
  CHECK(tail[0].at("unreadable").as_string() == std::strerror(EBADMSG));
  CHECK(tail[0].at("last_seq_known") == known);
  CHECK(tail[0].at("branch") == "main");
  CHECK(tail[1].at("type") == "after");
}
