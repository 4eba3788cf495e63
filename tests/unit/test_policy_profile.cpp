#include <doctest/doctest.h>

#include <string>

#include "profile/profile.hpp"
#include "sandbox/policy.hpp"

namespace profile = sbx::profile;
namespace sandbox = sbx::sandbox;

using namespace sbx::profile;
using namespace sbx::sandbox;

namespace {
std::string error_of(const std::string& doc) {
  try {
    profile::parse_profile(doc);
  } catch (const ProfileError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("profile: sizes and durations") {
  CHECK(profile::parse_size("512M", "f") == 512LL << 20);
  CHECK(profile::parse_size("4G", "f") == 4LL << 30);
  CHECK(profile::parse_size("4GiB", "f") == 4LL << 30);
  CHECK(profile::parse_size("1.5G", "f") == 3LL << 29);
  CHECK(profile::parse_size("100", "f") == 100);
  CHECK_THROWS_WITH(profile::parse_size("4X", "resources.memory"), doctest::Contains("resources.memory"));
  CHECK(profile::parse_duration_ms("10s", "f") == 10000);
  CHECK(profile::parse_duration_ms("500ms", "f") == 500);
  CHECK(profile::parse_duration_ms("2h", "f") == 7200000);
  CHECK(profile::parse_duration_ms("1.5m", "f") == 90000);
  CHECK_THROWS_WITH_AS(profile::parse_duration_ms("10x", "resources.grace"), doctest::Contains("resources.grace"),
                       ProfileError);
  CHECK_THROWS_AS(profile::parse_duration_ms("-1s", "f"), ProfileError);
  // Past int64 milliseconds (the fuzzer's shutdown grace): refused, not converted (UB under UBSan).
  CHECK_THROWS_WITH_AS(profile::parse_duration_ms("62555555555555555555555555555", "grace"),
                       doctest::Contains("grace: 62555555555555555555555555555 is too long"), ProfileError);
  CHECK_THROWS_AS(profile::parse_duration_ms("1e17d", "f"), ProfileError);
  CHECK(profile::parse_duration_ms("100000d", "f") == 8640000000000LL);
}

TEST_CASE("profile: a size's or a duration's number is read as std::from_chars reads it") {
  // The parser reads the number with strtod (libstdc++'s from_chars for a double needs libm);
  // what strtod takes and from_chars does not is refused as before.
  CHECK(profile::parse_duration_ms(".5s", "f") == 500);
  CHECK(profile::parse_duration_ms("1e3ms", "f") == 1000);
  CHECK(profile::parse_duration_ms("2E-3s", "f") == 2);
  CHECK(profile::parse_size("1.5e1K", "f") == 15 << 10);
  CHECK(profile::parse_size("7.", "f") == 7);
  for (const char* bad : {"+5s", " 5s", "inf", "nan", "1e999s", "1e-999s", ".s", "-s", "", "s"})
    CHECK_THROWS_WITH_AS(profile::parse_duration_ms(bad, "f"), doctest::Contains("is not a duration"), ProfileError);
  // Hexadecimal is not read (0, then the unit "x10s"), nor an exponent without digits (5, then "es").
  for (const char* bad : {"0x10s", "5es"})
    CHECK_THROWS_WITH_AS(profile::parse_duration_ms(bad, "f"), doctest::Contains("unknown unit"), ProfileError);
}

TEST_CASE("profile: every field, by the names of the issue") {
  auto p = profile::parse_profile(R"({"name":"t","version":1,
    "resources":{"memory":"64M","cpus":0.5,"pids":32,"open_files":256,"disk":"16M","timeout":"2h","idle":"5m",
                 "grace":"3s","pids_grace":"1s"},
    "isolation":{"level":"container","namespaces":["pid","mount"],"user":{"uid":1000,"gid":100},
                 "capabilities":["CAP_KILL"],"landlock":{"rw":["/workspace"],"ro":["/"]},"seccomp":"default"},
    "network":"none","persistence":"ephemeral"})");
  CHECK(p.resources.memory == 64 << 20);
  CHECK(p.resources.cpus == doctest::Approx(0.5));
  CHECK(p.resources.pids == 32);
  CHECK(p.resources.disk == 16 << 20);
  CHECK(p.resources.timeout_ms == 7200000);
  CHECK(p.resources.idle_ms == 300000);
  CHECK(p.isolation.level == "container");
  CHECK(*p.isolation.uid == 1000);
  CHECK(*p.isolation.gid == 100);
  CHECK(p.isolation.landlock->rw.size() == 1);
  CHECK(p.network.mode == profile::NetworkPolicy::Mode::None);
}

TEST_CASE("profile: refusals name the field") {
  CHECK(error_of(R"({"resources":{"memory":"1K"}})").starts_with("resources.memory"));
  CHECK(error_of(R"({"resources":{"pids":"many"}})").starts_with("resources.pids"));
  CHECK(error_of(R"({"isolation":{"user":{"uid":1,"home":"/"}}})").starts_with("isolation.user.home: unknown field"));
  CHECK(error_of(R"({"isolation":{"namespaces":["pid"]}})").starts_with("isolation.namespaces"));
  CHECK(error_of(R"({"isolation":{"landlock":{"rw":"/x"}}})").starts_with("isolation.landlock.rw"));
  CHECK(error_of(R"({"extra":1})").starts_with("extra: unknown field"));
  CHECK(error_of(R"({"name":"x","resources":{"grase":"1s"}})").starts_with("resources.grase: unknown field"));
  CHECK(error_of(R"({"name":7})").starts_with("name: expected a string"));
  CHECK(error_of(R"({"isolation":{"namespaces":"yes"}})").starts_with("isolation.namespaces"));
  CHECK(error_of("{").find("not valid JSON") != std::string::npos);
}

TEST_CASE("profile: copies and snapshots bound a box, strictly") {
  auto d = profile::parse_profile("{}");
  CHECK(d.resources.copies == 16);
  CHECK(d.resources.snapshots == 32);
  auto p = profile::parse_profile(R"({"resources":{"copies":0,"snapshots":4096}})");
  CHECK(p.resources.copies == 0);
  CHECK(p.resources.snapshots == 4096);
  CHECK(error_of(R"({"resources":{"copies":-1}})").starts_with("resources.copies: -1 is impossible"));
  CHECK(error_of(R"({"resources":{"copies":1025}})").starts_with("resources.copies"));
  CHECK(error_of(R"({"resources":{"copies":"8"}})").starts_with("resources.copies: expected a whole number"));
  CHECK(error_of(R"({"resources":{"snapshots":4097}})").starts_with("resources.snapshots"));
  CHECK(error_of(R"({"resources":{"snapshots":1.5}})").starts_with("resources.snapshots"));
}

TEST_CASE("profile: overrides go through the same parser") {
  profile::Profile p;
  profile::apply_override(p, "resources.memory=64M");
  CHECK(p.resources.memory == 64 << 20);
  profile::apply_override(p, "isolation.user=nobody");
  CHECK(*p.isolation.uid == 65534);
  CHECK_THROWS_WITH(profile::apply_override(p, "resources.cpus=0.001"), doctest::Contains("resources.cpus"));
  profile::apply_override(p, "resources.grace=3s");
  CHECK(p.resources.grace_ms == 3000);
  CHECK_THROWS_WITH_AS(profile::apply_override(p, "resources.nope=1"),
                       doctest::Contains("resources.nope: unknown field"), ProfileError);
  CHECK_THROWS_AS(profile::apply_override(p, "novalue"), ProfileError);
}

TEST_CASE("policy: an rlimit above the hard limit is refused naming the field") {
  profile::Profile p;
  p.resources.open_files = 1LL << 30;
  CHECK_THROWS_WITH(sandbox::check_profile_for_host(p), doctest::Contains("resources.open_files"));
  p.resources.open_files = 64;
  p.isolation.capabilities = std::vector<std::string>{"CAP_NOPE"};
  CHECK_THROWS_WITH(sandbox::check_profile_for_host(p), doctest::Contains("isolation.capabilities[0]"));
}

TEST_CASE("policy: the default seccomp program is built in memory") {
  auto prog = sandbox::build_seccomp({{"policy", "default"}});
  CHECK(prog.size() > sandbox::default_denied_syscalls().size());
  CHECK(sandbox::build_seccomp({{"policy", "none"}}).empty());
}
