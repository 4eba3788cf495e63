// launch_branch against the real sandboxer-ns-init (built beside these tests): the branch's child
// walks its mount plan in a pid and mount namespace of its own, or fails at a step of it and the
// branch runs flat, or cannot exec ns-init at all. On v1 the child joins its cgroups itself; here
// (no v2 group fd) it shares the caller's memory until its exec (CLONE_VM|CLONE_VFORK), so these
// cases are also what that clone's child does on each of its paths.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include "os/cgroup.hpp"
#include "os/sys.hpp"
#include "sandbox/launcher.hpp"
#include "temp-dir.hpp"

using namespace sbx;

namespace {

bool root() { return ::geteuid() == 0; }

// A field of /proc/PID/status ("" when the process or the field is gone).
std::string status_field(pid_t pid, const std::string& name) {
  auto s = os::read_file("/proc/" + std::to_string(pid) + "/status");
  if (!s) return "";
  size_t at = s->find("\n" + name + ":\t");
  if (at == std::string::npos) return "";
  at += name.size() + 3;
  return s->substr(at, s->find('\n', at) - at);
}

// What /proc/PID/exe names, as the process sees its own root.
std::string exe_of(pid_t pid) {
  std::error_code ec;
  return std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/exe", ec).string();
}

sandbox::BranchSpec spec_in(const test::TempDir& d) {
  sandbox::BranchSpec spec;
  spec.dir = (d.path / "branch").string();
  spec.self_exe = std::string(SBX_BIN_DIR) + "/sandboxer-init";  // ns-init is found beside it
  spec.masks = {d.path.string() + "/secret"};
  return spec;
}

// A directory where the plan binds a file over /etc/resolv.conf: its move onto the file fails
// (EINVAL: a directory over a file), a step of the plan after the clone.
sandbox::BranchSpec spec_with_a_failing_plan(const test::TempDir& d) {
  auto spec = spec_in(d);
  spec.resolv_conf = (d.path / "resolv-dir").string();
  REQUIRE(::mkdir(spec.resolv_conf.c_str(), 0755) == 0);
  return spec;
}

// ns-init waits for its config on the requests pipe: closing it ends ns-init (127, "bad config").
int end_ns_init(sandbox::LaunchedBranch& lb) {
  lb.requests.reset();
  int st = 0;
  if (::waitpid(lb.pid, &st, __WALL) != lb.pid) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace

TEST_CASE("launch_branch: ns-init runs as PID 1 of its own namespaces, in the branch's v1 groups" *
          doctest::skip(!root())) {
  test::TempDir d("launcher");
  auto spec = spec_in(d);
  auto host = os::detect_cgroups();
  os::CgroupDir group;
  std::vector<os::UniqueFd> join;
  if (host.version == "v1") {
    auto g = os::CgroupDir::create_v1(host, "sbx-unit-launch-" + std::to_string(::getpid()));
    REQUIRE(g.has_value());
    group = std::move(*g);
    auto fds = group.open_join_fds();
    REQUIRE(fds.has_value());
    join = std::move(*fds);
    for (auto& fd : join) spec.cgroup_join.push_back(fd.get());
    spec.cgroup_self_join = true;
  }
  auto lb = sandbox::launch_branch(spec);
  REQUIRE_MESSAGE(lb.has_value(), lb.error().message);
  CHECK(lb->namespaced);
  CHECK(lb->why_not.empty());
  // Exec'd (not a copy of us): its own program, PID 1 of the pid namespace it made.
  CHECK(exe_of(lb->pid) == sandbox::kNsInitPath);
  CHECK(status_field(lb->pid, "NSpid") == std::to_string(lb->pid) + "\t1");
  if (!group.empty()) CHECK(group.pids() == std::vector<pid_t>{lb->pid});
  CHECK(end_ns_init(*lb) == 127);
}

TEST_CASE("launch_branch: a step of the mount plan that fails leaves the branch flat and says which" *
          doctest::skip(!root())) {
  test::TempDir d("launcher");
  auto spec = spec_with_a_failing_plan(d);
  spec.flat_fallback = true;
  auto lb = sandbox::launch_branch(spec);
  REQUIRE_MESSAGE(lb.has_value(), lb.error().message);
  CHECK_FALSE(lb->namespaced);
  CHECK(lb->why_not == "attach /etc/resolv.conf: Invalid argument");
  // Flat: in our pid namespace, the host's sandboxer-ns-init.
  CHECK(status_field(lb->pid, "NSpid") == std::to_string(lb->pid));
  CHECK(exe_of(lb->pid) == std::filesystem::canonical(std::string(SBX_BIN_DIR) + "/sandboxer-ns-init").string());
  CHECK(end_ns_init(*lb) == 127);
}

TEST_CASE("launch_branch: where the branch may not run flat, a failed step is the launch's error, with no child" *
          doctest::skip(!root())) {
  test::TempDir d("launcher");
  auto spec = spec_with_a_failing_plan(d);
  REQUIRE_FALSE(spec.flat_fallback);  // the default: refused unless the caller allows it
  auto lb = sandbox::launch_branch(spec);
  REQUIRE_FALSE(lb.has_value());
  CHECK(lb.error().code == "unavailable");
  CHECK(lb.error().message ==
        "no pid and mount namespace for the branch (attach /etc/resolv.conf: Invalid argument), and it may not run "
        "without them");
  // The namespaced attempt's child was collected, and no flat one was started.
  CHECK(::waitpid(-1, nullptr, WNOHANG | __WALL) == -1);
  CHECK(errno == ECHILD);
}

TEST_CASE("launch_branch: no ns-init to exec is an error of the launch, with no child left" * doctest::skip(!root())) {
  test::TempDir d("launcher");
  auto spec = spec_in(d);
  spec.self_exe = (d.path / "no-such-dir" / "sandboxer-init").string();
  spec.flat_fallback = true;
  auto lb = sandbox::launch_branch(spec);
  REQUIRE_FALSE(lb.has_value());
  CHECK(lb.error().message.starts_with("exec " + spec.self_exe.substr(0, spec.self_exe.rfind('/'))));
  CHECK(lb.error().message.ends_with(": No such file or directory"));
  // Both attempts' children were collected by launch_branch itself.
  CHECK(::waitpid(-1, nullptr, WNOHANG | __WALL) == -1);
  CHECK(errno == ECHILD);
}

TEST_CASE("stable_ns_init: a copy per installed version; earlier ones past four go, unless one runs") {
  namespace fs = std::filesystem;
  sbx::test::TempDir d("ns-init-copy");
  auto home = d.path / "home";
  fs::create_directories(home);
  fs::permissions(home, fs::perms::owner_all);
  auto installed = d.path / "bin" / "sandboxer-ns-init";
  fs::create_directories(installed.parent_path());
  fs::copy_file("/bin/true", installed);
  sandbox::NsInitBinary bin{installed.string(), {}};
  auto first = sandbox::stable_ns_init(bin, home.string());
  ::usleep(20000);
  REQUIRE_MESSAGE(first.has_value(), first.error().message);
  CHECK(first->path.starts_with(home.string() + "/ns-init-"));
  CHECK(os::read_file(first->path).value() == os::read_file(installed.string()).value());
  auto again = sandbox::stable_ns_init(bin, home.string());  // the same version: the same copy
  REQUIRE(again.has_value());
  CHECK(again->path == first->path);
  // Copies of six earlier versions, the oldest of them run by a process now.
  for (int i = 0; i < 6; ++i) {
    fs::copy_file("/bin/sleep", home / ("ns-init-old" + std::to_string(i)));
    ::usleep(20000);  // ctimes in that order (a file time moves a clock tick at a time)
  }
  pid_t running = ::fork();
  if (running == 0) {
    ::execl((home / "ns-init-old0").c_str(), "sleep", "30", nullptr);
    ::_exit(127);
  }
  ::usleep(200000);  // it has exec'd
  // An upgrade: a new file in the installed one's place.
  fs::remove(installed);
  fs::copy_file("/bin/false", installed);
  auto second = sandbox::stable_ns_init(bin, home.string());
  REQUIRE_MESSAGE(second.has_value(), second.error().message);
  CHECK(second->path != first->path);
  ::kill(running, SIGKILL);
  ::waitpid(running, nullptr, 0);
  std::vector<std::string> left;
  for (auto& e : fs::directory_iterator(home)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  // The newest four earlier ones, the one that runs, and the new one; the first copy and old1 went.
  std::vector<std::string> want = {"ns-init-old0", "ns-init-old2", "ns-init-old3",
                                   "ns-init-old4", "ns-init-old5", fs::path(second->path).filename().string()};
  std::sort(want.begin(), want.end());
  CHECK(left == want);
  // sandboxer-init's own --ns-init mode is run where it is installed.
  auto self = sandbox::stable_ns_init({installed.string(), {"--ns-init"}}, home.string());
  REQUIRE(self.has_value());
  CHECK(self->path == installed.string());
  // No state dir: an error, which the supervisor reports before it runs the installed file.
  auto none = sandbox::stable_ns_init(bin, "");
  REQUIRE_FALSE(none.has_value());
  CHECK(none.error().message == "no state dir to keep its copy in");
}
