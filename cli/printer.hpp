#pragma once
// Shows events to a person, or as JSON lines with --json.
#include <boost/json.hpp>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>

namespace sbx::cli {

/// A size for a person: "512 B", "1.5 KiB", "12.0 MiB", "3.2 GiB".
std::string human_bytes(double bytes);

/// `name` as a terminal may show it: a control byte (below 0x20, 0x7f), a backslash, a byte that
/// is not part of valid UTF-8 and a C1 control (U+0080..U+009F) as \xNN, so that a name the agent
/// chose (a file's) can neither move the cursor nor retitle the user's terminal, and shows which
/// bytes it has. Without `escape_backslash`, for a message (Session::report): a backslash stays.
std::string printable(std::string_view name, bool escape_backslash = true);

class EventPrinter {
 public:
  EventPrinter(bool json, std::FILE* out = stdout) : json_(json), out_(out) {}
  /// `line` is the event as received; `ev` its parsed form.
  void print(std::string_view line, const boost::json::object& ev);

 private:
  void output(const boost::json::object& ev);
  bool json_;
  std::FILE* out_;
  std::map<std::string, bool> midline_;  // proc/stream -> last output did not end in a newline
};

}  // namespace sbx::cli
