#pragma once
/// A snapshot's archive out of the box as an HTTP download (download.cpp): the page's "download"
/// link, GET SECRET/snapshot/<id>.tar.zst, after the server has checked the secret.
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

}  // namespace sbx::ui
