#pragma once
// What this host lets the supervisor do, detected at start and reported in `box.started`.
#include <boost/json.hpp>
#include <optional>
#include <string>

namespace sbx::supervisor {

struct HostCapabilities {
  std::string cgroup = "none";        // v1, v2, none
  boost::json::array controllers;     // the controllers this process may use
  bool namespaces = false;
  std::string namespaces_why_not;
  bool seccomp = false;
  int landlock_abi = 0;
  bool overlay = false;
  std::optional<std::string> criu;    // version
  std::string isolation = "process";  // process, container, gvisor, microvm

  boost::json::object to_json() const;
};

HostCapabilities detect_capabilities();

/// Runs `argv` and returns its stdout; only for use before the loop starts (it waits by pid).
std::optional<std::string> run_and_capture(const std::vector<std::string>& argv, int timeout_ms = 5000);

}  // namespace sbx::supervisor
