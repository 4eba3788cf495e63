#include "cli/relay.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>

#include "archive/archive.hpp"
#include "base/encoding.hpp"
#include "cli/session.hpp"
#include "cli/tokens.hpp"
#include "os/sys.hpp"

namespace sbx::cli {

namespace json = boost::json;
using sdk::Client;

namespace {

constexpr size_t kChunk = 1 << 20;      // bytes per binary frame to a target
constexpr size_t kInFlight = 8u << 20;  // bytes waiting to be sent, per target
constexpr const char* kPending = "pending";

struct Target {
  sdk::Endpoint ep;
  std::unique_ptr<Client> client;
  bool connected = false, import_sent = false, last_sent = false, finished = false;
  uint32_t upload_id = 0;
  uint64_t sent = 0;
  base::Result<json::object> result = base::fail("not started", kPending);
};

}  // namespace

struct Relay::Impl {
  Relay* self;
  uv_loop_t* loop;
  sdk::Endpoint source_ep;
  std::string snapshot, spool_path;
  DeltaPlan plan;
  os::UniqueFd spool;
  std::unique_ptr<Client> source;
  uint64_t size = 0, received = 0;
  bool have_reply = false, complete = false, source_finished = false, sealed = false, notified = false;
  json::object export_reply;
  base::Result<json::object> source_result = base::fail("not started", kPending);
  std::vector<std::unique_ptr<Target>> targets;

  ~Impl() {
    // The clients go first (their sockets), then the spool. A callback a client runs as it goes
    // finds everything finished and does nothing.
    source_finished = notified = true;
    for (auto& t : targets) t->finished = true;
    targets.clear();
    source.reset();
    if (spool) ::unlink(spool_path.c_str());
  }

  void fail_source(const std::string& why, const std::string& code);
  void on_source_frame(uint64_t offset, bool last, std::string_view data);
  void begin(Target& t);
  void pump(Target& t);
  void finish(Target& t, base::Result<json::object> r);
  void check_done();
};

void Relay::Impl::fail_source(const std::string& why, const std::string& code) {
  if (source_finished) return;
  source_finished = true;
  source_result = base::fail(why, code);
  if (source) source->close();
  // No target gets the frame that would end its upload: each box drops what it received.
  for (auto& t : targets)
    if (!t->finished) finish(*t, base::fail("the archive did not arrive whole: " + why, "source"));
  check_done();
}

void Relay::Impl::on_source_frame(uint64_t offset, bool last, std::string_view data) {
  if (source_finished) return;
  if (!have_reply) return fail_source("archive bytes before snapshot.export's reply", "bad_reply");
  if (offset != received)
    return fail_source(
        "a frame at byte " + std::to_string(offset) + " where byte " + std::to_string(received) + " was due",
        "bad_frame");
  if (received + data.size() > size)
    return fail_source(
        "a frame reaches byte " + std::to_string(received + data.size()) + " of an archive of " + std::to_string(size),
        "bad_frame");
  if (auto w = os::write_all(spool.get(), data); !w)  // in order: offset == received
    return fail_source("write " + spool_path + ": " + w.error().message(), "local");
  received += data.size();
  if (last) {
    if (received != size)
      return fail_source("the export ended at byte " + std::to_string(received) + " of " + std::to_string(size),
                         "bad_frame");
    // Nothing is imported that does not name its id: the hash of its manifest, which each target
    // checks every entry against as it imports (a format-2 archive's own hash). A delta is no
    // archive: each target checks the manifest its chunks begin with.
    if (!plan.delta()) {
      auto head = archive::read_manifest(spool_path);
      if (!head) return fail_source("the archive received is refused: " + head.error().message, "bad_snapshot");
      // Only a format-2 archive is hashed whole, once it is here: a format-3 one needs no pass.
      auto named = archive::named_by_manifest(head->format_version) ? base::Result<std::string>(head->manifest_sha256)
                                                                    : archive::sha256_file(spool_path);
      if (!named) return fail_source("read " + spool_path + ": " + named.error().message, "local");
      if (archive::snapshot_id_of(*named) != snapshot)
        return fail_source(
            "the archive received names snapshot " + archive::snapshot_id_of(*named) + ", not " + snapshot,
            "bad_snapshot");
    }
    complete = true;
    source_finished = true;
    source_result = export_reply;
    source->close();
  }
  for (auto& t : targets) pump(*t);
  check_done();
}

void Relay::Impl::begin(Target& t) {
  if (!t.connected || !have_reply || t.import_sent || t.finished) return;
  t.import_sent = true;
  t.upload_id = static_cast<uint32_t>(
      t.client->request({{"op", "snapshot.import"}, {"size", size}}, [this, &t](const json::object& rep) {
        if (reply_ok(rep))
          finish(t, rep);
        else
          finish(t, reply_error(rep));
      }));
  pump(t);
}

void Relay::Impl::pump(Target& t) {
  if (!t.import_sent || t.finished) return;
  std::string chunk;
  while (t.sent < received && t.client->pending_bytes() < kInFlight) {
    chunk.resize(static_cast<size_t>(std::min<uint64_t>(kChunk, received - t.sent)));
    ssize_t n = ::pread(spool.get(), chunk.data(), chunk.size(), static_cast<off_t>(t.sent));
    if (n <= 0)
      return finish(
          t, base::fail("read " + spool_path + ": " + (n < 0 ? os::last_error().message() : "file shrank"), "local"));
    chunk.resize(static_cast<size_t>(n));
    t.client->send_binary(t.upload_id, t.sent, false, chunk);
    t.sent += chunk.size();
  }
  // The end of the upload, only for an archive that arrived whole and hashed to its id.
  if (complete && t.sent == size && !t.last_sent) {
    t.client->send_binary(t.upload_id, size, true, {});
    t.last_sent = true;
  }
}

void Relay::Impl::finish(Target& t, base::Result<json::object> r) {
  if (t.finished) return;
  t.finished = true;
  t.result = std::move(r);
  t.client->close();
  check_done();
}

void Relay::Impl::check_done() {
  if (!sealed || notified) return;
  bool targets_done = std::all_of(targets.begin(), targets.end(), [](auto& t) { return t->finished; });
  if (!targets_done) return;
  // Every target has failed: the rest of the archive has nowhere to go.
  if (!source_finished) return fail_source("no target left to send it to", "no_target");
  notified = true;
  if (self->on_done_) self->on_done_();
}

Relay::Relay(uv_loop_t* loop, sdk::Endpoint source, std::string snapshot, DeltaPlan plan)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.self = this;
  m.loop = loop;
  m.source_ep = std::move(source);
  m.snapshot = std::move(snapshot);
  m.plan = std::move(plan);
}

Relay::~Relay() = default;

base::Result<void> Relay::start() {
  auto& m = *impl_;
  std::string home;
  try {
    home = state_home();
  } catch (const std::exception& e) {
    return base::fail(e.what(), "local");
  }
  if (auto r = os::make_dirs(home, 0700); !r) return base::fail("create " + home + ": " + r.error().message(), "local");
  m.spool_path = home + "/.spool-" + os::random_hex(4) + "-" + m.snapshot + (m.plan.delta() ? ".delta" : ".tar.zst");
  m.spool.reset(::open(m.spool_path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!m.spool) return base::fail(m.spool_path + ": " + os::last_error().message(), "local");
  m.source = std::make_unique<Client>(m.loop, m.source_ep);
  m.source->on_close([&m](int code, const std::string& reason) {
    m.fail_source("the connection to " + m.source_ep.url + " closed after " + std::to_string(m.received) + " of " +
                      (m.have_reply ? std::to_string(m.size) : std::string("?")) + " bytes: " + reason + " (" +
                      std::to_string(code) + ")",
                  "closed");
  });
  m.source->on_binary(
      [&m](uint32_t, uint64_t off, bool last, std::string_view data) { m.on_source_frame(off, last, data); });
  m.source->connect([&m](const std::string& err) {
    if (!err.empty())
      return m.fail_source("connect to " + m.source_ep.url + ": " + connect_error(m.source_ep.url, err), "connect");
    json::object req{{"op", "snapshot.export"}, {"snapshot", m.snapshot}};
    if (!m.plan.base.empty()) req["base"] = m.plan.base;
    if (!m.plan.lacks.empty()) req["lacks"] = base::base64_encode(m.plan.lacks);
    m.source->request(std::move(req), [&m](const json::object& rep) {
      if (!reply_ok(rep)) {
        auto e = reply_error(rep);
        return m.fail_source(e.message, e.code);
      }
      auto* size = rep.if_contains("size");
      if (!size || !size->is_number() || size->to_number<int64_t>() <= 0)
        return m.fail_source("snapshot.export's reply names no size", "bad_reply");
      m.size = size->to_number<uint64_t>();
      m.export_reply = rep;
      m.have_reply = true;
      for (auto& t : m.targets) m.begin(*t);
    });
  });
  return {};
}

size_t Relay::add_target(sdk::Endpoint ep) {
  auto& m = *impl_;
  auto t = std::make_unique<Target>();
  t->ep = std::move(ep);
  Target& tr = *t;
  m.targets.push_back(std::move(t));
  tr.client = std::make_unique<Client>(m.loop, tr.ep);
  if (m.source_finished && !m.complete) {
    m.finish(tr, base::fail("the archive did not arrive whole: " + m.source_result.error().message, "source"));
    return m.targets.size() - 1;
  }
  tr.client->on_close([&m, &tr](int code, const std::string& reason) {
    m.finish(tr, base::fail(
                     "the connection to " + tr.ep.url + " closed first: " + reason + " (" + std::to_string(code) + ")",
                     "closed"));
  });
  tr.client->on_drained([&m, &tr] { m.pump(tr); });
  tr.client->connect([&m, &tr](const std::string& err) {
    if (!err.empty())
      return m.finish(tr, base::fail("connect to " + tr.ep.url + ": " + connect_error(tr.ep.url, err), "connect"));
    tr.connected = true;
    m.begin(tr);
  });
  return m.targets.size() - 1;
}

void Relay::seal() {
  impl_->sealed = true;
  impl_->check_done();
}

void Relay::abort(const std::string& why) {
  auto& m = *impl_;
  for (auto& t : m.targets)
    if (!t->finished) m.finish(*t, base::fail(why, "interrupted"));
  m.fail_source(why, "interrupted");
  m.sealed = true;
  m.check_done();
}

bool Relay::done() const { return impl_->notified; }

const base::Result<json::object>& Relay::source() const { return impl_->source_result; }

std::vector<base::Result<json::object>> Relay::targets() const {
  std::vector<base::Result<json::object>> out;
  for (auto& t : impl_->targets) out.push_back(t->result);
  return out;
}

uint64_t Relay::size() const { return impl_->size; }

namespace {
// Snapshot id -> its entry in a box's snapshot.list; nullopt when the list fails.
using Listing = std::map<std::string, json::object>;
std::optional<Listing> snapshots_of(Session& s, const sdk::Endpoint& box) {
  auto r = s.call_to(box, {{"op", "snapshot.list"}});
  if (!r) return std::nullopt;
  Listing out;
  auto* list = r->if_contains("snapshots");
  if (!list || !list->is_array()) return std::nullopt;
  for (auto& v : list->as_array()) {
    auto* m = v.if_object();
    auto* id = m ? m->if_contains("id") : nullptr;
    if (id && id->is_string()) out[std::string(id->as_string())] = *m;
  }
  return out;
}

std::string str_of(const json::object& o, const char* key) {
  auto* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : std::string();
}

// The newest snapshot of the source (`mine`, its listing) other than `snap` that every target
// has, "" when there is none or a list fails.
std::string common_base(Session& s, Listing mine, const std::vector<sdk::Endpoint>& targets, const std::string& snap) {
  mine.erase(snap);
  for (auto& t : targets) {
    auto theirs = snapshots_of(s, t);
    if (!theirs) return {};
    std::erase_if(mine, [&](auto& kv) { return !theirs->contains(kv.first); });
  }
  // The newest shares the most with `snap`, as a rule: a box's snapshots follow one agent.
  auto best = std::max_element(mine.begin(), mine.end(), [](auto& a, auto& b) {
    return str_of(a.second, "created") < str_of(b.second, "created");
  });
  return best == mine.end() ? std::string() : best->first;
}

// One page of snapshot.chunks (from the source) and each target's snapshot.lacks for it, ORed into
// `bits` (sized from the first page's "chunks"). The next page's from, 0 at the end, or why not.
base::Result<uint64_t> negotiate_page(Session& s, const std::vector<sdk::Endpoint>& targets, const std::string& snap,
                                      uint64_t from, std::string& bits, uint64_t& total) {
  auto page = s.call({{"op", "snapshot.chunks"}, {"snapshot", snap}, {"from", from}});
  if (!page) return page.error();
  auto num = [](const json::object& o, const char* k) -> std::optional<uint64_t> {
    auto* v = o.if_contains(k);
    boost::system::error_code ec;
    uint64_t n = v ? v->to_number<uint64_t>(ec) : 0;
    return v && !ec ? std::optional<uint64_t>(n) : std::nullopt;
  };
  auto n = num(*page, "chunks"), count = num(*page, "count"), at = num(*page, "from");
  auto* hashes = page->if_contains("hashes");
  if (!n || !count || at != from || !hashes || !hashes->is_string() || from + *count > *n || (*count == 0 && *n > from))
    return base::fail("snapshot.chunks answered " + json::serialize(*page), "bad_reply");
  if (bits.empty()) {
    total = *n;
    bits.assign((total + 7) / 8, '\0');
  } else if (*n != total) {
    return base::fail("snapshot.chunks changed its count", "bad_reply");
  }
  for (auto& t : targets) {
    auto r = s.call_to(t, {{"op", "snapshot.lacks"}, {"hashes", hashes->as_string()}});
    if (!r) return r.error();
    std::string got;
    auto* l = r->if_contains("lacks");
    if (!l || !l->is_string() || !base::base64_decode(l->as_string(), got) || got.size() != (*count + 7) / 8)
      return base::fail(t.url + ": snapshot.lacks answered " + json::serialize(*r), "bad_reply");
    for (uint64_t i = 0; i < *count; ++i)
      if ((static_cast<unsigned char>(got[i / 8]) >> (i % 8)) & 1)
        bits[(from + i) / 8] = static_cast<char>(bits[(from + i) / 8] | (1 << ((from + i) % 8)));
  }
  auto* next = page->if_contains("next");
  auto nx = next && !next->is_null() ? num(*page, "next") : std::optional<uint64_t>(0);
  if (!nx || (*nx != 0 && *nx != from + *count)) return base::fail("snapshot.chunks answered a bad next", "bad_reply");
  return *nx;
}
}  // namespace

std::string DeltaPlan::describe() const {
  if (!base.empty()) return ", a delta against " + base;
  if (!lacks.empty())
    return ", a delta of the " + std::to_string(lacking) + " of " + std::to_string(chunks) + " chunks the targets lack";
  return {};
}

DeltaPlan plan_delta(Session& s, const std::vector<sdk::Endpoint>& targets, const std::string& snap) {
  if (targets.empty()) return {};
  auto mine = snapshots_of(s, s.endpoint());
  if (!mine) return {};
  // Kept in the source's chunk store (its listing's archive.stored), the snapshot's archive would
  // be compressed anew from the chunks, while a delta of them all is their files as they are.
  bool chunked = false;
  if (auto it = mine->find(snap); it != mine->end())
    if (auto* a = it->second.if_contains("archive"); a && a->is_object())
      chunked = str_of(a->as_object(), "stored") == "chunks";
  // A box with no snapshot has no chunk: nothing to ask it, unless the snapshot is kept as chunks.
  if (!chunked)
    for (auto& t : targets)
      if (auto l = snapshots_of(s, t); !l || l->empty()) return {};
  std::string bits;
  uint64_t total = 0;
  for (uint64_t from = 0;;) {
    auto next = negotiate_page(s, targets, snap, from, bits, total);
    if (!next) {
      // A box from before snapshot.lacks: a delta against a snapshot they all have, if any. (Any
      // other failure shows where it matters: the export, or that target's import.)
      return {.base = common_base(s, std::move(*mine), targets, snap)};
    }
    if (*next == 0) break;
    from = *next;
  }
  uint64_t lacking = 0;
  for (char c : bits) lacking += static_cast<uint64_t>(__builtin_popcount(static_cast<unsigned char>(c)));
  if (lacking == total && !chunked) return {};  // they have none of it: the archive itself
  return {.lacks = std::move(bits), .chunks = total, .lacking = lacking};
}

}  // namespace sbx::cli
