#pragma once
/// Snapshot archives out of and into the box over HTTP (snapshot-http.cpp), after the server has
/// checked the secret: the page's download (GET SECRET/snapshot/<id>.tar.zst) and import (POST
/// SECRET/snapshot/import).
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "ui/hub.hpp"

namespace sbx::ui {

/// The snapshot id a request's path (after the secret) asks for, or nullopt for another path.
std::optional<std::string> snapshot_download(std::string_view rest);

/// Answers a download of snapshot `id` on `out`: its archive (application/zstd, its length, as
/// an attachment), or a status with one line of text saying why not (400: not an id; 404: no such
/// snapshot, or a journal's page; 502: the box could not be reached or refused otherwise). A
/// failure after the header throws: the caller closes the connection, so the download fails
/// rather than ends short. `headers` sets the server's own headers on either response. The
/// connection is not kept alive.
asio::awaitable<void> serve_snapshot(std::shared_ptr<Hub> hub, beast::tcp_stream& out, unsigned version, std::string id,
                                     std::function<void(http::response_header<>&)> headers);

/// The path of an import, after the secret.
inline constexpr std::string_view kImportPath = "snapshot/import";

/// Answers an import whose header `head` has read: its body (Content-Length bytes, else 411) fed
/// to the box's snapshot.import as it arrives, and the box's reply as the response (200 with its
/// JSON; 404 a journal's page; 400 a body that ended short; 502 the box unreachable, its refusal
/// or its connection's end, with its message). Reads the body from `buf`, then `in`. The
/// connection is not kept alive.
asio::awaitable<void> serve_import(std::shared_ptr<Hub> hub, beast::tcp_stream& in, beast::flat_buffer& buf,
                                   http::request_parser<http::empty_body>& head,
                                   std::function<void(http::response_header<>&)> headers);

}  // namespace sbx::ui
