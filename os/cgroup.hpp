#pragma once
// cgroup v1 and v2 behind one interface. A CgroupDir is one group of the agent's tree: on v1 a
// directory per hierarchy (memory, cpu, cpuacct, pids, freezer may each sit on their own mount,
// at their own path), on v2 one directory. Groups are made under the supervisor's own current
// cgroup, per controller. The destructor kills whatever is left in the group and removes it.
#include <sys/types.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "os/sys.hpp"
#include "os/unique-fd.hpp"

namespace sbx::os {

/// Where this process sits in the cgroup hierarchies.
struct CgroupHost {
  std::string version = "none";  // v1, v2, none
  /// v1: the supervisor's own directory in each mounted hierarchy, by controller name (a
  /// co-mounted "cpu,cpuacct" hierarchy appears under both names, with the same directory).
  std::map<std::string, std::string> v1_dirs;
  /// v2: the supervisor's own directory in the unified hierarchy (also set on a hybrid host).
  std::string v2_dir;
  std::vector<std::string> controllers;  // usable controllers, for box.started and doctor
};

/// Reads /proc/self/cgroup and /proc/self/mountinfo.
CgroupHost detect_cgroups();

/// Where groups whose names start with `prefix` are, anywhere in the cgroup hierarchies this
/// process sees (not only below its own groups: a supervisor that ran from another cgroup made
/// them there): one CgroupHost per directory that holds some, on v1 one per hierarchy, for
/// CgroupDir::release_below. Each mount is walked `max_depth` levels down; a group found is not
/// looked into. A hybrid host's v2 mount is not walked (groups are made on v1 there).
std::vector<CgroupHost> hosts_holding(std::string_view prefix, int max_depth = 12);

/// The supervisor's own ceiling for "memory" (bytes) or "pids" in its current group; nullopt
/// when there is none (unlimited, or the controller is missing).
std::optional<int64_t> host_limit(const CgroupHost& host, const std::string& controller);

/// The number after `key` in "key N" lines (memory.events, pids.events, memory.oom_control,
/// cpu.stat); nullopt when the key is missing.
std::optional<int64_t> keyed_value(std::string_view text, std::string_view key);

/// One device an agent may use: type 'c' or 'b', major and minor (-1: any), access letters of
/// "rwm" (read, write, mknod).
struct DeviceRule {
  char type;
  int major, minor;
  const char* access;
};

/// The devices a branch may use, nothing else (not even mknod of another): null, zero, full,
/// random, urandom, tty, ptmx and the ptys, as the usual container runtimes allow.
const std::vector<DeviceRule>& default_device_rules();
/// "c 1:3 rwm, ..." for box.started.
std::string describe_device_rules(const std::vector<DeviceRule>& rules);

class CgroupDir {
 public:
  /// The controllers a branch's group uses on v1.
  static const std::vector<std::string>& v1_controllers();

  /// A v1 group named `name` in every hierarchy of `host` that carries one of v1_controllers().
  static Result<CgroupDir> create_v1(const CgroupHost& host, const std::string& name);
  /// A v2 group `name` below `parent` (a directory of a cgroup2 mount). Enables the controllers
  /// the parent offers in its subtree_control where it can; works with none (the core files).
  static Result<CgroupDir> create_v2(const std::string& parent, const std::string& name);
  /// The host's kind.
  static Result<CgroupDir> create(const CgroupHost& host, const std::string& name);

  /// The names of the groups below the host's own directories (any hierarchy) that start with
  /// `prefix`, each once.
  static std::vector<std::string> names_below(const CgroupHost& host, std::string_view prefix);

  /// The group `name` as it is below `host`'s directories: those of its directories that exist,
  /// none made and nothing written (empty where there is none).
  static CgroupDir find(const CgroupHost& host, const std::string& name);
  /// Every group below `host`'s directories whose name starts with `prefix` (its directories that
  /// exist, found): thawed, what is in it killed (2 s at most), removed. `on_each` is told of each
  /// once it is gone (`held`: it held processes), `on_error` of one that could not be removed, or,
  /// without `kill_held`, of one that holds processes in any hierarchy (left as it is, frozen or
  /// not; nothing is killed, not even a process that joins it while it is being removed). Returns
  /// how many groups were left because they hold processes (always 0 with `kill_held`).
  static size_t release_below(const CgroupHost& host, std::string_view prefix, bool kill_held,
                              const std::function<void(const std::string& name, bool held)>& on_each,
                              const std::function<void(const std::string& name, const std::string& why)>& on_error);
  CgroupDir() = default;
  CgroupDir(CgroupDir&& o) noexcept;
  /// Removes this group's directories first, except those `o` names as well (the same group
  /// made again): those pass to this object.
  CgroupDir& operator=(CgroupDir&& o) noexcept;
  CgroupDir(const CgroupDir&) = delete;
  CgroupDir& operator=(const CgroupDir&) = delete;
  ~CgroupDir();

  bool v2() const { return v2_; }
  bool empty() const { return dirs_.empty(); }
  /// Whether create() made every directory (none was there before): nothing can be in it yet.
  bool fresh() const { return fresh_; }
  /// The directory that carries `controller` ("" if none); on v2 the group's one directory.
  std::string dir_of(const std::string& controller) const;
  bool has(const std::string& controller) const;
  /// Every directory of the group (one per hierarchy on v1).
  std::vector<std::string> dirs() const;

  Result<void> set_memory(int64_t bytes);
  Result<void> set_cpus(double cpus);
  Result<void> set_pids(int64_t max);
  /// Lets the group's processes open and make only the devices `allow` lists: v1 the devices
  /// controller (devices.deny "a", then devices.allow per rule), v2 a BPF_PROG_TYPE_CGROUP_DEVICE
  /// program attached to the group (BPF_F_ALLOW_MULTI, so the host's own rules still hold).
  /// ENOTSUP where v1 has no devices hierarchy.
  Result<void> set_devices(const std::vector<DeviceRule>& allow);

  /// One O_WRONLY fd per directory through which a single-threaded child joins itself by writing
  /// "0", with no allocation, before it runs anything of its own: v1's `tasks` (the kernel moves
  /// the one thread without its global threadgroup lock, whose write side waits for an RCU grace
  /// period, 6-15 ms here; see Linux's cgroup_procs_write_start), v2's cgroup.procs (where the
  /// lock is taken either way). A v2 fd also takes another process's pid.
  Result<std::vector<UniqueFd>> open_join_fds() const;
  /// v2 only: an O_PATH fd on the group's directory, for clone3's CLONE_INTO_CGROUP (the child
  /// starts in the group: no move through cgroup.procs). ENOTSUP on v1.
  Result<UniqueFd> open_v2_dir() const;
  /// Joins `pid` (0: the caller) to every directory.
  Result<void> add(pid_t pid);
  /// The pids in the group (the first directory's cgroup.procs).
  std::vector<pid_t> pids() const;
  bool populated() const;

  /// KILL to every process in the group (cgroup.kill where the kernel has it), until it is empty
  /// or `timeout_ms` passed. Returns whether the group is empty.
  bool kill_all(int timeout_ms = 2000);
  /// Freezes or thaws the group (v2 cgroup.freeze; v1 the freezer hierarchy).
  Result<void> freeze(bool on);
  /// Whether the group is frozen now (v2 cgroup.events "frozen 1"; v1 freezer.state FROZEN).
  bool frozen() const;

  // Readings; nullopt where the controller is missing.
  std::optional<int64_t> memory_current() const;
  std::optional<int64_t> memory_max() const;
  std::optional<int64_t> oom_kills() const;
  std::optional<int64_t> pids_current() const;
  std::optional<int64_t> pids_max() const;
  std::optional<int64_t> pids_max_events() const;  // forks refused at pids.max
  std::optional<int64_t> cpu_usage_us() const;
  /// v1 only: an eventfd that becomes readable on each OOM of the group
  /// (memory.oom_control through cgroup.event_control). The caller owns it.
  Result<UniqueFd> oom_eventfd() const;
  /// v1 only: an eventfd that becomes readable when the memory use of the group whose memory
  /// directory is `memory_dir` (dir_of("memory")) crosses `bytes` (either way). The kernel waits
  /// for an RCU grace period to register it (~10 ms here): call it off the event loop; it reads no
  /// member, so the group's CgroupDir may go while it runs.
  static Result<UniqueFd> memory_threshold_eventfd(const std::string& memory_dir, int64_t bytes);

  /// Removes the directories now, after kill_all where a process is still in one (an rmdir
  /// refused with EBUSY); the destructor does the same.
  void remove();

 private:
  bool v2_ = false;
  bool fresh_ = true;
  std::map<std::string, std::string> by_controller_;  // controller -> dir
  std::vector<std::string> dirs_;                     // unique, creation order
};

}  // namespace sbx::os
