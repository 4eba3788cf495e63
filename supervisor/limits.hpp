#pragma once
// The limits watcher of one branch: OOM kills (v1: memory.oom_control through an eventfd
// registered in cgroup.event_control; v2: memory.events), memory at 90 % of its ceiling
// (limit.warning), forks refused at the pids ceiling (pids.events "max N": limit.hit, and the
// tree is ended after the profile's pids_grace), the wall-clock timeout and the idle timer (no
// output and no CPU time in the group). Every source is a handle on the supervisor's loop.
#include <uv.h>

#include <boost/json.hpp>
#include <functional>
#include <string>

#include "loop/uv-handle.hpp"
#include "os/cgroup.hpp"
#include "profile/profile.hpp"

namespace sbx::supervisor {

class LimitsWatcher {
 public:
  struct Callbacks {
    /// A limit.warning or limit.hit event (without branch; the caller adds it).
    std::function<void(boost::json::object)> emit;
    /// End the branch's tree for `reason` (pids_limit, timeout, idle); `now`: KILL at once.
    std::function<void(const std::string& reason, bool now)> end_tree;
  };

  /// `cg` may be null (no cgroup on this host): then only the timers run.
  LimitsWatcher(uv_loop_t* loop, const os::CgroupDir* cg, const profile::Profile::Resources& r, Callbacks cb);
  LimitsWatcher(const LimitsWatcher&) = delete;
  LimitsWatcher& operator=(const LimitsWatcher&) = delete;
  ~LimitsWatcher();

  void start();
  /// Runs `loop` until every threshold registration still on the thread pool has come back (its
  /// eventfd closed where its watcher is gone): for the box's teardown, outside any callback.
  static void wait_for_registrations(uv_loop_t* loop);
  /// The tree is gone: no more timers or ends (a late timeout must not rename a finished exit).
  void stop() noexcept;
  /// The branch wrote output: it is not idle.
  void on_output() noexcept;
  /// The tree is stopped by the supervisor (a checkpoint's dump or hold, a full journal): the
  /// timeout and idle clocks stand still until as many resume()s, and then go on from where they
  /// stood (an agent is not ended for time it was not let run). Nested: each source pauses once.
  void pause() noexcept;
  void resume() noexcept;

  /// Why the supervisor ended the tree ("" if it did not): pids_limit, timeout, idle.
  const std::string& ended_for() const { return ended_for_; }
  /// Whether the kernel OOM-killed a process of the group.
  bool oom_killed() const { return oom_kills_ > 0; }

  /// The tick, for the loop; public only so the C callback can reach it.
  void tick() noexcept;
  void on_oom_event() noexcept;
  void on_timeout() noexcept;
  /// Reads the OOM counter now (the exit of a killed agent can reach the loop before the event).
  void check_oom() const;

 private:
  struct ThresholdJob;
  void end(const std::string& reason, bool now);
  void arm_timeout() noexcept;
  void watch_memory_threshold();
  void threshold_registered(ThresholdJob& job) noexcept;

  uv_loop_t* loop_;
  const os::CgroupDir* cg_;
  profile::Profile::Resources r_;
  Callbacks cb_;
  // The fds before the polls that watch them: a poll is closed before its fd.
  os::UniqueFd oom_fd_;
  os::UniqueFd warn_fd_;
  loop::UvHandle<uv_timer_t> tick_;
  loop::UvHandle<uv_timer_t> timeout_;
  loop::UvHandle<uv_poll_t> oom_poll_;
  loop::UvHandle<uv_poll_t> warn_poll_;  // v1: memory crossed 90 % (the tick checks it as well)
  mutable int64_t oom_kills_ = 0;
  bool mem_warned_ = false;
  int64_t pids_events_ = 0;
  int64_t pids_first_fail_ = -1, pids_last_fail_ = -1;
  int64_t last_activity_ = 0;
  int64_t timeout_due_ = 0;  // when the timeout fires, on the loop's clock (0: no timeout)
  int paused_ = 0;           // pause()s not yet resumed
  int64_t paused_at_ = 0;
  int64_t last_cpu_us_ = -1;  // the group's CPU time at the last activity
  std::string ended_for_;
  bool stopped_ = false;
  bool threshold_wanted_ = false;          // v1, a memory ceiling: register at the first tick
  ThresholdJob* threshold_job_ = nullptr;  // the threshold's registration, while it runs
};

}  // namespace sbx::supervisor
