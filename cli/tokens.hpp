#pragma once
// Tokens of boxes: from --token-file, SANDBOXER_TOKEN, or the per-URL store the CLI keeps for the
// boxes it started ($XDG_STATE_HOME/sandboxer/tokens/, files of mode 0600).
#include <string>
#include <vector>

namespace sbx::cli {

/// The store's directory (created, mode 0700).
std::string token_dir();
/// The file of `url` in the store.
std::string token_path(const std::string& url);
/// A new random token written to `path` (mode 0600); returns it.
std::string create_token_file(const std::string& path);
/// The token for `url`: `token_file` if given, else SANDBOXER_TOKEN, else the store; throws
/// std::runtime_error saying where it looked.
std::string find_token(const std::string& url, const std::string& token_file);

/// Takes "--token-file F" out of args; returns F or "".
std::string take_token_file(std::vector<std::string>& args);

}  // namespace sbx::cli
