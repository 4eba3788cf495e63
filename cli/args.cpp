#include "cli/args.hpp"

#include <algorithm>

namespace sbx::cli {

namespace {

bool contains(const std::vector<std::string>& names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string canonical(const ArgSpec& spec, const std::string& name) {
  for (auto& [alias, to] : spec.aliases)
    if (alias == name) return to;
  return name;
}

// "-it" as "-i", "-t" when every letter is a flag of its own; nullopt otherwise.
std::optional<std::vector<std::string>> bundled_flags(const ArgSpec& spec, const std::string& arg) {
  if (arg.size() < 3 || arg[0] != '-' || arg[1] == '-') return std::nullopt;
  std::vector<std::string> out;
  for (size_t i = 1; i < arg.size(); ++i) {
    std::string one = canonical(spec, std::string{'-', arg[i]});
    if (!contains(spec.flags, one)) return std::nullopt;
    out.push_back(one);
  }
  return out;
}

}  // namespace

bool Args::has(std::string_view name) const {
  return std::any_of(given_.begin(), given_.end(), [&](const GivenOption& o) { return o.name == name; });
}

std::optional<std::string> Args::value(std::string_view name) const {
  for (auto it = given_.rbegin(); it != given_.rend(); ++it)
    if (it->name == name) return it->value;
  return std::nullopt;
}

std::string Args::value_or(std::string_view name, std::string fallback) const {
  auto v = value(name);
  return v ? *v : std::move(fallback);
}

std::vector<std::string> Args::values(std::string_view name) const {
  std::vector<std::string> out;
  for (auto& o : given_)
    if (o.name == name && o.value) out.push_back(*o.value);
  return out;
}

void Args::expect_positionals(size_t min, size_t max) const {
  if (positionals_.size() < min || positionals_.size() > max) throw UsageError(usage_);
}

void Args::fail(const std::string& what) const { throw UsageError(what + "\n" + usage_); }

Args parse_args(const std::vector<std::string>& args, const ArgSpec& spec) {
  Args out(spec.usage);
  bool options_done = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!options_done && arg == "--") {
      options_done = true;
      if (spec.command != CommandStart::none) {
        out.command_.assign(args.begin() + static_cast<long>(i) + 1, args.end());
        break;
      }
      continue;
    }
    if (options_done || arg == "-" || !arg.starts_with("-")) {
      // A positional, or where the command begins.
      if (spec.command == CommandStart::after_positionals && out.positionals_.size() >= spec.max_positionals) {
        out.command_.assign(args.begin() + static_cast<long>(i), args.end());
        break;
      }
      if (out.positionals_.size() >= spec.max_positionals) out.fail("unexpected argument " + arg);
      out.positionals_.push_back(arg);
      continue;
    }
    // An option: --name, --name=value, -n, or bundled single-letter flags.
    auto eq = arg.starts_with("--") ? arg.find('=') : std::string::npos;
    std::string name = canonical(spec, arg.substr(0, eq));
    if (contains(spec.options, name)) {
      if (eq != std::string::npos) {
        out.given_.push_back({name, arg.substr(eq + 1)});
      } else {
        if (i + 1 >= args.size()) out.fail(arg + " needs a value");
        out.given_.push_back({name, args[++i]});
      }
    } else if (contains(spec.flags, name)) {
      if (eq != std::string::npos) out.fail(arg.substr(0, eq) + " takes no value");
      out.given_.push_back({name, std::nullopt});
    } else if (auto each = bundled_flags(spec, arg)) {
      for (auto& f : *each) out.given_.push_back({f, std::nullopt});
    } else {
      out.fail("unknown option " + arg);
    }
  }
  return out;
}

}  // namespace sbx::cli
