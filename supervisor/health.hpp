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
/// kHealthFile's directory, sandboxer's own.
inline constexpr const char* kHealthDir = "/run/sandboxer";
/// Names another file for both (a container whose /run is read-only): its value, an absolute path.
inline constexpr const char* kHealthFileEnv = "SANDBOXER_HEALTH_FILE";

/// The health file: $SANDBOXER_HEALTH_FILE when set, else kHealthFile; an error naming the
/// variable when it is set to something else than an absolute path.
base::Result<std::string> health_file_path();

/// The file a supervisor wrote (its device and inode), so that it removes its own and no other.
struct HealthFileId {
  dev_t dev = 0;
  ino_t ino = 0;
};

/// Records pid, listen address and port (port 0: no server) in `path`, atomically; returns the
/// file written (ino 0 where it could not be written: best effort, the box runs without it).
HealthFileId write_health_file(const std::string& path, pid_t pid, const std::string& addr, int port) noexcept;

/// Removes `path` at the supervisor's end if it is still the file `id` names: under
/// `unshare --pid --fork` on a host, every such box is PID 1 and shares the host's /run, and
/// none leaves its file behind there, nor removes another's. The default file's directory
/// (/run/sandboxer) is removed with it when nothing else is left in it.
void remove_health_file(const std::string& path, HealthFileId id) noexcept;

/// The `--health` mode: 0 healthy, 1 unhealthy (Docker's HEALTHCHECK convention), one line on
/// stdout saying which and why.
int health_main();

}  // namespace sbx::supervisor
