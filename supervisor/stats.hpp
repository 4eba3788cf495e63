#pragma once
// Resource use of the box and its processes, read from /proc: cpu seconds, resident memory and
// the number of processes of a process tree, its private, proportional and KSM-merged memory,
// and the disk a branch uses. `metrics` events carry
// the same numbers at a fixed cadence.
#include <sys/types.h>
#include <uv.h>

#include <boost/json.hpp>
#include <cstdint>
#include <string>

#include "loop/uv-handle.hpp"

namespace sbx::supervisor {

class Box;

struct TreeStats {
  double cpu_s = 0;
  uint64_t memory = 0;  // resident bytes, summed
  uint64_t pids = 0;
  // From /proc/PID/smaps_rollup, summed: pages no other process maps (what the tree alone costs;
  // with KSM, merged pages leave it), the proportional share, and pages merged by KSM.
  uint64_t memory_private = 0;
  uint64_t memory_pss = 0;
  uint64_t memory_ksm = 0;
  TreeStats& operator+=(const TreeStats& o) {
    cpu_s += o.cpu_s;
    memory += o.memory;
    pids += o.pids;
    memory_private += o.memory_private;
    memory_pss += o.memory_pss;
    memory_ksm += o.memory_ksm;
    return *this;
  }
};

/// `root` and every descendant of it.
TreeStats tree_stats(pid_t root);
/// Bytes allocated under `dir` (st_blocks), walking at most `max_entries` entries, by fd and
/// following no symlink (`dir` is where an agent writes).
uint64_t disk_used(const std::string& dir, size_t max_entries = 100000);

/// The reply of `stats` and the body of `metrics`: the box (the supervisor's whole tree), each
/// branch and each running proc.
boost::json::object collect_stats(const Box& box, uint64_t* memory_peak);

class MetricsTimer {
 public:
  MetricsTimer(Box& box, uv_loop_t* loop, uint64_t every_ms);
  MetricsTimer(const MetricsTimer&) = delete;
  MetricsTimer& operator=(const MetricsTimer&) = delete;

 private:
  Box& box_;
  loop::UvHandle<uv_timer_t> timer_;
  uint64_t peak_ = 0;
};

}  // namespace sbx::supervisor
