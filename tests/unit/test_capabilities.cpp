#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <fstream>
#include <string>

#include "os/sys.hpp"
#include "sandbox/capabilities.hpp"
#include "temp-dir.hpp"

using sbx::sandbox::CriuVersionProbe;
using sbx::sandbox::kCriuVersionCache;

namespace {

// A stand-in for criu's `--version` that counts its runs in `runs` (a line each).
void write_fake_criu(const std::string& path, const std::string& runs, const std::string& version) {
  std::string tmp = path + ".new";
  {
    std::ofstream f(tmp);
    f << "#!/bin/sh\necho run >> " << runs << "\necho 'Version: " << version << "'\necho 'GitID: v" << version << "'\n";
  }
  ::chmod(tmp.c_str(), 0755);
  ::rename(tmp.c_str(), path.c_str());  // a new inode, as a package upgrade gives
}

int runs_of(const std::string& runs) {
  std::ifstream f(runs);
  int n = 0;
  for (std::string line; std::getline(f, line);) ++n;
  return n;
}

std::optional<std::string> probe(const std::string& criu, const std::string& cache, bool* cached = nullptr) {
  CriuVersionProbe p(criu, cache);
  auto v = p.version(5000);
  if (cached) *cached = p.cached();
  return v;
}

}  // namespace

TEST_CASE("criu's version is cached by the binary's identity, and only a cache of that binary is used") {
  sbx::test::TempDir t("criu-cache");
  std::string criu = t.path / "criu", runs = t.path / "runs", cache = t.path / "cache";
  std::string file = cache + "/" + kCriuVersionCache;
  ::mkdir(cache.c_str(), 0700);
  write_fake_criu(criu, runs, "4.7");

  bool cached = true;
  CHECK(probe(criu, cache, &cached) == "4.7");
  CHECK_FALSE(cached);
  CHECK(runs_of(runs) == 1);
  struct stat st {};
  REQUIRE(::stat(file.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);

  // The same binary again: from the cache, criu not started.
  CHECK(probe(criu, cache, &cached) == "4.7");
  CHECK(cached);
  CHECK(runs_of(runs) == 1);

  // Another criu at the same path (an upgrade): probed again, and that answer cached.
  write_fake_criu(criu, runs, "4.8");
  CHECK(probe(criu, cache, &cached) == "4.8");
  CHECK_FALSE(cached);
  CHECK(runs_of(runs) == 2);
  CHECK(probe(criu, cache, &cached) == "4.8");
  CHECK(runs_of(runs) == 2);

  SUBCASE("a cache whose version is not a version is not believed, and is rewritten") {
    auto v = boost::json::parse(*sbx::os::read_file(file)).as_object();
    v["version"] = "4.8; echo hi";
    REQUIRE(sbx::os::write_file_atomic(file, boost::json::serialize(v)));
    CHECK(probe(criu, cache, &cached) == "4.8");
    CHECK_FALSE(cached);
    CHECK(runs_of(runs) == 3);
    CHECK(probe(criu, cache, &cached) == "4.8");
    CHECK(cached);
  }
  SUBCASE("a cache of another binary (another key) is not used") {
    auto v = boost::json::parse(*sbx::os::read_file(file)).as_object();
    v["criu"] = "{\"path\":\"/elsewhere/criu\"}";
    v["version"] = "9.9";
    REQUIRE(sbx::os::write_file_atomic(file, boost::json::serialize(v)));
    CHECK(probe(criu, cache) == "4.8");
    CHECK(runs_of(runs) == 3);
  }
  SUBCASE("a cache others may write is not believed, and is rewritten") {
    REQUIRE(::chmod(file.c_str(), 0666) == 0);
    CHECK(probe(criu, cache, &cached) == "4.8");
    CHECK_FALSE(cached);
    CHECK(runs_of(runs) == 3);
    CHECK(probe(criu, cache, &cached) == "4.8");
    CHECK(cached);  // written again, 0600
  }
  SUBCASE("a symlink at the cache's name is not followed, and is replaced, never written through") {
    std::string elsewhere = t.path / "elsewhere.json";
    std::string good = *sbx::os::read_file(file);
    REQUIRE(sbx::os::write_file_atomic(elsewhere, good));
    ::unlink(file.c_str());
    REQUIRE(::symlink(elsewhere.c_str(), file.c_str()) == 0);
    CHECK(probe(criu, cache, &cached) == "4.8");
    CHECK_FALSE(cached);  // the cache behind the link was a good one: not reading it is the point
    CHECK(runs_of(runs) == 3);
    REQUIRE(::lstat(file.c_str(), &st) == 0);
    CHECK(S_ISREG(st.st_mode));
    CHECK(*sbx::os::read_file(elsewhere) == good);
  }
  SUBCASE("no cache dir: the probe runs every time") {
    CHECK(probe(criu, "") == "4.8");
    CHECK(probe(criu, "") == "4.8");
    CHECK(runs_of(runs) == 4);
  }
  SUBCASE("no criu: no version, nothing started") {
    CriuVersionProbe p(std::nullopt, cache);
    CHECK_FALSE(p.version(1000));
    CHECK(runs_of(runs) == 2);
  }
}

TEST_CASE("os: read_own_file_at reads a file of ours that no one else may write, and nothing else") {
  sbx::test::TempDir d("own-file");
  auto dir = sbx::os::open_dir(d.path.string());
  REQUIRE(dir.has_value());
  auto path = [&](const char* n) { return (d.path / n).string(); };
  auto put = [&](const char* n, const std::string& text, mode_t mode) {
    std::ofstream(path(n)) << text;
    REQUIRE(::chmod(path(n).c_str(), mode) == 0);
  };
  put("good", "hello", 0600);
  auto good = sbx::os::read_own_file_at(dir->get(), "good", 5);
  REQUIRE(good.has_value());  // the control
  CHECK(*good == "hello");
  CHECK(sbx::os::read_own_file_at(dir->get(), "good", 4).error() == sbx::os::sys_error(EFBIG));

  put("group", "hello", 0620);
  CHECK(sbx::os::read_own_file_at(dir->get(), "group", 64).error() == sbx::os::sys_error(EPERM));
  put("others", "hello", 0602);
  CHECK(sbx::os::read_own_file_at(dir->get(), "others", 64).error() == sbx::os::sys_error(EPERM));
  put("readable", "hello", 0644);  // others may read it: that is not what is checked
  CHECK(sbx::os::read_own_file_at(dir->get(), "readable", 64).has_value());
  if (::geteuid() == 0) {
    put("theirs", "hello", 0600);
    REQUIRE(::chown(path("theirs").c_str(), 65534, 65534) == 0);
    CHECK(sbx::os::read_own_file_at(dir->get(), "theirs", 64).error() == sbx::os::sys_error(EPERM));
  }
  REQUIRE(::mkfifo(path("fifo").c_str(), 0600) == 0);  // not waited on (O_NONBLOCK), not read
  CHECK(sbx::os::read_own_file_at(dir->get(), "fifo", 64).error() == sbx::os::sys_error(EPERM));
  REQUIRE(::symlink(path("good").c_str(), path("link").c_str()) == 0);
  CHECK(sbx::os::read_own_file_at(dir->get(), "link", 64).error() == sbx::os::sys_error(ELOOP));
  CHECK_FALSE(sbx::os::read_own_file_at(dir->get(), "../good", 64).has_value());
}

TEST_CASE("flat_fallback_refusal: auto refuses a flat agent only where nothing would hold it in" *
          doctest::skip(::geteuid() != 0)) {
  // This test runs as root in the host's user namespace, holding CAP_SYS_ADMIN: the case where a
  // flat agent would be root with nothing around it, unless a kernel of its own is.
  sbx::sandbox::HostCapabilities caps;
  caps.isolation = "process";
  CHECK(sbx::sandbox::flat_fallback_refusal("auto", caps).starts_with("the supervisor is root on this host"));
  caps.isolation = "container";  // a privileged container: it holds in nothing
  CHECK(sbx::sandbox::flat_fallback_refusal("auto", caps).starts_with("the supervisor is root holding CAP_SYS_ADMIN"));
  for (const char* vm : {"gvisor", "microvm"}) {
    caps.isolation = vm;
    CHECK(sbx::sandbox::flat_fallback_refusal("auto", caps).empty());
    CHECK(sbx::sandbox::flat_fallback_refusal("refuse", caps) ==
          "the profile's isolation.without_namespaces is \"refuse\"");
  }
  caps.isolation = "process";
  CHECK(sbx::sandbox::flat_fallback_refusal("run", caps).empty());
}
