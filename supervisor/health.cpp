#include "supervisor/health.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "os/sys.hpp"
#include "protocol/probe.hpp"

namespace sbx::supervisor {

HealthFileId write_health_file(const std::string& path, pid_t pid, const std::string& addr, int port) noexcept {
  try {
    boost::json::object o{{"pid", pid}, {"addr", addr}, {"port", port}};
    auto slash = path.rfind('/');
    // Twice: another box's end may remove the directory (remove_health_file) between its mkdir
    // and the write.
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (slash != std::string::npos) (void)os::make_dirs(path.substr(0, slash), 0755);
      struct stat st {};
      auto r = os::write_file_atomic(path, boost::json::serialize(o) + "\n", 0644, &st);
      if (r) return {st.st_dev, st.st_ino};
      if (r.error() != std::errc::no_such_file_or_directory) break;
    }
    return {};
  } catch (...) {
    // Health reporting is best effort: the box runs without it.
    return {};
  }
}

void remove_health_file(const std::string& path, HealthFileId id) noexcept {
  struct stat st {};
  if (id.ino == 0 || ::lstat(path.c_str(), &st) != 0 || st.st_dev != id.dev || st.st_ino != id.ino) return;
  (void)::unlink(path.c_str());
  // sandboxer's own directory under /run goes with the last box's file (another box's file, or
  // anything else in it, keeps it); a directory $SANDBOXER_HEALTH_FILE names is the caller's.
  if (path == kHealthFile) (void)::rmdir(kHealthDir);
}

base::Result<std::string> health_file_path() {
  const char* env = std::getenv(kHealthFileEnv);
  if (!env || !*env) return std::string(kHealthFile);
  if (*env != '/') return base::fail(std::string(kHealthFileEnv) + " is \"" + env + "\": not an absolute path");
  return std::string(env);
}

int health_main() {
  auto named = health_file_path();
  if (!named) {
    std::cout << "unhealthy: " << named.error().message << "\n";
    return 1;
  }
  const std::string& path = *named;
  auto text = os::read_file(path);
  if (!text) {
    std::cout << "unhealthy: read " << path << ": " << text.error().message()
              << " (the supervisor has not started, or is not this container's PID 1)\n";
    return 1;
  }
  boost::system::error_code ec;
  auto v = boost::json::parse(*text, ec);
  const auto* o = v.if_object();
  if (ec || !o) {
    std::cout << "unhealthy: " << path << " is not a JSON object\n";
    return 1;
  }
  auto pid = o->contains("pid") ? boost::json::try_value_to<int64_t>(o->at("pid")) : boost::system::result<int64_t>(0);
  auto port =
      o->contains("port") ? boost::json::try_value_to<int64_t>(o->at("port")) : boost::system::result<int64_t>(0);
  auto addr = o->contains("addr") ? boost::json::try_value_to<std::string>(o->at("addr")) : std::string();
  if (!pid || !port || !addr || *pid <= 0) {
    std::cout << "unhealthy: " << path << ": pid, addr or port missing or of the wrong type\n";
    return 1;
  }
  if (::kill(static_cast<pid_t>(*pid), 0) != 0 && errno == ESRCH) {
    std::cout << "unhealthy: the supervisor (pid " << *pid << ") is gone\n";
    return 1;
  }
  if (*port == 0) {
    std::cout << "healthy: the supervisor (pid " << *pid << ") runs; it serves no WebSocket API\n";
    return 0;
  }
  if (auto r = protocol::probe_websocket(*addr, static_cast<int>(*port), 2000); !r) {
    std::cout << "unhealthy: " << r.error().message << "\n";
    return 1;
  }
  std::cout << "healthy: the WebSocket API on " << *addr << ":" << *port << " answers\n";
  return 0;
}

}  // namespace sbx::supervisor
