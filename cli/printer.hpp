#pragma once
// Shows events to a person, or as JSON lines with --json.
#include <boost/json.hpp>
#include <cstdio>
#include <map>
#include <string>

namespace sbx::cli {

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
