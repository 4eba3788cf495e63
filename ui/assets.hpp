#pragma once
// The page's files, compiled into the binary by cmake/embed-ui.cmake from ui/web's esbuild bundle,
// so `sandboxer ui` needs neither Node.js nor the network at run time.
#include <optional>
#include <string_view>

namespace sbx::ui {

struct Asset {
  std::string_view content_type;
  std::string_view body;
};

/// The file at `name` (index.html, app.js, app.css), if the page has it.
std::optional<Asset> find_asset(std::string_view name);
/// False when the build had no node/npm to make the bundle: the page cannot be served.
bool have_bundle();

}  // namespace sbx::ui
