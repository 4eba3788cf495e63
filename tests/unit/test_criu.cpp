// checkpoint/criu.cpp against the real criu (skipped where there is none, or not as root).
#include <doctest/doctest.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "checkpoint/criu.hpp"
#include "os/files.hpp"
#include "temp-dir.hpp"

using namespace sbx::checkpoint;

namespace {
// Runs `criu check` with its log at level 4 into `log`, with /run from `run_tmpfs` (or not).
std::string check_log(const std::string& criu, const std::string& dir, const std::string& log, int run_tmpfs) {
  CriuRun run;
  run.args = {"check", "-v4", "--log-file", dir + "/" + log};
  run.output = dir + "/" + log + ".out";
  run.run_tmpfs = run_tmpfs;
  auto pid = spawn_criu(criu, run);
  REQUIRE(pid.has_value());
  int st = 0;
  REQUIRE(::waitpid(*pid, &st, 0) == *pid);
  auto text = sbx::os::read_file(dir + "/" + log);
  return text ? *text : std::string();
}
}  // namespace

TEST_CASE("criu: the kerndat cache kept in the box's tmpfs is loaded by the next criu") {
  auto criu = find_criu();
  if (!criu || ::geteuid() != 0) return;  // nothing to run
  sbx::test::TempDir t("criu-test");
  KdatCache cache;
  int fd = cache.fd();
  REQUIRE_MESSAGE(fd >= 0, "fsopen/fsmount of a tmpfs refused here");
  CHECK(cache.fd() == fd);  // one tmpfs for the box's life
  std::string dir = t.path.string();
  std::string first = check_log(*criu, dir, "1.log", fd);
  std::string second = check_log(*criu, dir, "2.log", fd);
  CHECK(first.find("Loaded kdat cache") == std::string::npos);
  CHECK_MESSAGE(second.find("Loaded kdat cache from /run/criu.kdat") != std::string::npos, second.substr(0, 2000));
  // The control: without the tmpfs, where the host's /run is no tmpfs, criu loads no cache.
  struct statfs run {};
  REQUIRE(::statfs("/run", &run) == 0);
  if (run.f_type != TMPFS_MAGIC)
    CHECK(check_log(*criu, dir, "3.log", -1).find("Loaded kdat cache") == std::string::npos);
}

TEST_CASE("criu: own_pid_ns runs it as PID 1 of a pid namespace of its own, with its own /proc") {
  if (::geteuid() != 0) return;  // CLONE_NEWPID needs CAP_SYS_ADMIN
  sbx::test::TempDir t("criu-pidns");
  std::string out = t.path.string() + "/out";
  // Any program stands in for criu here: a shell that says who it is, by its own pid and by the
  // /proc it sees (the host's /proc would name its pid there instead).
  CriuRun run;
  run.args = {"-c", "echo $$; cd -P /proc/self && pwd; readlink /proc/$$/ns/pid"};
  run.output = out;
  run.own_pid_ns = true;
  auto pid = spawn_criu("/bin/sh", run);
  REQUIRE(pid.has_value());
  int st = 0;
  REQUIRE(::waitpid(*pid, &st, 0) == *pid);
  CHECK(WIFEXITED(st));
  auto text = sbx::os::read_file(out);
  REQUIRE(text.has_value());
  char ours[64] = {};
  REQUIRE(::readlink("/proc/self/ns/pid", ours, sizeof ours - 1) > 0);
  CHECK_MESSAGE(text->starts_with("1\n/proc/1\npid:["), *text);
  CHECK(text->find(ours) == std::string::npos);  // not our pid namespace
  // The control: without it, the same shell is an ordinary child in ours.
  run.own_pid_ns = false;
  pid = spawn_criu("/bin/sh", run);
  REQUIRE(pid.has_value());
  REQUIRE(::waitpid(*pid, &st, 0) == *pid);
  text = sbx::os::read_file(out);
  REQUIRE(text.has_value());
  std::string p = std::to_string(*pid);
  CHECK_MESSAGE(text->starts_with(p + "\n/proc/" + p + "\n"), *text);
  CHECK(text->find(ours) != std::string::npos);
}

TEST_CASE("criu: a live copy's /tmp that cannot be mounted is an error naming that step") {
  if (::geteuid() != 0) return;  // a mount namespace of its own needs CAP_SYS_ADMIN
  sbx::test::TempDir t("criu-tmp");
  std::string dir = t.path.string();
  CriuRun run;
  run.args = {"-c", "exit 0"};
  run.output = dir + "/out";
  run.tmp_overlay = dir + "/gone";  // neither its tmp/ nor its tmp-upper/ is there
  const char* step = nullptr;
  auto pid = spawn_criu("/bin/sh", run, &step);
  REQUIRE_FALSE(pid.has_value());
  // The child that failed exits at once, for the caller's reaper (the box's) to collect: here, us.
  int st = 0;
  CHECK(::waitpid(-1, &st, 0) > 0);
  CHECK(pid.error() == std::errc::no_such_file_or_directory);
  REQUIRE(step != nullptr);
  CHECK(std::string(step) == "mount the copy's /tmp");
  // The control: with both directories there, a bind of tmp-upper/ at least, and the shell runs.
  REQUIRE(sbx::os::make_dirs(dir + "/gone/tmp", 0755).has_value());
  REQUIRE(sbx::os::make_dirs(dir + "/gone/tmp-upper", 0755).has_value());
  REQUIRE(sbx::os::make_dirs(dir + "/gone/tmp-work", 0755).has_value());
  step = nullptr;
  pid = spawn_criu("/bin/sh", run, &step);
  REQUIRE(pid.has_value());
  REQUIRE(::waitpid(*pid, &st, 0) == *pid);
  CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 0));
  CHECK(step == nullptr);
}
