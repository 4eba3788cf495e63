#include <doctest/doctest.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "os/proc-view.hpp"
#include "os/sys.hpp"
#include "temp-dir.hpp"

namespace {

// What `body` returns, run in a child process (its changes to its namespaces stay there).
template <class Body>
std::string child_output(Body body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::string out = body();
    (void)!::write(fds[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  sbx::os::UniqueFd r(fds[0]);
  auto text = sbx::os::read_all(r.get());
  int st = 0;
  ::waitpid(pid, &st, 0);
  return text ? *text : std::string("read failed");
}

// What `body` returns, run as PID 1 of a new pid namespace under this process's /proc (the child
// of a child that unshared CLONE_NEWPID, as `unshare --pid --fork` runs its command).
template <class Body>
std::string as_pid1_of_a_new_namespace(Body body) {
  return child_output([&] {
    if (::unshare(CLONE_NEWPID) != 0) return std::string("unshare refused");
    return child_output(body);
  });
}

}  // namespace

TEST_CASE("proc view: this process's own /proc names it once, and own_proc leaves it alone") {
  auto seen = sbx::os::proc_nspid();
  REQUIRE(seen.has_value());
  CHECK(*seen == std::to_string(::getpid()));
  auto r = sbx::os::own_proc();
  REQUIRE(r.has_value());
  CHECK(r->empty());
}

TEST_CASE("proc view: the tests run in the host's user namespace") {
  // The suite runs as the host's root; a rootless run of the box is test_pid1's.
  if (::geteuid() == 0) CHECK(sbx::os::in_initial_user_namespace());
}

TEST_CASE("proc view: PID 1 under the host's /proc gets a proc of its own namespace") {
  if (::geteuid() != 0) return;  // a pid namespace of one's own needs CAP_SYS_ADMIN
  std::string out = as_pid1_of_a_new_namespace([] {
    // The control: before, /proc names this process by the host's pid and by 1, and /proc/1 is
    // the host's init, not this process.
    std::string before = sbx::os::proc_nspid().value_or("none");
    auto r = sbx::os::own_proc();
    std::string after = sbx::os::proc_nspid().value_or("none");
    return before + "|" + (r ? *r : "error: " + r.error().message) + "|" + after;
  });
  auto bar = out.find('|'), bar2 = out.rfind('|');
  REQUIRE(bar != std::string::npos);
  REQUIRE(bar2 != bar);
  std::string before = out.substr(0, bar), done = out.substr(bar + 1, bar2 - bar - 1), after = out.substr(bar2 + 1);
  CHECK(before.ends_with(" 1"));
  CHECK(before.find(' ') != std::string::npos);
  CHECK(done == "NSpid " + before);
  CHECK(after == "1");
}

TEST_CASE("lock_dir: one holder at a time, named by its pid; dir_lock_held sees it") {
  sbx::test::TempDir d("lock");
  std::string dir = d.path.string();
  CHECK_FALSE(sbx::os::dir_lock_held(dir));
  auto first = sbx::os::lock_dir(dir);
  REQUIRE(first.has_value());
  // flock is per open file description: a second open of the same directory, even by this
  // process, is refused while the first is held, and its holder named by /proc/locks.
  std::string holder;
  auto second = sbx::os::lock_dir(dir, &holder);
  REQUIRE_FALSE(second.has_value());
  CHECK(second.error() == std::errc::operation_would_block);
  CHECK(holder == std::to_string(::getpid()));
  std::string seen;
  CHECK(sbx::os::dir_lock_held(dir, &seen));
  CHECK(seen == std::to_string(::getpid()));
  // Nothing is made in the directory.
  CHECK(std::filesystem::is_empty(d.path));
  first->reset();
  CHECK_FALSE(sbx::os::dir_lock_held(dir));
  CHECK(sbx::os::lock_dir(dir).has_value());
  // Not a directory: refused.
  REQUIRE(sbx::os::write_file_atomic(dir + "/f", "x").has_value());
  CHECK(sbx::os::lock_dir(dir + "/f").error() == std::errc::not_a_directory);
}

TEST_CASE("lock_dir waits out a shared lock held for a moment (dir_lock_held's question)") {
  // dir_lock_held asks with a shared lock where /proc/locks shows none: a box starting on the
  // directory in that moment waits it out instead of being refused as if another box ran there.
  sbx::test::TempDir d("lockwait");
  std::string dir = d.path.string();
  sbx::os::UniqueFd asker(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  REQUIRE(asker);
  REQUIRE(::flock(asker.get(), LOCK_SH | LOCK_NB) == 0);
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    (void)::flock(asker.get(), LOCK_UN);
  });
  auto got = sbx::os::lock_dir(dir);
  release.join();
  REQUIRE(got.has_value());
  // Held shared past the wait (not a question): refused all the same, as held.
  got->reset();
  REQUIRE(::flock(asker.get(), LOCK_SH | LOCK_NB) == 0);
  auto refused = sbx::os::lock_dir(dir);
  REQUIRE_FALSE(refused.has_value());
  CHECK(refused.error() == std::errc::operation_would_block);
  // A shared lock is no box: dir_lock_held says none is held.
  CHECK_FALSE(sbx::os::dir_lock_held(dir));
}

namespace {

// The CPUs this process may run on, lowest first.
std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (::sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}

void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  REQUIRE(::sched_setaffinity(0, sizeof set, &set) == 0);
}

}  // namespace

TEST_CASE("dir_lock_held and dirs_locked_by: a lock held throughout is seen while other locks come and go") {
  // /proc/locks is handed out a page (~70 locks) per read, its place in the next read found by
  // counting: a lock released meanwhile before that place had the reader miss the lock after it
  // (`ps` then listed a running box as gone). Read again until two reads agreed, it was still
  // missed once in 1,000 under ASan: dir_lock_held asks for a lock /proc/locks does not show, and
  // dirs_locked_by reads the holders' fdinfo instead. The kernel keeps a list per CPU, the newest
  // first: here the lock asked about is the oldest of ~200 on one CPU's list while a thread on
  // that CPU drops and takes again the newest ones, and the asking thread reads on another CPU.
  auto cpus = allowed_cpus();
  REQUIRE(!cpus.empty());
  sbx::test::TempDir d("lockchurn");
  std::string dir = d.path.string() + "/box";
  REQUIRE(std::filesystem::create_directory(dir));
  std::thread churn;
  std::atomic<bool> stop = false;
  std::vector<sbx::os::UniqueFd> others;
  {
    pin_to(cpus.front());
    auto held = sbx::os::lock_dir(dir);
    REQUIRE(held.has_value());
    for (int i = 0; i < 200; ++i) {
      others.emplace_back(::open((d.path / std::to_string(i)).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
      REQUIRE(others.back());
      REQUIRE(::flock(others.back().get(), LOCK_EX) == 0);
    }
    churn = std::thread([&, cpu = cpus.front()] {
      pin_to(cpu);
      for (unsigned i = 0; !stop; ++i)  // the newest 50 dropped one by one, then taken again
        (void)::flock(others[others.size() - 1 - i % 50].get(), (i / 50) % 2 ? LOCK_EX : LOCK_UN);
    });
    pin_to(cpus.back());
    int missed = 0, unlisted = 0;
    for (int i = 0; i < 1000; ++i) missed += !sbx::os::dir_lock_held(dir);
    std::string self = std::filesystem::read_symlink("/proc/self/exe").filename().string();
    for (int i = 0; i < 300; ++i) {
      auto listed = sbx::os::dirs_locked_by(self);
      unlisted += std::none_of(listed.begin(), listed.end(), [&](const auto& l) { return l.path == dir; });
    }
    stop = true;
    churn.join();
    CHECK(missed == 0);
    CHECK(unlisted == 0);
  }
  // This process may run anywhere again.
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int c : cpus) CPU_SET(c, &all);
  CHECK(::sched_setaffinity(0, sizeof all, &all) == 0);
}

TEST_CASE("mounts_under: the mounts at and below a dir, paths unescaped, the last mounted first") {
  if (::geteuid() != 0) return;  // mounts need CAP_SYS_ADMIN; the suite runs as root
  sbx::test::TempDir d("mounts");
  std::string dir = std::filesystem::canonical(d.path).string();
  std::filesystem::create_directories(dir + "/a b/c");
  std::filesystem::create_directories(dir + "/a bx");
  // In a child with a mount namespace of its own: nothing is left mounted on the host.
  std::string text = child_output([&] {
    auto tmpfs = [](const std::string& at) { return ::mount("tmpfs", at.c_str(), "tmpfs", 0, "size=64k") == 0; };
    if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        !tmpfs(dir + "/a b") || ::mkdir((dir + "/a b/c").c_str(), 0755) != 0 || !tmpfs(dir + "/a b/c") ||
        !tmpfs(dir + "/a b/c") || !tmpfs(dir + "/a bx"))
      return std::string("set-up failed");
    std::string out;
    for (auto& m : sbx::os::mounts_under(dir + "/a b")) out += m.path.substr(dir.size()) + "=" + m.fstype + ";";
    return out;
  });
  // The stack at c top first, then c's parent; "/a bx", whose path starts as "/a b"'s does, is not
  // below it.
  CHECK(text == "/a b/c=tmpfs;/a b/c=tmpfs;/a b=tmpfs;");
  CHECK(sbx::os::mounts_under(dir).empty());  // the host's namespace: nothing was mounted here
}

TEST_CASE("mounts_under(\"/\") lists every mount, the root and /proc among them") {
  auto all = sbx::os::mounts_under("/");
  auto has = [&](const std::string& path, const std::string& type) {
    return std::any_of(all.begin(), all.end(), [&](auto& m) { return m.path == path && m.fstype == type; });
  };
  CHECK(has("/proc", "proc"));
  CHECK(std::any_of(all.begin(), all.end(), [](auto& m) { return m.path == "/"; }));
}
