#pragma once
/// One file into or out of a box, over a WebSocket connection of its own (Boost.Beast, on an
/// io_context of its own: beast.hpp says why not libwebsockets' client): `sandboxer cp`,
/// `export` and `import`.
#include <boost/json.hpp>
#include <cstdint>
#include <functional>

#include "base/result.hpp"
#include "sandboxer/client.hpp"

namespace sbx::sdk {

struct FileTransfer {
  Endpoint box;
  /// fs.read or snapshot.export (a download), fs.write or snapshot.import (an upload); its id is
  /// set to 1 unless it has one in [0, 2^32), as binary frames' headers carry it.
  boost::json::object request;
  bool upload = false;
  /// An upload sends `size` bytes of `fd` from offset 0, in 1 MiB frames.
  int fd = -1;
  uint64_t size = 0;
  /// A download opens its file when the box's reply says ok (nothing is truncated for a box that
  /// cannot be reached or refuses): an fd the frames' bytes are written to at their offsets, or -1
  /// with errno set.
  std::function<int()> open_sink;
  /// Asked every 100 ms; true ends the transfer with the error "interrupted".
  std::function<bool()> interrupted;
};

/// Runs `t` to its end: the box's reply (ok or not; a download's once its last frame is written,
/// an upload's after its last frame). Errors, with their codes: "connect" (the connection or its
/// handshake failed: the reason, e.g. "Connection refused (nothing listens on HOST:PORT)"),
/// "closed" (it closed before the end: the close code and reason), "local" ("open: ", "read: " or
/// "write: " and the system's reason), "protocol" (a frame out of order), "interrupted".
base::Result<boost::json::object> transfer_file(FileTransfer t);

}  // namespace sbx::sdk
