// The Box's side of ceilings and policy: the branch's cgroup and workspace before its clone, the
// limits watcher after, the reason a limit gives to proc.exited, and the teardown.
#include <dirent.h>
#include <fcntl.h>
#include <linux/loop.h>
#include <spdlog/spdlog.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "os/sys.hpp"
#include "sandbox/policy.hpp"
#include "supervisor/box.hpp"

namespace sbx::supervisor {

namespace {
auto log() {
  static auto l = spdlog::default_logger()->clone("policy");
  return l;
}
// The loop device an image file is attached to (path "" where none is): each configured device
// (/sys/block/loopN/loop exists) asked for its backing file's device and inode.
struct AttachedTo {
  std::string path;
  bool autoclear = false;  // it frees itself at its last close (as ours are)
};
AttachedTo loop_device_of(int image_fd) {
  struct stat st {};
  if (::fstat(image_fd, &st) != 0) return {};
  AttachedTo found;
  DIR* d = ::opendir("/sys/block");
  if (!d) return {};
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (!name.starts_with("loop") || ::access(("/sys/block/" + name + "/loop").c_str(), F_OK) != 0) continue;
    os::UniqueFd loop(::open(("/dev/" + name).c_str(), O_RDONLY | O_CLOEXEC));
    struct loop_info64 info {};
    if (loop && ::ioctl(loop.get(), LOOP_GET_STATUS64, &info) == 0 && info.lo_inode == st.st_ino &&
        info.lo_device == st.st_dev) {
      found = {"/dev/" + name, (info.lo_flags & LO_FLAGS_AUTOCLEAR) != 0};
      break;
    }
  }
  ::closedir(d);
  return found;
}

// A persistent workspace with a disk ceiling: an ext4 image in the branch's state dir, made once
// and attached to a loop device by every box that runs on this state dir. The device stays
// attached while `fd` is open or it is mounted (LO_FLAGS_AUTOCLEAR).
struct LoopDevice {
  os::UniqueFd fd;
  std::string path;
};
base::Result<LoopDevice> attach_ext4_image(const std::string& image, int64_t size, const profile::Profile& prof) {
  struct stat st {};
  if (::stat(image.c_str(), &st) != 0) {
    os::UniqueFd f(::open(image.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!f) return base::sys_fail("create " + image, errno);
    if (::ftruncate(f.get(), size) != 0) return base::sys_fail("size " + image, errno);
    f.reset();
    std::string owner =
        std::to_string(prof.isolation.uid.value_or(0)) + ":" + std::to_string(prof.isolation.gid.value_or(0));
    if (!sandbox::run_and_capture({"mkfs.ext4", "-q", "-F", "-E", "root_owner=" + owner, "-m", "0", image}, 30000)) {
      ::unlink(image.c_str());
      return base::fail("mkfs.ext4 " + image + " failed (is e2fsprogs installed?)");
    }
  }
  os::UniqueFd ctl(::open("/dev/loop-control", O_RDWR | O_CLOEXEC));
  if (!ctl) return base::sys_fail("open /dev/loop-control", errno);
  os::UniqueFd backing(::open(image.c_str(), O_RDWR | O_CLOEXEC));
  if (!backing) return base::sys_fail("open " + image, errno);
  // An autoclear device the last unmount (an earlier run's, release_stale_mounts) has let go of
  // is detached by the kernel after umount returns (its rundown work): waited for, up to 2 s.
  auto dev = loop_device_of(backing.get());
  for (int i = 0; i < 40 && dev.autoclear; ++i) {
    ::usleep(50 * 1000);
    dev = loop_device_of(backing.get());
  }
  if (!dev.path.empty())
    return base::fail("mount " + image + ": it is attached to " + dev.path +
                          " already (mounted elsewhere, by another box or by hand): a second mount would "
                          "write one ext4 through two caches and corrupt it",
                      "busy");
  for (int attempt = 0; attempt < 5; ++attempt) {
    int n = ::ioctl(ctl.get(), LOOP_CTL_GET_FREE);
    if (n < 0) return base::sys_fail("LOOP_CTL_GET_FREE", errno);
    LoopDevice loop{os::UniqueFd(), "/dev/loop" + std::to_string(n)};
    loop.fd.reset(::open(loop.path.c_str(), O_RDWR | O_CLOEXEC));
    if (!loop.fd) return base::sys_fail("open " + loop.path, errno);
    struct loop_config cfg {};
    cfg.fd = static_cast<uint32_t>(backing.get());
    cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR;  // the device frees itself at the last unmount
    if (::ioctl(loop.fd.get(), LOOP_CONFIGURE, &cfg) != 0) {
      if (errno == EBUSY) continue;  // another process took it first
      return base::sys_fail("LOOP_CONFIGURE " + loop.path, errno);
    }
    return loop;
  }
  return base::fail("no free loop device");
}

}  // namespace

os::CgroupHost Box::cgroup_host() const {
  auto host = os::detect_cgroups();
  // SANDBOXER_CGROUP=none | v2:DIR picks the hierarchy by hand: for hosts whose detection is
  // wrong, and for testing the v2 code on a hybrid host (a cgroup2 mount without controllers).
  if (auto* force = std::getenv("SANDBOXER_CGROUP"); force && *force) {
    std::string f = force;
    if (f == "none") {
      host = os::CgroupHost{};
    } else if (f.starts_with("v2:")) {
      host = os::CgroupHost{};
      host.version = "v2";
      host.v2_dir = f.substr(3);
    } else {
      throw std::runtime_error("SANDBOXER_CGROUP=" + f + ": expected none or v2:DIR");
    }
  }
  return host;
}

std::vector<std::pair<std::string, std::string>> Box::cgroup_view(const Branch& b) {
  std::vector<std::pair<std::string, std::string>> out;
  if (!b.cgroup) return out;
  if (b.cgroup->v2()) {
    if (auto dirs = b.cgroup->dirs(); !dirs.empty()) out.emplace_back("", dirs.front());
    return out;
  }
  auto controllers = os::CgroupDir::v1_controllers();
  controllers.push_back("devices");
  for (auto& c : controllers)
    if (b.cgroup->has(c)) out.emplace_back(c, b.cgroup->dir_of(c));
  return out;
}

std::vector<os::UniqueFd> Box::make_branch_cgroup(const os::CgroupHost& host, Branch& b, boost::json::object* state) {
  const profile::Profile& prof = opts_.profile;
  boost::json::object scratch;
  boost::json::object& cg_state = state ? *state : scratch;
  auto g = os::CgroupDir::create(host, "sbx-" + id_ + "-" + b.name);
  if (!g) {
    log()->warn("create the cgroup of branch {}: {}; its ceilings are not enforced", b.name, g.error().message());
    return {};
  }
  b.cgroup = std::make_unique<os::CgroupDir>(std::move(*g));
  // The group of a run of this box that was killed (same state dir, same name) may still be
  // frozen (the journal stopped its agent for a full disk) and hold that agent: a new agent must
  // not join a frozen group, and the old tree is no one's now.
  if (!b.cgroup->fresh()) {
    if (b.cgroup->populated()) {
      log()->warn("branch {}: its cgroup still holds processes of an earlier run of this box: killing them", b.name);
      (void)b.cgroup->kill_all(2000);
    }
    (void)b.cgroup->freeze(false);
  }
  std::string how = std::string("cgroup ") + (b.cgroup->v2() ? "v2" : "v1");
  auto set = [&](const char* field, bool wanted, auto&& fn) {
    if (!wanted) return;
    if (auto r = fn(); r)
      cg_state[field] = how;
    else
      cg_state[field] = std::string("not enforced: ") + field + ": " + r.error().message();
  };
  // The agent's ceilings sit below the box's own, so an agent at its ceiling leaves the
  // supervisor room to keep serving.
  int64_t memory = prof.resources.memory, pids = prof.resources.pids;
  std::string mem_note, pids_note;
  if (auto box_mem = os::host_limit(host, "memory")) {
    int64_t reserve = std::max<int64_t>(32 << 20, *box_mem / 20);
    int64_t room = std::max<int64_t>(*box_mem - reserve, 8 << 20);
    if (memory == 0 || memory > room) {
      memory = room;
      mem_note = " (capped at " + std::to_string(room) + ", below the box's " + std::to_string(*box_mem) + ")";
    }
  }
  if (auto box_pids = os::host_limit(host, "pids")) {
    int64_t room = std::max<int64_t>(*box_pids - 16, 2);
    if (pids == 0 || pids > room) {
      pids = room;
      pids_note = " (capped at " + std::to_string(room) + ", below the box's " + std::to_string(*box_pids) + ")";
    }
  }
  set("memory", memory > 0, [&] { return b.cgroup->set_memory(memory); });
  set("cpus", prof.resources.cpus > 0, [&] { return b.cgroup->set_cpus(prof.resources.cpus); });
  set("pids", pids > 0, [&] { return b.cgroup->set_pids(pids); });
  // Whatever the profile's capabilities (CAP_MKNOD included), only the usual devices open.
  set("devices", true, [&] { return b.cgroup->set_devices(os::default_device_rules()); });
  if (auto* d = cg_state.if_contains("devices"); d && !d->as_string().starts_with("not enforced"))
    *d = how + (b.cgroup->v2() ? " device program" : " devices") + ": only " +
         os::describe_device_rules(os::default_device_rules());
  if (!mem_note.empty() && cg_state.contains("memory"))
    cg_state["memory"] = std::string(cg_state["memory"].as_string()) + mem_note;
  if (!pids_note.empty() && cg_state.contains("pids"))
    cg_state["pids"] = std::string(cg_state["pids"].as_string()) + pids_note;
  effective_memory_ = memory;
  effective_pids_ = pids;
  auto fds = b.cgroup->open_join_fds();
  if (!fds) throw std::runtime_error("open the cgroup of branch " + b.name + " to join: " + fds.error().message());
  return std::move(*fds);
}

std::vector<os::UniqueFd> Box::prepare_copy_cgroup(Branch& b) {
  auto host = cgroup_host();
  if (host.version == "none") return {};
  try {
    return make_branch_cgroup(host, b, nullptr);
  } catch (const std::exception& e) {
    log()->warn("branch {}: {}; its ceilings are not enforced", b.name, e.what());
    b.cgroup.reset();
    return {};
  }
}

void Box::start_thread_pool_if_pids_shared() {
  // A container's cgroup filesystem is read-only: the agent, the supervisor and its threads share
  // the container's one pids limit. libuv starts its pool at the first uv_queue_work (a journal
  // segment's compression, a checkpoint's copy) and calls abort() when a thread cannot be made
  // (init_threads, src/threadpool.c); as PID 1 the supervisor then dies of the hlt after it. An
  // agent that holds the last pid and then writes 16 MiB did that. With the pool made before the
  // agent runs, a later work item finds its threads there. Restored agents (a resume, an archive,
  // the copies of an idle box) need no call here: the copy of the snapshot's files before each
  // runs on the pool (Checkpointer::restore_copy), which makes it.
  const auto* pids = enforcement_.if_contains("pids");
  if (pids && pids->is_string() && pids->as_string().starts_with("cgroup")) return;
  static uv_work_t nothing;
  if (int rc = uv_queue_work(
          loop_, &nothing, [](uv_work_t*) {}, [](uv_work_t*, int) {});
      rc != 0)
    log()->warn("start the thread pool: {}", uv_strerror(rc));
}

void Box::setup_branch_policy(Branch& b, sandbox::BranchSpec& spec) {
  const profile::Profile& prof = opts_.profile;
  sandbox::check_profile_for_host(prof);
  // isolation.level is the least the host must give: a profile written for a microVM does not
  // silently run in a plain process.
  auto rank = [](const std::string& l) {
    static const char* order[] = {"process", "container", "gvisor", "microvm"};
    for (int i = 0; i < 4; ++i)
      if (l == order[i]) return i;
    return 0;
  };
  if (rank(prof.isolation.level) > rank(caps_.isolation))
    throw profile::ProfileError("isolation.level: the profile needs \"" + prof.isolation.level +
                                "\", this host gives \"" + caps_.isolation + "\"");
  if (auto r = release_earlier_run(); !r) throw std::runtime_error(r.error().message);
  boost::json::object cg_state;
  auto host = cgroup_host();
  bool want_cg =
      prof.resources.memory > 0 || prof.resources.cpus > 0 || prof.resources.pids > 0 || prof.resources.idle_ms > 0;
  if (host.version != "none") {
    cgroup_join_ = make_branch_cgroup(host, b, &cg_state);
    for (auto& fd : cgroup_join_) spec.cgroup_join.push_back(fd.get());
    spec.cgroup_self_join = b.cgroup && !b.cgroup->v2();
    spec.cgroup_view = cgroup_view(b);
    if (b.cgroup && b.cgroup->v2())
      if (auto d = b.cgroup->open_v2_dir()) {
        cgroup_dir_ = std::move(*d);
        spec.cgroup_dir = cgroup_dir_.get();
      }
  } else if (want_cg) {
    log()->warn("no cgroup hierarchy here: memory, cpus and pids of profile {} are not enforced", prof.name);
  }
  for (auto& [k, v] : cg_state)
    if (v.is_string() && v.as_string().starts_with("not enforced"))
      log()->warn("branch {}: {}", b.name, v.as_string().c_str());

  std::string ws = spec.dir + "/workspace";
  if (auto r = os::make_dirs(ws, 0755); !r) throw std::runtime_error("create " + ws + ": " + r.error().message());
  if (auto how = mount_workspace(b, spec.dir); !how && how.error().code == "busy")
    throw std::runtime_error(how.error().message);  // its files are elsewhere: not an empty workspace instead
  else if (!how)
    cg_state["disk"] = "not enforced: " + how.error().message;
  else if (!how->empty())
    cg_state["disk"] = *how;
  spec.new_net = prof.network.mode != profile::NetworkPolicy::Mode::Host;
  enforcement_ = std::move(cg_state);  // completed by start_limits once the branch runs
  start_thread_pool_if_pids_shared();
}

base::Result<void> Box::release_earlier_run() {
  if (!reused_state_ || earlier_run_released_) return {};
  earlier_run_released_ = true;
  release_stale_cgroups();
  return release_stale_mounts();
}

// A killed supervisor removed none of its branches' cgroups: main's was found again by the next
// run (the same box id), but each copy's (sbx-ID-f1, ...) stayed for good, empty or, where the
// journal had frozen it at a full disk, holding its agent. Every group of this box is thawed, its
// processes killed, and removed, before the first branch of this run makes its own.
void Box::release_stale_cgroups() {
  auto host = cgroup_host();
  if (host.version == "none") return;
  // Main's group stays while the box runs, whatever its copies do: where an earlier run ended
  // cleanly (it removed every group) there is none, and the hierarchies are not listed.
  std::string parent = host.version == "v2" ? host.v2_dir : std::string();
  for (auto& c : os::CgroupDir::v1_controllers())
    if (auto it = host.v1_dirs.find(c); parent.empty() && it != host.v1_dirs.end()) parent = it->second;
  struct stat st;
  if (parent.empty() || ::stat((parent + "/sbx-" + id_ + "-main").c_str(), &st) != 0) return;
  os::CgroupDir::release_below(
      host, "sbx-" + id_ + "-", true,
      [](const std::string& name, bool held) {
        if (held) log()->warn("cgroup {} still held processes of an earlier run of this box: killed them", name);
        log()->info("removed cgroup {}, which an earlier run of this box left", name);
      },
      [](const std::string& name, const std::string& why) {
        log()->warn("cgroup {}, which an earlier run of this box left: {}", name, why);
      });
}

// A supervisor that was killed (SIGKILL, the host's OOM killer) left its mounts in the host's
// mount namespace: the branches' tmpfs (their memory held for nothing) and a persistent
// workspace's ext4 image, with what its agent wrote not yet in the image. The next run mounted the
// image again through another loop device: its agent did not find those files, and two ext4
// mounts of one image wrote it independently. Called after release_stale_cgroups has killed what
// an earlier run left in its groups: a plain unmount writes an ext4's data back and frees its loop
// device; a tmpfs still busy is detached; an ext4 still busy is refused (mounting its image
// again would corrupt it).
base::Result<void> Box::release_stale_mounts() {
  auto r = os::release_mounts_under(opts_.state_dir + "/branches", [](const os::MountPoint& m) {
    log()->warn("unmounted {} ({}), which an earlier run of this box left mounted", m.path, m.fstype);
  });
  if (!r)
    return base::fail(r.error().message +
                          " (an earlier run of this box left it mounted; mounting it again would write one "
                          "filesystem through two mounts)",
                      "busy");
  return {};
}

base::Result<std::string> Box::mount_workspace(Branch& b, const std::string& dir) {
  // The workspace: a sized tmpfs when the profile caps the disk (it counts against the memory of
  // the group that writes it), owned by the agent's user, or a persistent profile's ext4 image.
  // Every branch gets it, copies included.
  const profile::Profile& prof = opts_.profile;
  std::string ws = dir + "/workspace";
  const int64_t disk = prof.resources.disk;
  const bool persistent = prof.persistence == "persistent";
  auto done = [&](base::Result<std::string> how) {
    if (!how && how.error().code != "busy") log()->warn("branch {}: disk: {}", b.name, how.error().message);
    if (prof.isolation.uid && b.workspace_mount.empty())
      (void)!::chown(ws.c_str(), *prof.isolation.uid, prof.isolation.gid.value_or(0));
    return how;
  };
  if (disk <= 0) return done(std::string());
  // Files that must outlive the box cannot sit on a tmpfs: the image is attached here, before the
  // dir goes on the tmpfs below, which then hides it (the device holds it open).
  std::string image = dir + "/workspace.ext4";
  LoopDevice loop;
  if (persistent) {
    auto attached = attach_ext4_image(image, disk, prof);
    if (!attached) return done(attached.error());
    loop = std::move(*attached);
  }
  // The branch's /tmp writes go to its overlay's upper and work directories in the branch's dir,
  // which must share one mount: the whole dir, empty so far but for the workspace's mount point
  // (and a persistent profile's image), goes on a tmpfs of the same size, so /tmp is bounded as
  // /workspace is (each by the ceiling). Else they were on the state dir's disk, unbounded.
  std::string data = "size=" + std::to_string(disk) + ",mode=0755";
  std::string tmp = ", /tmp likewise";
  if (::mount("tmpfs", dir.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, data.c_str()) == 0) {
    b.layer_mount = dir;
  } else {
    auto failed = base::sys_fail("mount a tmpfs on the branch's dir " + dir + " (for /tmp)", errno);
    if (!persistent) return done(failed);
    tmp = ", /tmp not bounded: " + failed.message;  // the workspace's files are there all the same
  }
  if (auto r = os::make_dirs(ws, 0755); !r) return done(base::fail("create " + ws + ": " + r.error().message()));
  if (persistent) {
    if (::mount(loop.path.c_str(), ws.c_str(), "ext4", MS_NOSUID | MS_NODEV, nullptr) != 0)
      return done(base::sys_fail("mount " + loop.path + " (" + image + ") on " + ws, errno));
    b.workspace_mount = ws;
    return done("loop-mounted ext4 image " + image + tmp);
  }
  if (prof.isolation.uid)
    data += ",uid=" + std::to_string(*prof.isolation.uid) + ",gid=" + std::to_string(prof.isolation.gid.value_or(0));
  if (::mount("tmpfs", ws.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, data.c_str()) != 0)
    return done(base::sys_fail("mount a tmpfs on the workspace", errno));
  b.workspace_mount = ws;
  return done("sized tmpfs (" + std::to_string(disk) + " bytes)" + tmp);
}

void Box::start_limits(Branch& b) {
  const profile::Profile& prof = opts_.profile;
  auto cg = std::move(enforcement_);
  enforcement_ = sandbox::describe_enforcement(prof, cg, caps_.landlock_abi, b.launched.namespaced);
  if (prof.network.mode == profile::NetworkPolicy::Mode::None)
    enforcement_["network"] =
        b.launched.namespaced ? "none: a network namespace of its own (loopback only)" : "not enforced: no namespaces";
  else if (prof.network.mode == profile::NetworkPolicy::Mode::Proxy)
    enforcement_["network"] = "proxy: a network namespace of its own, the broker its only way out";
  else
    enforcement_["network"] = "host: not restricted";
  start_watcher(b);
}

void Box::start_watcher(Branch& b) {
  const profile::Profile& prof = opts_.profile;
  LimitsWatcher::Callbacks cb;
  Branch* bp = &b;
  cb.emit = [this, bp](boost::json::object e) {
    e["proc"] = bp->main_proc;
    emit(bp->name, std::move(e));
  };
  cb.end_tree = [this, bp](const std::string& reason, bool now) {
    // on_idle: the main agent hibernates (a checkpoint ends it) instead (box-persist.cpp).
    if (reason == "idle" && bp->name == "main" && hibernate()) return;
    log()->warn("branch {}: {}: ending its tree", bp->name, reason);
    if (now)
      send_request(*bp, {{"op", "kill"}});
    else
      send_request(*bp, {{"op", "shutdown"}, {"grace_ms", opts_.profile.resources.grace_ms}});
  };
  // The watcher compares against the ceilings actually set (a cap below the box's included).
  profile::Profile::Resources r = prof.resources;
  if (effective_memory_ > 0) r.memory = effective_memory_;
  if (effective_pids_ > 0) r.pids = effective_pids_;
  b.limits = std::make_unique<LimitsWatcher>(loop_, b.cgroup.get(), r, std::move(cb));
  b.limits->start();
}

std::string Box::limit_reason(const Proc& p, const std::string& fallback) const {
  auto it = branches_.find(p.branch);
  if (it == branches_.end()) return fallback;
  const Branch& b = *it->second;
  if (p.id != b.main_proc || !b.limits) return fallback;
  if (!b.limits->ended_for().empty()) return b.limits->ended_for();
  // The OOM event and the exit race on the loop: read the counter now.
  b.limits->check_oom();
  if (b.limits->oom_killed() && WIFSIGNALED(p.status) && WTERMSIG(p.status) == SIGKILL) return "oom";
  return fallback;
}

void Box::note_output(const std::string& branch) {
  auto it = branches_.find(branch);
  if (it != branches_.end() && it->second->limits) it->second->limits->on_output();
}

void Branch::release_mounts() {
  for (auto* m : {&workspace_mount, &layer_mount}) {
    if (!m->empty() && ::umount2(m->c_str(), MNT_DETACH) != 0) log()->warn("unmount {}: {}", *m, std::strerror(errno));
    m->clear();
  }
}

void Box::teardown_policy() {
  for (auto& [n, b] : branches_) {
    b->limits.reset();
    b->cgroup.reset();  // kills what is left and removes the group
    b->release_mounts();
  }
  cgroup_join_.clear();
  cgroup_dir_.reset();
}

void Box::stop_for_journal(bool stop) {
  if (stop && shutting_down_) return;  // a box going down lets its agent end; what it writes waits
  if (stop == stopped_for_journal_) return;
  stopped_for_journal_ = stop;
  for (auto& [name, b] : branches_) {
    // Frozen for the journal: its clocks stand still (it is not ended for time it could not run).
    if (b->limits) stop ? b->limits->pause() : b->limits->resume();
    if (!stop && b->output_paused) {  // it was not frozen: its output is read again
      pause_output(*b, false);
      continue;
    }
    std::string failed = "it has no cgroup";
    if (b->cgroup) {
      auto r = b->cgroup->freeze(stop);
      failed = r ? "" : r.error().message();
    }
    if (!stop) {
      if (!failed.empty() && b->cgroup) log()->error("thaw branch {} for the journal: {}", name, failed);
      continue;
    }
    // Where it cannot be frozen (a container's read-only cgroup filesystem), its output is not
    // read meanwhile: its processes block in their next write once their pipes are full, and the
    // events waiting in memory stay bounded.
    if (failed.empty()) continue;
    log()->warn("freeze branch {} for the journal: {}; its output is not read until the journal is written", name,
                failed);
    pause_output(*b, true);
  }
}

void Box::pause_output(Branch& b, bool on) {
  b.output_paused = on;
  watch_channel(b, !on);  // the agent's own events (`event` on its channel) wait too
  for (auto& [id, p] : procs_)
    if (p->branch == b.name) pause_readers(*p, on);
}

void Box::pause_readers(Proc& p, bool on) {
  for (auto* r : {p.out.get(), p.err.get()})
    if (r) r->pause(on);
}

}  // namespace sbx::supervisor
