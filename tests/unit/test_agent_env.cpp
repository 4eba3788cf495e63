#include <doctest/doctest.h>

#include <boost/json.hpp>

#include <algorithm>
#include <stdexcept>

#include "profile/agent-env.hpp"
#include "profile/profile.hpp"
#include "sandbox/policy.hpp"
#include "supervisor/options.hpp"

namespace profile = sbx::profile;
namespace sandbox = sbx::sandbox;
namespace supervisor = sbx::supervisor;

using namespace sbx::profile;

namespace {
bool has(const std::vector<std::string>& env, const std::string& kv) {
  return std::find(env.begin(), env.end(), kv) != env.end();
}
bool has_key(const std::vector<std::string>& env, const std::string& k) {
  return std::any_of(env.begin(), env.end(), [&](auto& e) { return e.starts_with(k + "="); });
}
}  // namespace

TEST_CASE("agent env: clean by default, the operator's variables stay out") {
  profile::AgentEnvSpec s;
  s.supervisor_env = {"AWS_SECRET_ACCESS_KEY=s3cr3t",
                      "PATH=/home/op/bin:/usr/bin",
                      "TERM=xterm",
                      "LANG=C.UTF-8",
                      "SANDBOXER_TOKEN=tok",
                      "HOME=/home/op"};
  auto env = profile::build_agent_env(s);
  CHECK(env.size() == 4);
  CHECK(has(env, std::string("PATH=") + profile::kDefaultAgentPath));
  CHECK(has(env, "HOME=/root"));
  CHECK(has(env, "TERM=xterm"));
  CHECK(has(env, "LANG=C.UTF-8"));
  CHECK_FALSE(has_key(env, "AWS_SECRET_ACCESS_KEY"));
}

TEST_CASE("agent env: the profile, then --env, each later one winning") {
  profile::AgentEnvSpec s;
  s.profile_env = {{"A", "profile"}, {"PATH", "/opt/bin"}, {"B", "b"}};
  s.extra = {"A=flag", "C=x=y"};
  auto env = profile::build_agent_env(s);
  CHECK(has(env, "A=flag"));
  CHECK(has(env, "B=b"));
  CHECK(has(env, "C=x=y"));
  CHECK(has(env, "PATH=/opt/bin"));
  CHECK(std::count_if(env.begin(), env.end(), [](auto& e) { return e.starts_with("PATH="); }) == 1);
}

TEST_CASE("agent env: --env-inherit starts from ours, never with the token") {
  profile::AgentEnvSpec s;
  s.inherit = true;
  s.supervisor_env = {"AWS_SECRET_ACCESS_KEY=s3cr3t", "SANDBOXER_TOKEN=tok", "SANDBOXER_BOX=old"};
  auto env = profile::build_agent_env(s);
  CHECK(has(env, "AWS_SECRET_ACCESS_KEY=s3cr3t"));
  CHECK_FALSE(has_key(env, "SANDBOXER_TOKEN"));
  CHECK_FALSE(has_key(env, "SANDBOXER_BOX"));
}

TEST_CASE("agent env: names the supervisor owns are refused, with the reason") {
  CHECK(profile::check_env_name("FOO").has_value());
  CHECK(profile::check_env_name("SANDBOXER_TOKEN_FILE").error().message.find("supervisor's own") != std::string::npos);
  CHECK(profile::check_env_name("SANDBOXER_BRANCH").error().message.find("supervisor's own") != std::string::npos);
  CHECK(profile::check_env_name("").error().message.find("not empty") != std::string::npos);
  CHECK_THROWS_WITH_AS(profile::parse_env_assignment("SANDBOXER_BOX=x"),
                       doctest::Contains("SANDBOXER_BOX is the supervisor's own"), std::invalid_argument);
  CHECK_THROWS_AS(profile::parse_env_assignment("=x"), std::invalid_argument);
  CHECK(profile::parse_env_assignment("K=V=W") == "K=V=W");
  CHECK(profile::parse_env_assignment("SBX_SURELY_UNSET_VARIABLE_42").empty());
}

TEST_CASE("agent env: sandboxer-init's --env and --env-inherit") {
  const char* argv[] = {"sandboxer-init", "--env", "A=1", "--env", "B=2", "--env-inherit", "--", "true"};
  auto o = supervisor::parse_init_options(8, const_cast<char**>(argv));
  CHECK(o.env == std::vector<std::string>{"A=1", "B=2"});
  CHECK(o.env_inherit);
  const char* bad[] = {"sandboxer-init", "--env", "SANDBOXER_TOKEN=x", "--", "true"};
  CHECK_THROWS_WITH_AS(supervisor::parse_init_options(5, const_cast<char**>(bad)),
                       doctest::Contains("--env SANDBOXER_TOKEN=x"), std::invalid_argument);
}

TEST_CASE("init options: --command-env takes the command from a JSON array in the environment") {
  auto parse = [](std::vector<const char*> args) {
    args.insert(args.begin(), "sandboxer-init");
    return supervisor::parse_init_options(static_cast<int>(args.size()), const_cast<char**>(args.data()));
  };
  ::setenv("SBX_TEST_ARGV", R"j(["python3", "-c", "print('a b')", "", "caf\u00e9"])j", 1);
  auto o = parse({"--listen", "127.0.0.1:0", "--command-env", "SBX_TEST_ARGV"});
  CHECK(o.argv == std::vector<std::string>{"python3", "-c", "print('a b')", "", "caf\xc3\xa9"});
  CHECK(o.command_env == "SBX_TEST_ARGV");
  auto refused = [&](const char* value, const std::string& why, std::vector<const char*> more = {}) {
    if (value)
      ::setenv("SBX_TEST_ARGV", value, 1);
    else
      ::unsetenv("SBX_TEST_ARGV");
    more.insert(more.begin(), {"--command-env", "SBX_TEST_ARGV"});
    CHECK_THROWS_WITH_AS(parse(more), doctest::Contains(why.c_str()), std::invalid_argument);
  };
  refused(nullptr, "--command-env SBX_TEST_ARGV: SBX_TEST_ARGV is not set");
  refused("python3 a.py", "SBX_TEST_ARGV is not JSON");
  refused("[]", "expected a JSON array of strings");
  refused(R"({"argv": ["a"]})", "expected a JSON array of strings");
  refused(R"(["ls", 3])", "word 1 is not a string");
  refused(R"(["ls", "a\u0000b"])", "word 1 holds a NUL");
  refused(R"(["", "x"])", "the program's name is empty");
  refused(R"(["\ud800"])", "SBX_TEST_ARGV is not JSON");  // a lone surrogate: no UTF-8 for it
  refused(R"(["true"])", "exclude each other", {"--", "true"});
  refused(R"(["true"])", "--command-env and --idle exclude each other", {"--idle"});
  refused(R"(["true"])", "--workdir src: an absolute path", {"--workdir", "src"});
  ::unsetenv("SBX_TEST_ARGV");
}

TEST_CASE("profile: env is an object of strings, merged by overrides") {
  profile::Profile p = parse_profile(R"({"env": {"A": "1", "B": "2"}})");
  CHECK(p.env.at("A") == "1");
  profile::apply_override(p, "env.C=8080");
  CHECK(p.env.at("C") == "8080");  // a string, though it reads as a number
  profile::apply_override(p, "env.A=null");
  CHECK_FALSE(p.env.contains("A"));
  CHECK(p.env.at("B") == "2");
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"env": {"A": 1}})"), doctest::Contains("env.A: expected a string"),
                       sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"env": ["A=1"]})"), doctest::Contains("env: expected an object"),
                       sbx::profile::ProfileError);
  CHECK_THROWS_WITH_AS(profile::parse_profile(R"({"env": {"SANDBOXER_BOX": "x"}})"),
                       doctest::Contains("env.SANDBOXER_BOX: SANDBOXER_BOX is the supervisor's own"),
                       sbx::profile::ProfileError);
}

TEST_CASE("profile: its document keeps the fields given, with overrides merged field by field") {
  profile::Profile p = parse_profile(R"({"name": "mine", "resources": {"memory": "1G", "cpus": 1}})");
  profile::apply_override(p, "resources.cpus=2");
  profile::apply_override(p, "env.PORT=8080");
  profile::apply_override(p, "network=none");
  auto doc = boost::json::parse(p.document).as_object();
  CHECK(doc.at("name") == "mine");
  CHECK(doc.at("resources").at("memory") == "1G");  // kept beside the override of cpus
  CHECK(doc.at("resources").at("cpus") == 2);
  CHECK(doc.at("env").at("PORT") == "8080");
  CHECK(doc.at("network") == "none");
  // The document parses to the same profile: what a box started from it gets.
  profile::Profile again = parse_profile(p.document);
  CHECK(again.resources.cpus == p.resources.cpus);
  CHECK(again.resources.memory == p.resources.memory);
  CHECK(again.env == p.env);
}

TEST_CASE("policy: CAP_NET_RAW is dropped beside the supervisor's network namespace") {
  profile::Profile p = parse_profile(R"({"isolation": {"capabilities": ["CAP_NET_RAW", "CAP_CHOWN"]}})");
  CHECK(sandbox::shares_host_network(p, true));  // network host
  auto host = sandbox::policy_to_json(p, 0, true, {});
  REQUIRE(host.contains("drop"));
  CHECK(host.at("drop").as_array().size() == 1);
  CHECK(host.at("drop").as_array()[0].to_number<int>() == 13);
  auto pp = sandbox::prepare_policy(host);
  CHECK(pp.caps);
  CHECK((pp.keep_mask & (1ULL << 13)) == 0);
  CHECK(sandbox::describe_enforcement(p, {}, 0, true).at("capabilities").as_string().find("less CAP_NET_RAW") !=
        boost::json::string::npos);
  profile::apply_override(p, "network=none");
  CHECK_FALSE(sandbox::shares_host_network(p, true));
  CHECK(sandbox::shares_host_network(p, false));  // without namespaces it shares ours whatever the mode
  CHECK_FALSE(sandbox::policy_to_json(p, 0, false, {}).contains("drop"));
}

TEST_CASE("policy: a dropped capability with no list keeps the rest for root, none for another user") {
  auto all = sandbox::prepare_policy(boost::json::object{{"drop", boost::json::array{13}}});
  CHECK(all.caps);
  CHECK((all.keep_mask & (1ULL << 13)) == 0);
  auto nobody =
      sandbox::prepare_policy(boost::json::object{{"uid", 65534}, {"gid", 65534}, {"drop", boost::json::array{13}}});
  CHECK(nobody.keep_mask == 0);
}
