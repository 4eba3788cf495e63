#include "supervisor/limits.hpp"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <memory>

#include "os/sys.hpp"

namespace sbx::supervisor {

namespace {

auto log() {
  static auto l = spdlog::default_logger()->clone("limits");
  return l;
}

constexpr uint64_t kTickMs = 100;
// CPU time below this since the last activity is the kernel's bookkeeping, not work.
constexpr int64_t kIdleCpuUs = 2000;

}  // namespace

LimitsWatcher::LimitsWatcher(uv_loop_t* loop, const os::CgroupDir* cg, const profile::Profile::Resources& r,
                             Callbacks cb)
    : loop_(loop), cg_(cg && !cg->empty() ? cg : nullptr), r_(r), cb_(std::move(cb)) {}

void LimitsWatcher::start() {
  last_activity_ = static_cast<int64_t>(uv_now(loop_));
  if (cg_) {
    oom_kills_ = 0;
    pids_events_ = cg_->pids_max_events().value_or(0);
    if (!cg_->v2()) {
      // v1: the kernel tells us about each OOM through an eventfd; v2 is read on the tick.
      if (auto fd = cg_->oom_eventfd()) {
        oom_fd_ = std::move(*fd);
        if (auto poll = loop::UvHandle<uv_poll_t>::make(loop_, uv_poll_init, oom_fd_.get())) {
          oom_poll_ = std::move(*poll);
          oom_poll_->data = this;
          uv_poll_start(oom_poll_.get(), UV_READABLE,
                        [](uv_poll_t* h, int, int) noexcept { static_cast<LimitsWatcher*>(h->data)->on_oom_event(); });
        } else {
          log()->warn("watch OOM of the branch's group: {} (read on the tick instead)", poll.error().message);
        }
      } else {
        log()->warn("watch OOM of the branch's group: {} (read on the tick instead)", fd.error().message());
      }
      // The 90 % threshold's eventfd waits for the first tick (below): an agent that ends
      // sooner never pays its registration, and the box's end never waits for it.
      threshold_wanted_ = r_.memory > 0 && cg_->has("memory");
    }
  }
  tick_ = loop::make_timer(loop_);
  tick_->data = this;
  uv_timer_start(
      tick_.get(), [](uv_timer_t* t) noexcept { static_cast<LimitsWatcher*>(t->data)->tick(); }, kTickMs, kTickMs);
  if (r_.timeout_ms > 0) {
    timeout_ = loop::make_timer(loop_);
    timeout_->data = this;
    timeout_due_ = static_cast<int64_t>(uv_now(loop_)) + r_.timeout_ms;
    arm_timeout();
  }
}

// The 90 % threshold's eventfd is registered on libuv's thread pool, at the first tick: the kernel
// waits for an RCU grace period (~10 ms) to register it, which held the loop, and so every event
// of a starting box or copy, that long. Until it is in place the tick reads the memory; a watcher
// gone by then leaves the job to close the fd.
struct LimitsWatcher::ThresholdJob {
  uv_work_t req{};
  std::string dir;
  int64_t bytes = 0;
  os::Result<os::UniqueFd> fd = os::sys_error(ECANCELED);
  LimitsWatcher* owner = nullptr;
};

namespace {
int pending_thresholds = 0;  // registrations on the thread pool, watcher gone or not (loop thread)
}  // namespace

void LimitsWatcher::wait_for_registrations(uv_loop_t* loop) {
  while (pending_thresholds > 0) uv_run(loop, UV_RUN_ONCE);
}

void LimitsWatcher::watch_memory_threshold() {
  auto* job = new ThresholdJob;
  job->dir = cg_->dir_of("memory");
  job->bytes = r_.memory / 10 * 9;
  job->owner = this;
  job->req.data = job;
  threshold_job_ = job;
  ++pending_thresholds;
  uv_queue_work(
      loop_, &job->req,
      [](uv_work_t* r) {
        auto* j = static_cast<ThresholdJob*>(r->data);
        j->fd = os::CgroupDir::memory_threshold_eventfd(j->dir, j->bytes);
      },
      [](uv_work_t* r, int) {
        std::unique_ptr<ThresholdJob> j(static_cast<ThresholdJob*>(r->data));
        --pending_thresholds;
        if (j->owner) j->owner->threshold_registered(*j);
      });
}

void LimitsWatcher::threshold_registered(ThresholdJob& job) noexcept {
  threshold_job_ = nullptr;
  if (stopped_) return;
  if (!job.fd) {
    log()->warn("watch the memory of the branch's group: {} (read on the tick instead)", job.fd.error().message());
    return;
  }
  warn_fd_ = std::move(*job.fd);
  if (auto poll = loop::UvHandle<uv_poll_t>::make(loop_, uv_poll_init, warn_fd_.get())) {
    warn_poll_ = std::move(*poll);
    warn_poll_->data = this;
    uv_poll_start(warn_poll_.get(), UV_READABLE, [](uv_poll_t* h, int, int) noexcept {
      auto* self = static_cast<LimitsWatcher*>(h->data);
      uint64_t n;
      (void)!::read(self->warn_fd_.get(), &n, sizeof n);
      self->tick();
    });
  } else {
    log()->warn("watch the memory of the branch's group: {} (read on the tick instead)", poll.error().message);
  }
}

LimitsWatcher::~LimitsWatcher() {
  if (threshold_job_) threshold_job_->owner = nullptr;
}

void LimitsWatcher::arm_timeout() noexcept {
  int64_t left = std::max<int64_t>(timeout_due_ - static_cast<int64_t>(uv_now(loop_)), 0);
  uv_timer_start(
      timeout_.get(), [](uv_timer_t* t) noexcept { static_cast<LimitsWatcher*>(t->data)->on_timeout(); },
      static_cast<uint64_t>(left), 0);
}

void LimitsWatcher::pause() noexcept {
  if (paused_++ > 0) return;
  paused_at_ = static_cast<int64_t>(uv_now(loop_));
  if (timeout_) uv_timer_stop(timeout_.get());
}

void LimitsWatcher::resume() noexcept {
  if (paused_ == 0 || --paused_ > 0) return;
  // The clocks go on from where they stood: the stopped time is added to both.
  int64_t stood = static_cast<int64_t>(uv_now(loop_)) - paused_at_;
  last_activity_ += stood;
  if (timeout_ && !stopped_) {
    timeout_due_ += stood;
    arm_timeout();
  }
}

void LimitsWatcher::stop() noexcept {
  stopped_ = true;
  if (tick_) uv_timer_stop(tick_.get());
  if (timeout_) uv_timer_stop(timeout_.get());
}

void LimitsWatcher::on_output() noexcept { last_activity_ = static_cast<int64_t>(uv_now(loop_)); }

void LimitsWatcher::end(const std::string& reason, bool now) {
  if (stopped_ || !ended_for_.empty()) return;
  ended_for_ = reason;
  log()->info("end the branch's tree: {}", reason);
  if (cb_.end_tree) cb_.end_tree(reason, now);
}

void LimitsWatcher::on_timeout() noexcept {
  try {
    end("timeout", false);
  } catch (const std::exception& e) {
    log()->error("limits timeout: {}", e.what());
  }
}

void LimitsWatcher::on_oom_event() noexcept {
  uint64_t n;
  (void)!::read(oom_fd_.get(), &n, sizeof n);
  try {
    check_oom();
  } catch (const std::exception& e) {
    log()->error("limits OOM event: {}", e.what());
  }
}

void LimitsWatcher::check_oom() const {
  if (!cg_) return;
  auto k = cg_->oom_kills();
  if (!k || *k <= oom_kills_) return;
  oom_kills_ = *k;
  boost::json::object e{{"type", "limit.hit"}, {"limit", "memory"}, {"oom_kills", *k}};
  e["value"] = cg_->memory_current().value_or(0);
  e["ceiling"] = r_.memory;
  if (cb_.emit) cb_.emit(std::move(e));
}

void LimitsWatcher::tick() noexcept {
  if (stopped_) return;
  try {
    auto now = static_cast<int64_t>(uv_now(loop_));
    if (threshold_wanted_) {
      threshold_wanted_ = false;
      watch_memory_threshold();
    }
    if (cg_) {
      check_oom();
      if (r_.memory > 0) {
        if (auto cur = cg_->memory_current()) {
          if (!mem_warned_ && *cur * 10 >= r_.memory * 9) {
            mem_warned_ = true;
            if (cb_.emit)
              cb_.emit({{"type", "limit.warning"}, {"limit", "memory"}, {"value", *cur}, {"ceiling", r_.memory}});
          } else if (mem_warned_ && *cur * 10 < r_.memory * 8) {
            mem_warned_ = false;  // a new crossing gets a new warning
          }
        }
      }
      if (auto ev = cg_->pids_max_events(); ev && r_.pids > 0) {
        if (*ev > pids_events_) {
          pids_events_ = *ev;
          pids_last_fail_ = now;
          if (pids_first_fail_ < 0) {
            pids_first_fail_ = now;
            if (cb_.emit)
              cb_.emit({{"type", "limit.hit"},
                        {"limit", "pids"},
                        {"value", cg_->pids_current().value_or(0)},
                        {"ceiling", r_.pids},
                        {"failed_forks", *ev}});
          }
          if (now - pids_first_fail_ >= r_.pids_grace_ms) end("pids_limit", true);
        } else if (pids_first_fail_ >= 0 && now - pids_last_fail_ > std::max<int64_t>(r_.pids_grace_ms, 500)) {
          pids_first_fail_ = -1;  // the storm passed; a new one gets a new limit.hit
        }
      }
      // CPU time since the last activity, summed: slow steady work counts as much as a burst.
      if (auto cpu = cg_->cpu_usage_us()) {
        if (last_cpu_us_ < 0 || *cpu - last_cpu_us_ >= kIdleCpuUs) {
          if (last_cpu_us_ >= 0) last_activity_ = now;
          last_cpu_us_ = *cpu;
        }
      }
    }
    if (r_.idle_ms > 0 && paused_ == 0 && now - last_activity_ >= r_.idle_ms) end("idle", false);
  } catch (const std::exception& e) {
    log()->error("limits tick: {}", e.what());
  }
}

}  // namespace sbx::supervisor
