#pragma once
// Whether a WebSocket API answers at an address: the image's HEALTHCHECK (sandboxer-init
// --health) and the CLI's wait for a box it started use the same probe.
#include <optional>
#include <string>

namespace sbx::protocol {

/// Sends a WebSocket upgrade request (subprotocol sandboxer.v1, no token) to addr:port and reads
/// the status line. The server answers 101 (and waits for an auth frame) or 401: either means the
/// API is up. Returns nullopt when it answered, else what went wrong.
std::optional<std::string> probe_websocket(const std::string& addr, int port, int timeout_ms);

}  // namespace sbx::protocol
