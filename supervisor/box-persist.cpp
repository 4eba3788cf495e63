// Agents that outlive their host: the profile's `checkpoint` section (profile.hpp). The box takes
// snapshots of its main branch by itself (on a period, on SIGTERM, at the idle limit), keeps the
// newest `keep` of them, and a box started again on the same state dir resumes the newest one
// (docs/architecture.md, "Checkpoints").
//
// The box's own snapshots are listed in STATE/persist.json, oldest first: only those are pruned,
// so a snapshot someone asked for is never deleted by the box.
#include <spdlog/spdlog.h>
#include <sys/mount.h>

#include <algorithm>
#include <cstdio>
#include <ctime>

#include "os/files.hpp"
#include "os/sys.hpp"
#include "supervisor/box.hpp"

namespace sbx::supervisor {

namespace json = boost::json;

namespace {

auto log() {
  static auto l = spdlog::default_logger()->clone("persist");
  return l;
}

// Milliseconds since the epoch of an RFC 3339 UTC time as the journal writes it; -1 if it is not one.
int64_t rfc3339_ms(std::string_view s) {
  struct tm tm {};
  long micros = 0;
  int n = 0;
  std::string text(s);
  if (std::sscanf(text.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d.%6ldZ%n", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour,
                  &tm.tm_min, &tm.tm_sec, &micros, &n) < 6)
    return -1;
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return static_cast<int64_t>(::timegm(&tm)) * 1000 + micros / 1000;
}

std::string str_of(const json::object& o, std::string_view key) {
  auto* v = o.if_contains(key);
  return v && v->is_string() ? std::string(v->as_string()) : std::string();
}

uint64_t seq_of(const json::object& o) {
  auto* v = o.if_contains("last_seq");
  return v && v->is_number() ? v->to_number<uint64_t>() : 0;
}

}  // namespace

json::object Box::persist_state() const {
  auto text = os::read_file(opts_.state_dir + "/persist.json");
  boost::system::error_code ec;
  json::value v = text ? json::parse(*text, ec) : json::value();
  if (!text || ec || !v.is_object()) return {};
  return v.as_object();
}

json::array Box::own_snapshots() const {
  auto st = persist_state();
  auto* own = st.if_contains("own");
  return own && own->is_array() ? own->as_array() : json::array();
}

namespace {
void save_persist_state(const std::string& state_dir, const json::object& st) {
  if (auto r = os::write_file_atomic(state_dir + "/persist.json", json::serialize(st) + "\n"); !r)
    log()->error("record the box's own snapshots in {}/persist.json: {}", state_dir, r.error().message());
}
}  // namespace

void Box::save_own_snapshots(const json::array& own) {
  auto st = persist_state();
  st["own"] = own;
  save_persist_state(opts_.state_dir, st);
}

void Box::note_agent_end() {
  if (!opts_.profile.checkpoint.enabled() || shutting_down_ || stopping_ || hibernated_) return;
  auto it = branches_.find("main");
  if (it == branches_.end() || !it->second->ended_by.empty()) return;
  // Its work is over (it exited, or a limit ended it): the next start runs the command anew
  // instead of bringing back an older state of it.
  auto st = persist_state();
  st["ended_seq"] = journal_->last_seq();
  save_persist_state(opts_.state_dir, st);
}

void Box::persist_checkpoint(const std::string& trigger, bool leave_running, std::function<void(bool)> done) {
  // The box's own snapshots go to the chunk store: each adds what changed since the last one.
  checkpointer_->checkpoint(
      "main", trigger, leave_running,
      [this, trigger, done](json::object r) {
        bool ok = r.contains("ok") && r.at("ok").as_bool();
        if (!ok) {
          auto* e = r.if_contains("error");
          json::object err = e && e->is_object() ? e->as_object()
                                                 : json::object{{"code", "internal"}, {"message", json::serialize(r)}};
          std::string code = str_of(err, "code");
          // A periodic tick that finds the agent ended or a checkpoint under way has nothing to do.
          if (!(trigger == "periodic" && (code == "not_running" || code == "busy"))) {
            log()->warn("{} checkpoint: {}", trigger, str_of(err, "message"));
            emit("main", {{"type", "persist.failed"}, {"trigger", trigger}, {"error", err}});
          }
          return done(false);
        }
        keep_own_snapshot(r.at("snapshot"));
        done(true);
      },
      "", true);
}

void Box::keep_own_snapshot(const json::value& id) {
  json::array own = own_snapshots();
  own.emplace_back(id);
  // Recorded before anything is pruned, and each pruned one deleted before it leaves the record:
  // a supervisor killed in between leaves at worst a deleted snapshot listed (dropped at the next
  // prune), never a kept one unlisted (which no prune would ever delete).
  save_own_snapshots(own);
  // The oldest of the box's own go first; one the operator deleted meanwhile is simply dropped.
  auto keep = static_cast<size_t>(opts_.profile.checkpoint.keep);
  while (own.size() > keep) {
    std::string old(own.front().is_string() ? own.front().as_string() : "");
    if (!old.empty()) {
      auto rm = checkpointer_->remove(old);
      if (!rm.at("ok").as_bool()) log()->info("prune {}: {}", old, json::serialize(rm));
    }
    own.erase(own.begin());
    save_own_snapshots(own);
  }
}

void Box::start_persistence() {
  int64_t every = opts_.profile.checkpoint.every_ms;
  if (every <= 0 || persist_timer_) return;
  persist_timer_ = loop::make_timer(loop_);
  persist_timer_->data = this;
  uv_timer_start(
      persist_timer_.get(),
      [](uv_timer_t* t) noexcept {
        auto* self = static_cast<Box*>(t->data);
        if (self->shutting_down_ || self->stopping_ || self->finished_) return;
        try {
          self->persist_checkpoint("periodic", true, [](bool) {});
        } catch (const std::exception& e) {
          log()->error("periodic checkpoint: {}", e.what());
        }
      },
      static_cast<uint64_t>(every), static_cast<uint64_t>(every));
}

bool Box::stop_with_checkpoint(int64_t grace) {
  if (!opts_.profile.checkpoint.on_stop || shutting_down_ || stopping_) return false;
  auto main = checkpointer_->live_possible() ? find_branch("main") : std::nullopt;
  if (!main || !main->running) return false;
  stopping_ = true;
  if (persist_timer_) uv_timer_stop(persist_timer_.get());
  log()->info("SIGTERM: checkpoint of the main branch before it ends (grace {} ms)", grace);
  // The checkpoint has the grace period; past it the agent is ended without one, and says so.
  stop_timer_ = loop::make_timer(loop_);
  stop_timer_->data = this;
  uv_timer_start(
      stop_timer_.get(),
      [](uv_timer_t* t) noexcept {
        auto* self = static_cast<Box*>(t->data);
        if (self->shutting_down_) return;
        self->emit("main", {{"type", "persist.failed"},
                            {"trigger", "on_stop"},
                            {"error",
                             {{"code", "grace_exceeded"},
                              {"message",
                               "the checkpoint took longer than the grace period: the agent is "
                               "ended without it; raise resources.grace"}}}});
        self->shutdown(1000);
      },
      static_cast<uint64_t>(grace), 0);
  persist_checkpoint("on_stop", false, [this, grace](bool ok) {
    if (stop_timer_) uv_timer_stop(stop_timer_.get());
    if (shutting_down_) return;
    if (ok) hibernated_ = true;
    shutdown(grace);
  });
  return true;
}

void Box::stop(int64_t grace_ms) {
  if (!stop_with_checkpoint(grace_ms)) shutdown(grace_ms);
}

bool Box::hibernate() {
  if (!opts_.profile.checkpoint.on_idle || shutting_down_ || stopping_) return false;
  if (!checkpointer_->live_possible()) return false;
  stopping_ = true;
  if (persist_timer_) uv_timer_stop(persist_timer_.get());
  log()->info("idle limit: the main branch hibernates");
  persist_checkpoint("on_idle", false, [this](bool ok) {
    if (shutting_down_) return;
    if (ok) {
      hibernated_ = true;
      json::array own = own_snapshots();
      emit("main", {{"type", "box.hibernated"}, {"snapshot", own.empty() ? json::value(nullptr) : own.back()}});
    }
    // Without a snapshot the idle limit ends the agent as it would have without on_idle.
    shutdown(opts_.profile.resources.grace_ms);
  });
  return true;
}

std::vector<json::object> Box::resume_candidates() const {
  std::vector<json::object> out;
  auto st = persist_state();
  uint64_t ended =
      st.contains("ended_seq") && st.at("ended_seq").is_number() ? seq_of({{"last_seq", st.at("ended_seq")}}) : 0;
  for (auto& v : checkpointer_->list()) {
    const auto& o = v.as_object();
    if (str_of(o, "box") == id_ && str_of(o, "branch") == "main" && seq_of(o) > ended) out.push_back(o);
  }
  // Newest first: the one that saw the most of the journal.
  std::stable_sort(out.begin(), out.end(), [](const json::object& a, const json::object& b) {
    return seq_of(a) != seq_of(b) ? seq_of(a) > seq_of(b) : str_of(a, "created") > str_of(b, "created");
  });
  return out;
}

void Box::resume_from(std::vector<json::object> candidates, size_t i, json::array skipped, uint64_t ended_seq,
                      int64_t ended_ms) {
  if (i >= candidates.size()) {
    emit("main", {{"type", "box.resume_failed"},
                  {"skipped", skipped},
                  {"error", "no snapshot of the main branch could be restored; the state dir is left as it is"}});
    log()->critical("resume: no snapshot of the main branch could be restored");
    return end_box(125);
  }
  const json::object& snap = candidates[i];
  std::string id = str_of(snap, "id");
  std::string dir = opts_.state_dir + "/branches/main";
  // The ended agent's layer goes aside: the snapshot's files replace it whole. What a killed
  // supervisor left (its groups' processes, then its mounts) goes first.
  if (auto r = release_earlier_run(); !r) {
    emit("main", {{"type", "box.resume_failed"}, {"skipped", skipped}, {"error", r.error().message}});
    log()->critical("resume: {}", r.error().message);
    return end_box(125);
  }
  (void)::umount2((dir + "/workspace").c_str(), MNT_DETACH | UMOUNT_NOFOLLOW);
  std::string aside = opts_.state_dir + "/branches/.ended-main-" + os::random_hex(4);
  if (::rename(dir.c_str(), aside.c_str()) == 0) os::remove_tree(aside);
  // The extracted copy is made again from the archive, whose content hash is checked on the way:
  // a snapshot damaged on disk is found here, before anything of it runs.
  os::remove_tree(opts_.state_dir + "/snapshots/" + id + ".d");
  log()->info("resume: snapshot {} ({} of {})", id, i + 1, candidates.size());
  checkpointer_->restore(
      id, 1, false,
      [this, candidates = std::move(candidates), i, skipped, ended_seq, ended_ms, id](json::object r) mutable {
        bool ok = r.contains("ok") && r.at("ok").as_bool();
        if (!ok) {
          json::value err = r.contains("error") ? r.at("error") : json::value("restore failed");
          if (auto* copies = r.if_contains("copies"); copies && copies->is_array() && !copies->as_array().empty())
            if (auto* e = copies->as_array()[0].as_object().if_contains("error")) err = *e;
          skipped.push_back(json::object{{"snapshot", id}, {"error", err}});
          log()->warn("resume from {} failed: {}; trying the one before", id, json::serialize(err));
          return resume_from(std::move(candidates), i + 1, std::move(skipped), ended_seq, ended_ms);
        }
        const json::object& snap = candidates[i];
        json::object copy = r.at("copies").as_array()[0].as_object();
        int64_t taken = rfc3339_ms(str_of(snap, "created"));
        // What the resumed agent does not remember: the time and the events between its snapshot
        // and the end of the previous run (the journal keeps those events).
        json::object lost{{"events", ended_seq - std::min(ended_seq, seq_of(snap))}};
        if (taken >= 0 && ended_ms >= 0) lost["ms"] = std::max<int64_t>(0, ended_ms - taken);
        json::object ev{{"type", "box.resumed"},
                        {"snapshot", id},
                        {"name", str_of(snap, "name")},
                        {"mode", copy.at("mode")},
                        {"created", snap.at("created")},
                        {"lost", lost},
                        {"skipped", skipped}};
        if (auto* note = copy.if_contains("note")) ev["note"] = *note;
        emit("main", std::move(ev));
        start_persistence();
      },
      "main", 0, true);
}

bool Box::resumes_at_start() {
  // A box whose profile persists its agent resumes the newest snapshot of its main branch instead
  // of starting the command again. So does one started --idle that has such a snapshot: a copy
  // made in an idle box (restore with an index) that checkpointed itself, whose container
  // restarts with the same command line; it then ends with that agent.
  bool resuming = opts_.restore_file.empty() && opts_.profile.checkpoint.enabled() && !resume_candidates().empty();
  if (resuming) opts_.idle = false;
  return resuming;
}

bool Box::try_resume(uint64_t ended_seq) {
  if (!opts_.profile.checkpoint.enabled()) return false;
  auto candidates = resume_candidates();
  if (candidates.empty()) return false;
  // When the previous run ended: the time of its last event (what the snapshot misses is after
  // the snapshot and up to there).
  int64_t ended_ms = -1;
  if (ended_seq > 0)
    (void)journal::Journal::read(journal_->dir(), ended_seq - 1, [&](uint64_t, std::string_view line) {
      boost::system::error_code ec;
      auto v = json::parse(line, ec);
      if (!ec && v.is_object()) ended_ms = rfc3339_ms(str_of(v.as_object(), "ts"));
      return false;
    });
  resume_from(std::move(candidates), 0, {}, ended_seq, ended_ms);
  return true;
}

}  // namespace sbx::supervisor
