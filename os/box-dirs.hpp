#pragma once
// The record of the state dirs this user's boxes have run in outside the default root
// (default_box_root, which `sandboxer ps --all` lists by itself): STATE_HOME/box-dirs, so that
// the stopped boxes are found wherever their state dirs are. A JSON object a line: {"dir":
// REAL_PATH} for each start, appended; the first line of a compacted record, {"compacted":
// BYTES}, says how long it was then. Every writer holds an flock(2) on the file; a compaction
// writes a new file and renames it over the old one, and a writer whose lock turns out to be on
// the old file opens the new one.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include "base/result.hpp"
namespace sbx::os {

/// The record's name in the user's state dir.
inline constexpr const char* kBoxDirsFile = "box-dirs";

/// Appends `dir` (an absolute real path) to the record in `state_home`, a directory of this user's
/// that no one else may enter (own_private_dir, made where missing). The record is a regular file
/// of this user's that no one else may write (0600), reached without following a symlink; anything
/// else at its place is refused, named, and left as it is. Where the record has grown past
/// `compact_at` bytes and to twice its length at its last compaction, it is compacted as
/// recorded_box_dirs does, keeping the dirs that hold_box_json.
base::Result<void> record_box_dir(const std::string& state_home, const std::string& dir,
                                  uint64_t compact_at = 64 * 1024);

/// The dirs recorded in `state_home`, each once, in the order first recorded, without those
/// `keep` refuses (a dir removed since). Where the record held any of those, a repeat or a line
/// that is no record (cut short by a full disk), it is rewritten without them (where that fails,
/// as on a full disk, it is left as it was: the list is the same). No record: none.
base::Result<std::vector<std::string>> recorded_box_dirs(const std::string& state_home,
                                                         const std::function<bool(const std::string&)>& keep);

/// Whether `dir` is a directory (not a symlink) holding a box.json that is a regular file: a state
/// dir, as far as a listing can tell.
bool holds_box_json(const std::string& dir);

}  // namespace sbx::os
