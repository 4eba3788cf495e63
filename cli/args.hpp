#pragma once
// The CLI's one argument parser. Each subcommand declares what it takes (an ArgSpec: flags,
// options with a value, how many positionals, where its command begins) and reads what was
// given from Args. The rules are the same for every subcommand:
//   --json                 a flag; `--json=x` is an error
//   --since N, --since=N   an option with a value; the value may start with '-'; repeatable
//                          (value() is the last, values() all of them in order)
//   -it                    single-letter flags bundled (-i -t), when each is a flag
//   --                     ends the options: what follows is the command (run, exec, up) or
//                          positionals (the rest)
// A bad argument throws UsageError naming it and ending with the subcommand's usage line;
// `main` prints "sandboxer CMD: <what>" and exits 2.
#include <charconv>
#include <cstddef>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sbx::cli {

/// A bad command line (exit 2).
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Where the command a subcommand runs (CMD... of run, exec and up) begins.
enum class CommandStart {
  none,               ///< no command: `--` only ends the options, positionals may follow it
  after_dashdash,     ///< only after `--` (up): a positional before it is an error
  after_positionals,  ///< after `--`, or at the first positional past max_positionals (run, exec)
};

struct ArgSpec {
  std::string usage;                 ///< "usage: sandboxer log STATE_DIR ...": the end of every error
  std::vector<std::string> flags;    ///< options without a value: "--json", "-i"
  std::vector<std::string> options;  ///< options with a value: "--since", "-n"
  /// Other names of the above, as (alias, name): {"-v", "--volume"}. Args knows only the name.
  std::vector<std::pair<std::string, std::string>> aliases;
  size_t max_positionals = std::numeric_limits<size_t>::max();
  CommandStart command = CommandStart::none;
};

/// One option as given, in order (value empty for a flag).
struct GivenOption {
  std::string name;
  std::optional<std::string> value;
};

class Args {
 public:
  explicit Args(std::string usage) : usage_(std::move(usage)) {}

  /// The flag or option was given at least once.
  bool has(std::string_view name) const;
  /// The option's last value, if it was given.
  std::optional<std::string> value(std::string_view name) const;
  std::string value_or(std::string_view name, std::string fallback) const;
  /// Every value of a repeated option, in order.
  std::vector<std::string> values(std::string_view name) const;
  /// The option's last value as a number; UsageError ("--since x: expected a number") if it is none.
  template <class T>
  T number(std::string_view name, T fallback) const;

  /// Every option as given, in order (run hands most of them on to sandboxer-init).
  const std::vector<GivenOption>& given() const { return given_; }
  const std::vector<std::string>& positionals() const { return positionals_; }
  /// The command after `--` (or after the last positional, for CommandStart::after_positionals).
  const std::vector<std::string>& command() const { return command_; }
  /// UsageError(usage) unless there are between min and max positionals.
  void expect_positionals(size_t min, size_t max) const;
  void expect_positionals(size_t n) const { expect_positionals(n, n); }
  /// A UsageError saying `what`, then the usage line.
  [[noreturn]] void fail(const std::string& what) const;
  const std::string& usage() const { return usage_; }

 private:
  friend Args parse_args(const std::vector<std::string>& args, const ArgSpec& spec);
  std::string usage_;
  std::vector<GivenOption> given_;
  std::vector<std::string> positionals_;
  std::vector<std::string> command_;
};

/// Parses a subcommand's arguments (argv after the subcommand's name) by `spec`.
Args parse_args(const std::vector<std::string>& args, const ArgSpec& spec);

template <class T>
T Args::number(std::string_view name, T fallback) const {
  auto v = value(name);
  if (!v) return fallback;
  T n{};
  auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
  if (ec != std::errc{} || end != v->data() + v->size() || v->empty())
    fail(std::string(name) + " " + *v + ": expected a number");
  return n;
}

}  // namespace sbx::cli
