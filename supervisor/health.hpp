#pragma once
// `sandboxer-init --health`, the image's HEALTHCHECK: healthy when the supervisor that is PID 1
// of this container is alive and, when it serves the WebSocket API, that listener answers a
// WebSocket upgrade. The supervisor says where it listens in a small file under /run, written
// once its server is up; the probe itself is shared with the CLI, which waits for a box started
// by `sandboxer up` the same way.
#include <sys/types.h>

#include <optional>
#include <string>

namespace sbx::supervisor {

/// Written by a supervisor that is PID 1 (a container's init); read by `--health`.
inline constexpr const char* kHealthFile = "/run/sandboxer/init.json";

/// Records pid, listen address and port (port 0: no server) in `path`, atomically.
void write_health_file(const std::string& path, pid_t pid, const std::string& addr, int port) noexcept;

/// The `--health` mode: 0 healthy, 1 unhealthy (Docker's HEALTHCHECK convention), one line on
/// stdout saying which and why.
int health_main(const std::string& path = kHealthFile);

}  // namespace sbx::supervisor
