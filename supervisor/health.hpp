#pragma once
// `sandboxer-init --health`, the image's HEALTHCHECK: healthy when the supervisor that is PID 1
// of this container is alive and, when it serves the WebSocket API, that listener answers a
// WebSocket upgrade. The supervisor says where it listens in a small file under /run, written
// once its server is up; the probe itself is shared with the CLI, which waits for a box started
// by `sandboxer up` the same way.
#include <sys/types.h>

#include <optional>
#include <string>

#include "base/result.hpp"

namespace sbx::supervisor {

/// Written by a supervisor that is PID 1 (a container's init); read by `--health`.
inline constexpr const char* kHealthFile = "/run/sandboxer/init.json";
/// Names another file for both (a container whose /run is read-only): its value, an absolute path.
inline constexpr const char* kHealthFileEnv = "SANDBOXER_HEALTH_FILE";

/// The health file: $SANDBOXER_HEALTH_FILE when set, else kHealthFile; an error naming the
/// variable when it is set to something else than an absolute path.
base::Result<std::string> health_file_path();

/// Records pid, listen address and port (port 0: no server) in `path`, atomically.
void write_health_file(const std::string& path, pid_t pid, const std::string& addr, int port) noexcept;

/// The `--health` mode: 0 healthy, 1 unhealthy (Docker's HEALTHCHECK convention), one line on
/// stdout saying which and why.
int health_main();

}  // namespace sbx::supervisor
