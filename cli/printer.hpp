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

/// JSON text with each C1 control (U+0080..U+009F, UTF-8 C2 80..C2 9F, which JSON may carry raw
/// and some terminals act on as ESC [ and the like) written as its \u escape: the same JSON,
/// safe in a terminal. Everything the CLI prints as JSON goes through it (the agent chooses names,
/// types and output).
std::string json_for_terminal(std::string_view json);
/// json_for_terminal of `v`'s serialization.
std::string json_line(const boost::json::value& v);

class EventPrinter {
 public:
  EventPrinter(bool json, std::FILE* out = stdout) : json_(json), out_(out) {}
  /// `line` is the event as received; `ev` its parsed form.
  void print(std::string_view line, const boost::json::object& ev);

 private:
  void output(const boost::json::object& ev);
  void print_human(const boost::json::object& ev);
  bool json_;
  std::FILE* out_;
  std::map<std::string, bool> midline_;  // proc/stream -> last output did not end in a newline
};

}  // namespace sbx::cli
