// sandboxer doctor [--json]: one line per capability of this host, and what a missing one means
// for profiles. Everything is tried for real (a throwaway cgroup, namespace, tmpfs), not guessed.
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/landlock.h>
#include <sched.h>
#include <seccomp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <boost/process.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "os/cgroup.hpp"
#include "os/proc-view.hpp"
#include "os/sys.hpp"
#include "profile/profile.hpp"
#include "sandbox/capabilities.hpp"
#include "sandbox/launcher.hpp"
#include "sandbox/policy.hpp"

namespace bp = boost::process;

namespace sbx::cli {

namespace {

struct Line {
  std::string what;
  bool ok;
  std::string detail;   // what was found
  std::string meaning;  // for profiles, when missing (or partial)
};

// Runs `fn` in a throwaway child (so namespaces and mounts it makes vanish with it); returns
// 0 or the errno it reported.
template <class Fn>
int in_child(Fn fn) {
  pid_t p = ::fork();
  if (p == 0) ::_exit(fn());
  if (p < 0) return errno;
  int st = 0;
  ::waitpid(p, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : EIO;
}

// `fn` in a throwaway child with a private mount namespace of its own: what it mounts vanishes.
template <class Fn>
int in_mount_ns(Fn fn) {
  return in_child([&] {
    if (::unshare(CLONE_NEWNS) != 0) return errno;
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return errno;
    return fn();
  });
}

std::string join(const std::vector<std::string>& v, const char* sep = ", ") {
  std::string out;
  for (auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

// How long a process takes to join `g` as a branch's ns-init does, in ms: a child writes "0"
// through each of the group's join fds (v1 `tasks`) and reports the time it took; it leaves the
// group by exiting. A kernel that takes its global threadgroup lock for that move waits for an RCU
// grace period there, milliseconds on every agent start (README, Hosts).
std::optional<double> join_ms(os::CgroupDir& g) {
  auto fds = g.open_join_fds();
  auto p = os::make_pipe();
  if (!fds || !p) return std::nullopt;
  pid_t c = ::fork();
  if (c == 0) {
    auto t0 = std::chrono::steady_clock::now();
    for (auto& fd : *fds)
      if (::write(fd.get(), "0", 1) != 1) ::_exit(1);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ::_exit(::write(p->write.get(), &ms, sizeof ms) == sizeof ms ? 0 : 1);
  }
  if (c < 0) return std::nullopt;
  p->write.reset();
  double ms = -1;
  bool got = ::read(p->read.get(), &ms, sizeof ms) == sizeof ms;
  int st = 0;
  ::waitpid(c, &st, 0);
  if (!got || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return std::nullopt;
  return ms;
}

Line check_cgroup() {
  auto h = os::detect_cgroups();
  if (h.version == "none")
    return {"cgroup", false, "none mounted",
            "resources.memory, cpus, pids and the idle CPU check are not enforced; oom and pids_limit reasons cannot "
            "occur"};
  std::vector<std::string> used;
  for (auto& c : {"memory", "cpu", "cpuacct", "pids", "freezer"})
    if (std::find(h.controllers.begin(), h.controllers.end(), c) != h.controllers.end()) used.emplace_back(c);
  auto g = os::CgroupDir::create(h, "sbx-doctor-" + std::to_string(::getpid()));
  std::string where;
  if (h.version == "v1") {
    // Each hierarchy has its own path: say where each used controller's groups go.
    std::map<std::string, std::vector<std::string>> by_dir;
    for (auto& c : used) by_dir[h.v1_dirs.at(c)].push_back(c);
    for (auto& [d, cs] : by_dir) where += (where.empty() ? "" : "; ") + join(cs, "+") + " under " + d;
  } else {
    where = "under " + h.v2_dir;
  }
  std::string detail = h.version + " (" + join(used) + "), " + where;
  if (!h.v2_dir.empty() && h.version == "v1") {
    auto ctl = os::read_file(h.v2_dir + "/cgroup.controllers");
    std::string c = ctl ? *ctl : "";
    while (!c.empty() && (c.back() == '\n' || c.back() == ' ')) c.pop_back();
    detail += "; cgroup2 also at " + h.v2_dir + " with controllers: " + (c.empty() ? "none" : c);
  }
  if (!g)
    return {"cgroup", false, detail + "; creating a group failed: " + g.error().message(),
            "ceilings of resources.* are not enforced (the box still runs, box.started says so)"};
  std::vector<std::string> missing;
  for (auto& c : {"memory", "cpu", "pids"})
    if (!g->has(c)) missing.emplace_back(c);
  if (h.version == "v1")
    if (auto ms = join_ms(*g)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "; a process joining its groups took %.3f ms", *ms);
      detail += buf;
      if (*ms >= 1) detail += " (an RCU grace period, paid by every agent start; see README, Hosts)";
    }
  g->remove();
  if (!missing.empty())
    return {"cgroup", false, detail + "; missing: " + join(missing),
            "resources." + join(missing, ", resources.") + " not enforced (cpus needs cpu)"};
  return {"cgroup", true, detail, ""};
}

Line check_seccomp() {
  bool ok = ::prctl(PR_GET_SECCOMP) >= 0;
  const scmp_version* v = seccomp_version();
  std::string lib =
      "libseccomp " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->micro);
  if (!ok)
    return {"seccomp", false, "not in this kernel",
            "isolation.seccomp cannot be enforced: the agent may call anything"};
  int mode = ::prctl(PR_GET_SECCOMP);
  std::string detail = "filter mode, " + lib + (mode == 2 ? "; this process is already filtered" : "");
  return {"seccomp", true, detail, mode == 2 ? "criu cannot dump a supervisor under seccomp: live checkpoint off" : ""};
}

Line check_landlock() {
  long abi = ::syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION);
  if (abi <= 0)
    return {"landlock", false, std::string("not available (") + std::strerror(errno) + ")",
            "isolation.landlock is not applied; the mounts (read-only root, masks) still hold"};
  std::string d = "ABI " + std::to_string(abi);
  if (abi >= 6) d += " (signal and abstract-socket scoping)";
  return {"landlock", true, d, "applied to ephemeral and persistent profiles only: criu does not restore it"};
}

Line check_namespaces(const sandbox::HostCapabilities& caps, const std::optional<profile::Profile>& dflt) {
  auto ns = sandbox::can_make_namespaces();
  bool pidmnt = ns.has_value();
  int net = in_child([] { return ::unshare(CLONE_NEWNET) == 0 ? 0 : errno; });
  std::string detail = std::string("pid+mount: ") + (pidmnt ? "yes" : "no (" + ns.error().message + ")") +
                       ", network: " + (net == 0 ? "yes" : std::string("no (") + std::strerror(net) + ")");
  if (!pidmnt) {
    auto refusal = sandbox::flat_fallback_refusal(dflt ? dflt->isolation.without_namespaces : "auto", caps);
    if (!refusal.empty())
      return {"namespaces", false, detail, "boxes of the default profile refuse to start: " + refusal};
    return {"namespaces", false, detail,
            "the agent runs flat under the supervisor: no own root, no masks, no live checkpoint (filesystem-only)"};
  }
  if (net != 0) return {"namespaces", false, detail, "network: none cannot be enforced"};
  return {"namespaces", true, detail, ""};
}

// Mounts an overlay in a throwaway mount namespace over a tmpfs (as a branch's /tmp is mounted),
// with `opts` added; 0 or the errno.
int try_overlay(const std::string& dir, const char* opts) {
  // Everything the child needs is made before the fork.
  std::vector<std::string> dirs = {dir + "/l", dir + "/u", dir + "/w", dir + "/m"};
  std::string data = "lowerdir=" + dirs[0] + ",upperdir=" + dirs[1] + ",workdir=" + dirs[2] + opts;
  return in_mount_ns([&] {
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") != 0) return errno;
    for (auto& d : dirs)
      if (::mkdir(d.c_str(), 0700) != 0) return errno;
    return ::mount("overlay", dirs[3].c_str(), "overlay", 0, data.c_str()) == 0 ? 0 : errno;
  });
}

Line check_overlay() {
  char tmpl[] = "/tmp/sbx-doctor-XXXXXX";
  std::string dir = ::mkdtemp(tmpl) ? tmpl : "";
  int plain = dir.empty() ? errno : try_overlay(dir, "");
  int vol = dir.empty() || plain != 0 ? plain : try_overlay(dir, ",volatile");
  if (!dir.empty()) ::rmdir(dir.c_str());
  if (plain != 0)
    return {"overlayfs", false, std::string("mounting one: ") + std::strerror(plain),
            "a branch's /tmp is a directory of its own, not an overlay of the host's /tmp"};
  if (vol != 0)
    return {"overlayfs", true,
            std::string("mounts; volatile: no (") + std::strerror(vol) +
                "), so a branch's end syncs the host's disk (README, \"What works today\")",
            ""};
  return {"overlayfs", true, "mounts, volatile too (a branch's end does not sync the host's disk)", ""};
}

Line check_ksm() {
  auto run = os::read_file("/sys/kernel/mm/ksm/run");
  if (!run) return {"ksm", false, "not in this kernel", "live copies of a fork do not share identical pages"};
  bool on = !run->empty() && (*run)[0] == '1';
  return {"ksm", on, on ? "running (/sys/kernel/mm/ksm/run is 1)" : "stopped (/sys/kernel/mm/ksm/run is not 1)",
          on ? "" : "live copies of a fork do not share identical pages until root writes 1 there"};
}

Line check_criu() {
  auto path = bp::search_path("criu");
  if (path.empty())
    return {"criu", false, "not on PATH", "no live checkpoint or fork: checkpoints are filesystem-only"};
  std::string version, check;
  try {
    bp::ipstream out;
    bp::child c(path, "--version", bp::std_out > out, bp::std_err > bp::null);
    std::string line;
    while (std::getline(out, line))
      if (line.starts_with("Version:")) version = line.substr(line.find_first_not_of(" ", 8));
    c.wait();
    bp::ipstream chk;
    bp::child c2(path, "check", (bp::std_out & bp::std_err) > chk);
    std::string all;
    while (std::getline(chk, line)) all += (all.empty() ? "" : " | ") + line;
    c2.wait();
    check = (c2.exit_code() == 0 ? "" : "failed: ") + all;
  } catch (const std::exception& e) {
    return {"criu", false, std::string("cannot run: ") + e.what(), "no live checkpoint or fork"};
  }
  bool ok = !version.empty() && !check.starts_with("failed");
  std::string meaning;
  if (!version.empty() && version < "4.2")
    meaning =
        "criu < 4.2 cannot dump processes holding TCP/UDP sockets on this kernel: agents with sockets cannot be "
        "checkpointed";
  if (!ok) meaning = "no live checkpoint or fork: checkpoints are filesystem-only";
  return {"criu", ok && meaning.empty(), version + "; criu check: " + check, meaning};
}

Line check_disk() {
  // A sized tmpfs in a throwaway mount namespace.
  char tmpl[] = "/tmp/sbx-doctor-XXXXXX";
  std::string dir = ::mkdtemp(tmpl) ? tmpl : "";
  int tmpfs = dir.empty() ? errno : in_mount_ns([&] {
    return ::mount("tmpfs", dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=1m") == 0 ? 0 : errno;
  });
  if (!dir.empty()) ::rmdir(dir.c_str());
  int loopfd = ::open("/dev/loop-control", O_RDWR | O_CLOEXEC);
  bool mkfs = !bp::search_path("mkfs.ext4").empty();
  std::string loop = loopfd >= 0 && mkfs ? "loop-mounted ext4 image for persistent profiles: yes"
                     : loopfd < 0        ? std::string("loop devices: no (") + std::strerror(errno) +
                                        "): a persistent profile's disk is not enforced"
                                  : std::string("mkfs.ext4 missing: a persistent profile's disk is not enforced");
  if (loopfd >= 0) ::close(loopfd);
  if (tmpfs != 0)
    return {"disk", false, std::string("sized tmpfs: no (") + std::strerror(tmpfs) + "); " + loop,
            "resources.disk is not enforced: the workspace shares the state dir's filesystem"};
  return {"disk", true,
          "sized tmpfs for a workspace that lives as long as the box: yes (counts against its memory); " + loop,
          loopfd >= 0 && mkfs ? "" : "persistence: persistent with resources.disk runs without a disk ceiling"};
}

// The profile a box takes without --profile: where it comes from, and that it loads.
Line check_profile(std::optional<profile::Profile>& out) {
  try {
    auto src = profile::find_profile("default");
    out = profile::load_profile(src.where.starts_with("built-in ") ? "default" : src.where);
    return {"profile", true, "default, from " + src.where, ""};
  } catch (const std::exception& e) {
    return {"profile", false, e.what(), "a box started here without --profile refuses to start"};
  }
}

Line check_privileges(const std::optional<profile::Profile>& dflt) {
  std::string d = "uid " + std::to_string(::getuid());
  bool sysres = ::prctl(PR_CAPBSET_READ, CAP_SYS_RESOURCE) == 1;
  struct rlimit rl {};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  d += std::string(", CAP_SYS_RESOURCE: ") + (sysres ? "yes" : "no") + ", open files hard limit " +
       (rl.rlim_max == RLIM_INFINITY ? std::string("unlimited") : std::to_string(rl.rlim_max));
  std::string meaning;
  auto mean = [&](const std::string& m) { meaning += (meaning.empty() ? "" : "; ") + m; };
  if (::geteuid() != 0)
    mean(
        "the agent's oom_score_adj is not raised (a supervisor that is not root may not write it before the "
        "agent's exec); resources.open_files above the hard limit is refused");
  else if (!sysres)
    mean(
        "the agent is made the preferred OOM victim (oom_score_adj 1000) instead of shielding the supervisor; "
        "resources.open_files above the hard limit is refused");
  if (!os::in_initial_user_namespace()) {
    d += ", in a user namespace of its own (rootless)";
    mean(
        "no live checkpoint: criu cannot suspend an agent's seccomp filter from a user namespace, so a checkpoint "
        "is files-only");
  }
  // The default profile's user and capabilities, which a supervisor of this user applies.
  if (!dflt) {
    mean("the default profile's user and capabilities are not checked: it did not load (the profile line)");
    return {"privileges", true, d, meaning};
  }
  try {
    sandbox::check_supervisor_privileges(*dflt);
  } catch (const std::exception& e) {
    mean(e.what());
    return {"privileges", false, d, meaning};
  }
  return {"privileges", true, d, meaning};
}

}  // namespace

int cmd_doctor(const std::vector<std::string>& args) {
  auto a = parse_args(args, {.usage = "usage: sandboxer doctor [--json]", .flags = {"--json"}, .max_positionals = 0});
  bool json = a.has("--json");
  std::optional<profile::Profile> dflt;
  Line profile_line = check_profile(dflt);
  sandbox::CommandProbe criu({"criu", "--version"});
  auto caps = sandbox::detect_capabilities(&criu);
  std::vector<Line> lines = {check_cgroup(),  check_seccomp(),       check_landlock(), check_namespaces(caps, dflt),
                             check_overlay(), check_criu(),          check_ksm(),      check_disk(),
                             profile_line,    check_privileges(dflt)};
  if (json) {
    boost::json::object o;
    for (auto& l : lines) {
      boost::json::object e{{"ok", l.ok}, {"detail", l.detail}};
      if (!l.meaning.empty()) e["meaning"] = l.meaning;
      o[l.what] = std::move(e);
    }
    o["isolation"] = caps.isolation;
    std::cout << boost::json::serialize(o) << "\n";
  } else {
    std::cout << "isolation level of this host: " << caps.isolation << "\n";
    for (auto& l : lines) {
      std::cout << (l.ok ? "ok      " : "missing ") << l.what
                << std::string(12 - std::min<size_t>(l.what.size(), 11), ' ') << l.detail << "\n";
      if (!l.meaning.empty()) std::cout << "        " << std::string(12, ' ') << "-> " << l.meaning << "\n";
    }
  }
  // Non-zero when the default profile cannot be enforced as written.
  for (auto& l : lines)
    if (!l.ok && (l.what == "cgroup" || l.what == "namespaces" || l.what == "seccomp" || l.what == "profile" ||
                  l.what == "privileges"))
      return 1;
  return 0;
}

}  // namespace sbx::cli
