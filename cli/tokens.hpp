#pragma once
// Tokens of boxes: from --token-file, SANDBOXER_TOKEN, or the per-URL store the CLI keeps for the
// boxes it started ($XDG_STATE_HOME/sandboxer/tokens/, the directory 0700, files 0600 holding the
// token alone), so `sandboxer attach URL` needs no flag. A file's name is the normalized URL with
// every byte outside [A-Za-z0-9._~-] written %XX (Python's urllib.parse.quote(url, safe="")):
// the format shims/common.py writes and sdk/python reads.
#include <optional>
#include <string>

namespace sbx::cli {

/// $XDG_STATE_HOME/sandboxer, else ~/.local/state/sandboxer, else (no HOME) /tmp/sandboxer-UID,
/// made 0700 and checked to be this user's own directory and no symlink (std::runtime_error
/// saying why otherwise).
std::string state_home();
/// The store's directory (created 0700; refused unless it is a directory of this user's, not a
/// symlink; its mode is set back to 0700).
std::string token_dir();
/// The file of `url` in the store (which need not exist).
std::string token_path(const std::string& url);
/// A new random token written to `path`, a new file (O_EXCL | O_NOFOLLOW, mode 0600); returns it.
std::string create_token_file(const std::string& path);
/// The token for `url`: `token_file` if given, else SANDBOXER_TOKEN, else the store; throws
/// std::runtime_error saying where it looked.
std::string find_token(const std::string& url, const std::string& token_file);
/// Writes the token for `url` into the store (0600); throws std::runtime_error naming the file.
void save_token(const std::string& url, const std::string& token);
/// Removes the token for `url` from the store; no error when there was none.
void forget_token(const std::string& url);

}  // namespace sbx::cli
