#pragma once
/// One file into or out of a box, over a WebSocket connection of its own (Boost.Beast, on an
/// io_context of its own: beast.hpp says why not libwebsockets' client): `sandboxer cp`,
/// `export` and `import`.
#include <boost/json.hpp>
#include <cstdint>
#include <functional>
#include <vector>

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

/// Runs each of `ts` in turn on one connection (to the first one's box), as transfer_file runs
/// one: a request without an id gets its place in `ts` plus one. The first that does not end
/// with an ok reply ends the run: the results, in order, up to and including that one (all of
/// them when every one succeeded; one "connect" error when the connection failed).
std::vector<base::Result<boost::json::object>> transfer_files(std::vector<FileTransfer> ts);

}  // namespace sbx::sdk
