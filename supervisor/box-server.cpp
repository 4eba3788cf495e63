// The box's network side: the WebSocket server (when --listen is given) and the metrics timer.
#include <spdlog/spdlog.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "supervisor/box.hpp"
#include "supervisor/health.hpp"
#include "supervisor/server.hpp"
#include "supervisor/stats.hpp"

namespace sbx::supervisor {

void Box::start_server() {
  if (server_ || metrics_) return;  // once per box
  if (opts_.metrics_ms > 0)
    metrics_ = std::make_unique<MetricsTimer>(*this, loop_, static_cast<uint64_t>(opts_.metrics_ms));
  if (opts_.listen.empty()) {
    if (!opts_.health_file.empty()) health_id_ = write_health_file(opts_.health_file, ::getpid(), "", 0);
    return;
  }
  ServerOptions so = parse_listen(opts_.listen);
  so.token = opts_.token;
  so.tls_cert = opts_.tls_cert;
  so.tls_key = opts_.tls_key;
  if (auto* q = std::getenv("SANDBOXER_WS_QUEUE_BYTES")) so.queue_bytes = std::strtoull(q, nullptr, 10);
  if (auto* r = std::getenv("SANDBOXER_WS_RECENT_BYTES")) so.recent_bytes = std::strtoull(r, nullptr, 10);
  if (auto* t = std::getenv("SANDBOXER_WS_STALL_SECONDS")) so.stall_s = std::max(1, std::atoi(t));
  server_ = std::make_unique<Server>(*this, loop_, so);
  if (!opts_.health_file.empty())
    health_id_ = write_health_file(opts_.health_file, ::getpid(), so.addr, server_->port());
  note_url(so);
}

// STATE/url: the box's URL (the client's address for 0.0.0.0 and ::), read by `sandboxer ps`
// while the state dir's lock is held; written through the state dir's fd the lock holds.
void Box::note_url(const ServerOptions& so) {
  if (!state_lock_) return;
  std::string host = so.addr == "0.0.0.0" ? "127.0.0.1" : so.addr == "::" ? "::1" : so.addr;
  if (host.find(':') != std::string::npos) host = "[" + host + "]";
  std::string url =
      std::string(so.tls_cert.empty() ? "ws://" : "wss://") + host + ":" + std::to_string(server_->port()) + "\n";
  if (auto r = os::write_file_atomic_at(state_lock_.get(), "url", url); !r)
    spdlog::warn("note the box's URL in {}/url: {}", opts_.state_dir, r.error().message());
}

}  // namespace sbx::supervisor
