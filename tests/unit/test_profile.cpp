#include <doctest/doctest.h>

#include "profile.hpp"

using namespace sbx::supervisor;

TEST_CASE("profile: durations") {
  CHECK(parse_duration_ms("10s", "f") == 10000);
  CHECK(parse_duration_ms("500ms", "f") == 500);
  CHECK(parse_duration_ms("2h", "f") == 7200000);
  CHECK(parse_duration_ms("1.5m", "f") == 90000);
  CHECK_THROWS_WITH_AS(parse_duration_ms("10x", "resources.grace"), doctest::Contains("resources.grace"), ProfileError);
  CHECK_THROWS_AS(parse_duration_ms("-1s", "f"), ProfileError);
}

TEST_CASE("profile: unknown fields and wrong types are named") {
  CHECK_THROWS_WITH_AS(parse_profile(R"({"name":"x","resources":{"grase":"1s"}})"),
                       doctest::Contains("resources.grase: unknown field"), ProfileError);
  CHECK_THROWS_WITH_AS(parse_profile(R"({"name":7})"), doctest::Contains("name: expected a string"), ProfileError);
  CHECK_THROWS_WITH_AS(parse_profile(R"({"isolation":{"namespaces":"yes"}})"), doctest::Contains("isolation.namespaces"),
                       ProfileError);
  CHECK_THROWS_WITH_AS(parse_profile("{"), doctest::Contains("not valid JSON"), ProfileError);
}

TEST_CASE("profile: overrides go through the same checks") {
  Profile p = parse_profile(R"({"name":"x","resources":{"grace":"10s"}})");
  apply_override(p, "resources.grace=3s");
  CHECK(p.resources.grace_ms == 3000);
  CHECK_THROWS_WITH_AS(apply_override(p, "resources.nope=1"), doctest::Contains("resources.nope: unknown field"),
                       ProfileError);
  CHECK_THROWS_AS(apply_override(p, "novalue"), ProfileError);
}
