// shims/docker: what `sandboxer up --host docker` decides from a profile before anything runs.
#include <doctest/doctest.h>

#include <boost/json.hpp>

#include "shims/docker/docker.hpp"

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
  CHECK_FALSE(
      plan_for_profile(profile(R"({"name":"p","version":1})"), {"isolation.namespaces=false"}).live_checkpoint_caps);
}

TEST_CASE("docker plan: a profile with namespaces but no checkpoint gets only the namespace capabilities") {
  auto eph = plan_for_profile(profile(R"({"name":"p","version":1,"persistence":"ephemeral"})"), {});
  CHECK_FALSE(eph.live_checkpoint_caps);
  CHECK(eph.namespace_caps);
  CHECK_FALSE(plan_for_profile(profile(R"({"name":"p","version":1})"), {}).namespace_caps);  // criu's, a superset
  CHECK_FALSE(
      plan_for_profile(profile(R"({"name":"p","version":1,"persistence":"ephemeral"})"), {"isolation.namespaces=false"})
          .namespace_caps);
}

TEST_CASE("docker plan: a bad profile is refused with the field's name") {
  CHECK_THROWS_WITH_AS(plan_for_profile(profile(R"({"name":"p","version":1,"resources":{"grace":"soon"}})"), {}),
                       doctest::Contains("resources.grace"), std::exception);
  CHECK_THROWS_WITH_AS(plan_for_profile(profile(R"({"name":"p","version":1})"), {"nonsense"}),
                       doctest::Contains("FIELD=VALUE"), std::exception);
}

TEST_CASE("docker plan: memory, cpus and pids become Docker's flags") {
  using sbx::shims::docker::docker_limits;
  auto a = docker_limits(boost::json::parse(R"({"memory":"1.5G","cpus":0.5,"pids":100,"grace":"3s"})").as_object());
  std::vector<std::string> want = {"--memory", "1610612736", "--memory-swap", "1610612736",
                                   "--cpus",   "0.5",        "--pids-limit",  "132"};
  CHECK(a == want);
  CHECK(docker_limits(boost::json::parse(R"({"memory":0,"cpus":0,"pids":0})").as_object()).empty());
  CHECK(docker_limits(boost::json::parse(R"({"memory":"512M"})").as_object())[1] == "536870912");
  CHECK_THROWS_WITH_AS(docker_limits(boost::json::parse(R"({"memory":"lots"})").as_object()),
                       doctest::Contains("resources.memory"), std::exception);
}

TEST_CASE("docker plan: a profile that persists its agent gets a restart policy, others none") {
  auto restart_of = [](const sbx::shims::docker::RunPlan& p) {
    for (size_t i = 0; i + 1 < p.limit_args.size(); ++i)
      if (p.limit_args[i] == "--restart") return p.limit_args[i + 1];
    return std::string();
  };
  auto plain = plan_for_profile(profile(R"({"name":"p","version":1})"), {});
  CHECK_FALSE(plain.persist);
  CHECK(restart_of(plain).empty());
  // on-failure: a hibernated box exits 0 and stays down; a crash comes back and resumes.
  for (const char* set : {"checkpoint.every=1m", "checkpoint.on_stop=true", "checkpoint.on_idle=true"}) {
    auto p = plan_for_profile(profile(R"({"name":"p","version":1})"), {set});
    CHECK(p.persist);
    CHECK(restart_of(p) == "on-failure");
  }
}
