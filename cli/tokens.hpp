#pragma once
// The CLI's per-URL token store (DESIGN.md, "The CLI"): the token of every box the CLI started,
// one file per URL under $XDG_STATE_HOME/sandboxer/tokens/ (mode 0600, the directory 0700), so
// `sandboxer attach URL` needs no flag. The file name is the normalized URL with every byte outside
// [A-Za-z0-9._~-] written %XX (Python's urllib.parse.quote(url, safe="")): the format
// shims/common.py writes and sdk/python reads; the file holds the token alone.
#include <optional>
#include <string>
#include <vector>

namespace sbx::cli {

/// $XDG_STATE_HOME/sandboxer (else ~/.local/state/sandboxer).
std::string state_home();
/// The store's directory.
std::string token_dir();
/// The file that holds the token for `url` (which need not exist).
std::string token_path(const std::string& url);
/// Writes the token for `url` (0600); throws std::runtime_error naming the file on failure.
void save_token(const std::string& url, const std::string& token);
/// The token for `url`, or nullopt when the store has none.
std::optional<std::string> load_token(const std::string& url);
/// Removes the token for `url`; no error when there was none.
void forget_token(const std::string& url);

}  // namespace sbx::cli
