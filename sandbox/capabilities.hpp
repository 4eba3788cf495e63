#pragma once
// What this host lets the supervisor do, detected at start and reported in `box.started`.
#include <boost/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace sbx::sandbox {

struct HostCapabilities {
  std::string cgroup = "none";     // v1, v2, none
  boost::json::array controllers;  // the controllers this process may use
  bool namespaces = false;
  std::string namespaces_why_not;
  bool seccomp = false;
  int landlock_abi = 0;
  bool overlay = false;
  std::optional<std::string> criu;    // version
  std::string isolation = "process";  // process, container, gvisor, microvm

  boost::json::object to_json() const;
};

/// A command started now whose stdout is read later: start-up probes (`criu --version` takes
/// several ms) run while the supervisor does its other work. Only for use before the loop starts
/// (it waits by pid); the destructor kills and reaps a probe never read.
class CommandProbe {
 public:
  explicit CommandProbe(const std::vector<std::string>& argv);
  ~CommandProbe();
  CommandProbe(const CommandProbe&) = delete;
  CommandProbe& operator=(const CommandProbe&) = delete;
  /// Its stdout once it exits 0; nullopt if it could not start, failed, or took longer.
  std::optional<std::string> output(int timeout_ms = 5000);

 private:
  int pid_ = -1;
  int fd_ = -1;
};

/// The version `criu --version` printed, or nullopt.
std::optional<std::string> criu_version_of(const std::optional<std::string>& out);

/// The version of the criu at `criu` (checkpoint::find_criu's answer), for box.started: from the
/// cache file kCriuVersionCache in `cache_dir` when that was written for this same file (its path,
/// device, inode, size, modification and change times), else from `criu --version`, started at
/// construction and cached once read. The probe costs every box's start several ms of a CPU while
/// its agent starts; the cache, a stat and a read. The cache is advisory and bounded: a missing,
/// unreadable, foreign or malformed one (a symlink is not followed) means the probe runs, and one
/// that cannot be written means the next start probes again. `cache_dir` empty: no cache.
class CriuVersionProbe {
 public:
  CriuVersionProbe(const std::optional<std::string>& criu, const std::string& cache_dir);
  /// The version; nullopt without a criu, or when it would not say within `timeout_ms`.
  std::optional<std::string> version(int timeout_ms = 3000);
  /// True when the answer came from the cache (no criu was started).
  bool cached() const { return from_cache_; }

 private:
  std::string cache_dir_;
  std::string key_;  // the file's identity; empty when it could not be had (no cache then)
  std::optional<std::string> version_;
  bool from_cache_ = false;
  std::optional<CommandProbe> probe_;
};

inline constexpr const char* kCriuVersionCache = "criu-version.json";

/// Everything but criu's version unless `criu` is given (a probe started earlier). Without
/// `probe_namespaces`, `namespaces` is taken as true unprobed: for a caller whose own clone of the
/// namespaces finds out, and falls back, anyway (launch_branch), so that no throwaway clone sits on
/// the agent's path.
HostCapabilities detect_capabilities(CommandProbe* criu = nullptr, bool probe_namespaces = true);

/// Whether a branch whose profile asks for namespaces may run without them where the host refuses
/// them or their mount plan fails (`isolation.without_namespaces`): "run" always, "refuse" never,
/// "auto" unless this supervisor is root in the host's own user namespace and either holds
/// CAP_SYS_ADMIN (a host, or a privileged container: nothing around it holds anything in) or
/// has no container around it (`isolation` "process"): there such an agent would be root on the
/// host itself, its files, its processes and the box's token in reach. Elsewhere (a gVisor
/// sandbox or a microVM, a container without CAP_SYS_ADMIN, as Docker's default, a user
/// namespace a user made, a supervisor without privileges) something still holds the agent in,
/// and the box runs saying why. Returns "" where it may, else why not.
std::string flat_fallback_refusal(const std::string& mode, const HostCapabilities& caps);

/// Runs `argv` and returns its stdout; only for use before the loop starts (it waits by pid).
std::optional<std::string> run_and_capture(const std::vector<std::string>& argv, int timeout_ms = 5000);

}  // namespace sbx::sandbox
