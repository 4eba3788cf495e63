#include <doctest/doctest.h>

#include "profile/profile.hpp"

namespace profile = sbx::profile;

using namespace sbx::profile;

TEST_CASE("profile: durations") {
  CHECK(profile::parse_duration_ms("10s", "f") == 10000);
  CHECK(profile::parse_duration_ms("500ms", "f") == 500);
  CHECK(profile::parse_duration_ms("2h", "f") == 7200000);
  CHECK(profile::parse_duration_ms("1.5m", "f") == 90000);
  CHECK_THROWS_WITH_AS(profile::parse_duration_ms("10x", "resources.grace"), doctest::Contains("resources.grace"), sbx::profile::ProfileError);
  CHECK_THROWS_AS(profile::parse_duration_ms("-1s", "f"), sbx::profile::ProfileError);
}

TEST_CASE("profile: unknown fields and wrong types are named") {
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"name":"x","resources":{"grase":"1s"}})"),
                       doctest::Contains("resources.grase: unknown field"), sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"name":7})"), doctest::Contains("name: expected a string"), sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"isolation":{"namespaces":"yes"}})"), doctest::Contains("isolation.namespaces"),
                       sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile("{"), doctest::Contains("not valid JSON"), sbx::profile::ProfileError);
}

TEST_CASE("profile: overrides go through the same checks") {
  profile::Profile p = parse_profile(R"({"name":"x","resources":{"grace":"10s"}})");
  profile::apply_override(p, "resources.grace=3s");
  CHECK(p.resources.grace_ms == 3000);
  CHECK_THROWS_WITH_AS(profile::apply_override(p, "resources.nope=1"), doctest::Contains("resources.nope: unknown field"),
                       sbx::profile::ProfileError);
  CHECK_THROWS_AS(profile::apply_override(p, "novalue"), sbx::profile::ProfileError);
}
