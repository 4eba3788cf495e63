// CgroupDir against real cgroup files. v1 fully where this host has v1 controllers; v2 against
// the core files (cgroup.procs, cgroup.freeze, cgroup.events, cgroup.kill) of a cgroup2 mount,
// which here offers no controllers.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>

#include <string>
#include <thread>

#include "os/cgroup.hpp"
#include "os/sys.hpp"

using namespace sbx::os;

namespace {

std::string v2_mount() {
  if (auto mi = read_file("/proc/self/mountinfo")) {
    size_t pos = 0;
    while ((pos = mi->find(" - cgroup2 ", pos)) != std::string::npos) {
      size_t start = mi->rfind('\n', pos);
      start = start == std::string::npos ? 0 : start + 1;
      std::string line = mi->substr(start, pos - start);
      // fields: id parent maj:min root mountpoint ...
      size_t f = 0;
      for (int i = 0; i < 4; ++i) f = line.find(' ', f) + 1;
      return line.substr(f, line.find(' ', f) - f);
    }
  }
  return "";
}

pid_t sleeper() {
  pid_t p = ::fork();
  if (p == 0) {
    for (;;) ::pause();
  }
  return p;
}

// The kinds of cgroup this host offers, read when the test cases are registered (before main):
// a case the host cannot run is marked `doctest::skip` and counted as skipped, not as passed.
bool writable_v2() {
  std::string root = v2_mount();
  return !root.empty() && ::access((root + "/cgroup.procs").c_str(), W_OK) == 0;
}

bool host_v1() { return detect_cgroups().version == "v1"; }

bool wait_until(auto pred, int ms = 2000) {
  for (int i = 0; i < ms / 10; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

}  // namespace

TEST_CASE("cgroup: keyed values of memory.events, pids.events and oom_control") {
  CHECK(keyed_value("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n", "oom_kill") == 2);
  CHECK(keyed_value("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n", "oom") == 1);
  CHECK(keyed_value("max 7\n", "max") == 7);
  CHECK(keyed_value("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n", "oom_kill") == 5);
  CHECK_FALSE(keyed_value("max 7\n", "oom_kill").has_value());
}

TEST_CASE("cgroup: the host kinds this run covers") {
  // Says which of the host-kind cases below doctest skips here, and why.
  if (!writable_v2()) MESSAGE("no writable cgroup2 mount here: the cgroup v2 case is skipped");
  if (!host_v1()) MESSAGE("no cgroup v1 here: the cgroup v1 case is skipped");
}

TEST_CASE("cgroup v2: procs, freeze, events and kill on the core files of a cgroup2 mount" *
          doctest::skip(!writable_v2())) {
  std::string root = v2_mount();
  REQUIRE_FALSE(root.empty());
  auto g = CgroupDir::create_v2(root, "sbx-unit-" + std::to_string(::getpid()));
  REQUIRE(g.has_value());
  std::string dir = g->dirs().front();
  CHECK(g->v2());
  CHECK_FALSE(g->populated());

  pid_t p = sleeper();
  REQUIRE(p > 0);
  REQUIRE(g->add(p).has_value());
  CHECK(g->pids() == std::vector<pid_t>{p});
  CHECK(g->populated());

  SUBCASE("a device program loads and attaches (its effect: tests/security/test_mounts.py)") {
    CHECK(g->set_devices(default_device_rules()).has_value());
    ::kill(p, SIGKILL);
  }

  SUBCASE("freeze and thaw") {
    REQUIRE(g->freeze(true).has_value());
    CHECK(wait_until([&] { return g->frozen(); }));
    REQUIRE(g->freeze(false).has_value());
    CHECK(wait_until([&] { return !g->frozen(); }));
    ::kill(p, SIGKILL);
  }
  SUBCASE("kill_all uses cgroup.kill and empties the group") {
    if (::access((dir + "/cgroup.kill").c_str(), W_OK) != 0) MESSAGE("no cgroup.kill: the per-pid loop is used");
    int st = 0;
    std::thread reap([&] { ::waitpid(p, &st, 0); });
    CHECK(g->kill_all(3000));
    reap.join();
    CHECK(WIFSIGNALED(st));
    CHECK(WTERMSIG(st) == SIGKILL);
    CHECK_FALSE(g->populated());
  }
  SUBCASE("a child joins through an fd opened by the parent, writing 0") {
    auto fds = g->open_join_fds();
    REQUIRE(fds.has_value());
    pid_t c = ::fork();
    if (c == 0) {
      for (auto& fd : *fds)
        if (::write(fd.get(), "0", 1) != 1) ::_exit(1);
      ::_exit(0);
    }
    int st = 0;
    ::waitpid(c, &st, 0);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
    ::kill(p, SIGKILL);
  }
  ::waitpid(p, nullptr, 0);
  // Readings without controllers are empty, not errors.
  if (!g->has("memory")) CHECK_FALSE(g->memory_current().has_value());
  if (!g->has("pids")) CHECK_FALSE(g->pids_max_events().has_value());
  CHECK(g->set_memory(64 << 20).has_error() == !g->has("memory"));
  g->remove();
  CHECK(::access(dir.c_str(), F_OK) != 0);
}

TEST_CASE("cgroup v1: a group per hierarchy under our own, with ceilings, removed by its destructor" *
          doctest::skip(!host_v1())) {
  auto host = detect_cgroups();
  REQUIRE(host.version == "v1");
  std::vector<std::string> dirs;
  {
    auto g = CgroupDir::create_v1(host, "sbx-unit-" + std::to_string(::getpid()));
    REQUIRE(g.has_value());
    dirs = g->dirs();
    for (auto& d : dirs) CHECK(::access(d.c_str(), F_OK) == 0);
    if (g->has("memory")) {
      CHECK(g->dir_of("memory").starts_with(host.v1_dirs.at("memory") + "/"));
      REQUIRE(g->set_memory(64 << 20).has_value());
      CHECK(g->memory_max() == (64 << 20));
      CHECK(g->oom_kills() == 0);
      CHECK(g->oom_eventfd().has_value());
    }
    if (g->has("pids")) {
      REQUIRE(g->set_pids(10).has_value());
      CHECK(g->pids_max() == 10);
      CHECK(g->pids_max_events() == 0);
    }
    if (g->has("cpu")) CHECK(g->set_cpus(0.5).has_value());
    if (host.v1_dirs.contains("devices")) {
      // Only the listed devices, the rest of the parent's "a *:* rwm" gone.
      REQUIRE(g->has("devices"));
      REQUIRE(g->set_devices(default_device_rules()).has_value());
      auto list = read_file(g->dir_of("devices") + "/devices.list");
      REQUIRE(list.has_value());
      CHECK(list->find("c 1:3 rwm") != std::string::npos);
      CHECK(list->find("c 136:* rwm") != std::string::npos);
      CHECK(list->find("a *:*") == std::string::npos);
      CHECK(list->find("b ") == std::string::npos);
    }
    pid_t p = sleeper();
    REQUIRE(g->add(p).has_value());
    CHECK(g->pids() == std::vector<pid_t>{p});
    if (g->has("freezer")) {
      REQUIRE(g->freeze(true).has_value());
      CHECK(wait_until([&] { return g->frozen(); }));
    }
    std::thread reap([&] { ::waitpid(p, nullptr, 0); });
    CHECK(g->kill_all(3000));  // thaws first: a frozen group would hold its KILLs
    reap.join();

    // A child joins by writing "0" to v1's `tasks` (the one thread moves; the launcher's path):
    // it is then in the group of every hierarchy, and so is what it forks afterwards.
    auto fds = g->open_join_fds();
    REQUIRE(fds.has_value());
    REQUIRE(fds->size() == dirs.size());
    int ready[2];
    REQUIRE(::pipe(ready) == 0);
    pid_t c = ::fork();
    if (c == 0) {
      for (auto& fd : *fds)
        if (::write(fd.get(), "0", 1) != 1) ::_exit(1);
      if (::fork() == 0)
        for (;;) ::pause();
      (void)!::write(ready[1], "j", 1);
      for (;;) ::pause();
    }
    ::close(ready[1]);
    char byte = 0;
    CHECK(::read(ready[0], &byte, 1) == 1);
    ::close(ready[0]);
    for (auto& d : dirs) {
      auto procs = read_file(d + "/cgroup.procs");
      REQUIRE(procs.has_value());
      CAPTURE(d);
      CHECK(procs->find(std::to_string(c) + "\n") != std::string::npos);
      CHECK(std::count(procs->begin(), procs->end(), '\n') == 2);  // the child and its own child
    }
    CHECK(g->kill_all(3000));
    ::waitpid(c, nullptr, 0);
  }
  for (auto& d : dirs) CHECK(::access(d.c_str(), F_OK) != 0);
}

TEST_CASE("cgroup v1: fresh only when made anew; remove() kills what is still in it, frozen or not" *
          doctest::skip(!host_v1())) {
  auto host = detect_cgroups();
  std::string name = "sbx-unit-fresh-" + std::to_string(::getpid());
  auto g = CgroupDir::create_v1(host, name);
  REQUIRE(g.has_value());
  CHECK(g->fresh());
  {
    auto again = CgroupDir::create_v1(host, name);  // as a run after a killed one finds its group
    REQUIRE(again.has_value());
    CHECK_FALSE(again->fresh());
    again->remove();
    auto dirs = g->dirs();
    for (auto& d : dirs) CHECK(::access(d.c_str(), F_OK) != 0);
  }
  g->remove();
  g = CgroupDir::create_v1(host, name);
  REQUIRE(g.has_value());
  CHECK(g->fresh());
  auto dirs = g->dirs();
  {
    // The same group made again and assigned over the one that holds it: its directories stay,
    // now owned by the assigned-to object (before, its old self removed them under the new one).
    auto again = CgroupDir::create_v1(host, name);
    REQUIRE(again.has_value());
    CHECK_FALSE(again->fresh());
    *g = std::move(*again);
    CHECK(g->dirs() == dirs);
    for (auto& d : dirs) CHECK(::access(d.c_str(), F_OK) == 0);
  }
  for (auto& d : dirs) CHECK(::access(d.c_str(), F_OK) == 0);
  pid_t p = sleeper();
  REQUIRE(g->add(p).has_value());
  if (g->has("freezer")) {
    REQUIRE(g->freeze(true).has_value());
    CHECK(wait_until([&] { return g->frozen(); }));
  }
  // Control: a group that holds a process cannot be removed as it is.
  CHECK(::rmdir(dirs.front().c_str()) != 0);
  CHECK(errno == EBUSY);
  std::thread reap([&] { ::waitpid(p, nullptr, 0); });
  g->remove();
  reap.join();
  CHECK(::kill(p, 0) != 0);
  for (auto& d : dirs) CHECK(::access(d.c_str(), F_OK) != 0);
}
