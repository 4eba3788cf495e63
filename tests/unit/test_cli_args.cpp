// The CLI's one argument parser (cli/args.hpp): every subcommand's command line goes through it.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "cli/args.hpp"

using sbx::cli::ArgSpec;
using sbx::cli::CommandStart;
using sbx::cli::parse_args;
using sbx::cli::UsageError;

namespace {

using Argv = std::vector<std::string>;

// As `sandboxer attach`: one positional, a flag, two options with a value.
ArgSpec attach_like() {
  return {.usage = "usage: sandboxer attach URL [--since N] [--branch B] [--json]",
          .flags = {"--json"},
          .options = {"--since", "--branch"},
          .max_positionals = 1};
}

// The message of the UsageError that parsing `argv` throws ("" when it throws none).
std::string error_of(const Argv& argv, const ArgSpec& spec) {
  try {
    parse_args(argv, spec);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("cli args: flags, options with a value in both spellings, positionals") {
  auto a = parse_args({"ws://h:1", "--json", "--since", "7", "--branch=b1"}, attach_like());
  CHECK(a.positionals() == Argv{"ws://h:1"});
  CHECK(a.has("--json"));
  CHECK(a.number<uint64_t>("--since", 0) == 7);
  CHECK(a.value("--branch") == "b1");
  CHECK_FALSE(a.has("--token-file"));
  CHECK(a.value_or("--token-file", "none") == "none");
  CHECK(a.command().empty());
}

TEST_CASE("cli args: a repeated option keeps every value in order; value() is the last") {
  ArgSpec spec{.usage = "u", .options = {"--env", "--set"}};
  auto a = parse_args({"--env", "A=1", "--set", "x=y", "--env=B=2", "--env", "-weird"}, spec);
  CHECK(a.values("--env") == Argv{"A=1", "B=2", "-weird"});
  CHECK(a.value("--env") == "-weird");
  REQUIRE(a.given().size() == 4);
  CHECK(a.given()[1].name == "--set");
  CHECK(a.given()[1].value == "x=y");
}

TEST_CASE("cli args: errors name the bad argument and end with the usage line") {
  auto spec = attach_like();
  CHECK(error_of({"--nope"}, spec) == "unknown option --nope\n" + spec.usage);
  CHECK(error_of({"--nope=1"}, spec) == "unknown option --nope=1\n" + spec.usage);
  CHECK(error_of({"u", "--since"}, spec) == "--since needs a value\n" + spec.usage);
  CHECK(error_of({"u", "--json=yes"}, spec) == "--json takes no value\n" + spec.usage);
  CHECK(error_of({"u", "v"}, spec) == "unexpected argument v\n" + spec.usage);
  CHECK(error_of({"u"}, spec).empty());
  auto a = parse_args({"u", "--since", "x7"}, spec);
  CHECK_THROWS_WITH_AS(a.number<uint64_t>("--since", 0), ("--since x7: expected a number\n" + spec.usage).c_str(),
                       UsageError);
  CHECK_THROWS_WITH_AS(a.expect_positionals(2), spec.usage.c_str(), UsageError);
}

TEST_CASE("cli args: `--` ends the options") {
  SUBCASE("without a command, what follows is positional") {
    auto a = parse_args({"--", "--json"}, attach_like());
    CHECK(a.positionals() == Argv{"--json"});
    CHECK_FALSE(a.has("--json"));
  }
  SUBCASE("with a command after --, what follows is the command, options and all") {
    ArgSpec up{.usage = "u", .options = {"--host"}, .max_positionals = 0, .command = CommandStart::after_dashdash};
    auto a = parse_args({"--host", "docker", "--", "sh", "-c", "--host"}, up);
    CHECK(a.value("--host") == "docker");
    CHECK(a.command() == Argv{"sh", "-c", "--host"});
    CHECK(error_of({"--host", "docker", "sh"}, up) == "unexpected argument sh\nu");
  }
  SUBCASE("with a command after the positionals, it may begin without --") {
    ArgSpec exec{.usage = "u", .flags = {"-i", "-t"}, .max_positionals = 1, .command = CommandStart::after_positionals};
    auto a = parse_args({"ws://h:1", "-i", "cat", "-n"}, exec);
    CHECK(a.positionals() == Argv{"ws://h:1"});
    CHECK(a.has("-i"));
    CHECK_FALSE(a.has("-t"));
    CHECK(a.command() == Argv{"cat", "-n"});
    auto b = parse_args({"ws://h:1", "--", "-i"}, exec);
    CHECK_FALSE(b.has("-i"));
    CHECK(b.command() == Argv{"-i"});
  }
}

TEST_CASE("cli args: bundled single-letter flags and aliases") {
  ArgSpec spec{.usage = "u",
               .flags = {"-i", "-t", "--help"},
               .options = {"--volume"},
               .aliases = {{"-h", "--help"}, {"-v", "--volume"}}};
  auto a = parse_args({"-ti", "-v", "/a:/b", "-h"}, spec);
  CHECK(a.has("-i"));
  CHECK(a.has("-t"));
  CHECK(a.has("--help"));
  CHECK(a.values("--volume") == Argv{"/a:/b"});
  CHECK(error_of({"-ix"}, spec) == "unknown option -ix\nu");
  // A lone "-" is a positional (stdin, by convention), not an option.
  CHECK(parse_args({"-"}, spec).positionals() == Argv{"-"});
}
