#pragma once
// Whether a WebSocket API answers at an address: the image's HEALTHCHECK (sandboxer-init
// --health) and the CLI's wait for a box it started use the same probe.
#include <string>

#include "base/result.hpp"

namespace sbx::protocol {

/// Sends a WebSocket upgrade request (subprotocol sandboxer.v1, no token) to addr:port and reads
/// the status line. The server answers 101 (and waits for an auth frame) or 401: either means the
/// API is up. The error says what went wrong.
///
/// With a `token` (sent as a bearer token) only 101 means up: it is then this box that answers,
/// not another server that took the port. A 401 fails with the code "unauthorized".
base::Result<void> probe_websocket(const std::string& addr, int port, int timeout_ms, const std::string& token = "");

}  // namespace sbx::protocol
