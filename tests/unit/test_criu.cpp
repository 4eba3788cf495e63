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
