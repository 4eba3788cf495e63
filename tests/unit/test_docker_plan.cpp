// shims/docker: what `sandboxer up --host docker` decides from a profile before anything runs.
#include <doctest/doctest.h>

#include <boost/json.hpp>

#include "docker/docker.hpp"

using sbx::shims::docker::plan_for_profile;

namespace {
boost::json::object profile(const char* text) { return boost::json::parse(text).as_object(); }
}  // namespace

TEST_CASE("docker plan: the stop timeout is the grace period plus a margin, rounded up") {
  auto p = plan_for_profile(profile(R"({"name":"p","version":1,"resources":{"grace":"2500ms"}})"), {});
  CHECK(p.grace_ms == 2500);
  CHECK(p.stop_timeout_s == 8);
  auto q = plan_for_profile(profile(R"({"name":"p","version":1})"), {"resources.grace=20s"});
  CHECK(q.stop_timeout_s == 25);
  CHECK(q.profile.at("resources").at("grace").as_string() == "20s");
}

TEST_CASE("docker plan: checkpoint capabilities follow the profile") {
  CHECK(plan_for_profile(profile(R"({"name":"p","version":1})"), {}).live_checkpoint_caps);
  CHECK_FALSE(plan_for_profile(profile(R"({"name":"p","version":1,"isolation":{"namespaces":false}})"), {})
                  .live_checkpoint_caps);
  CHECK_FALSE(plan_for_profile(profile(R"({"name":"p","version":1})"), {"isolation.namespaces=false"})
                  .live_checkpoint_caps);
}

TEST_CASE("docker plan: a bad profile is refused with the field's name") {
  CHECK_THROWS_WITH_AS(plan_for_profile(profile(R"({"name":"p","version":1,"resources":{"grace":"soon"}})"), {}),
                       doctest::Contains("resources.grace"), std::exception);
  CHECK_THROWS_WITH_AS(plan_for_profile(profile(R"({"name":"p","version":1})"), {"nonsense"}),
                       doctest::Contains("FIELD=VALUE"), std::exception);
}
