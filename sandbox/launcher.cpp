#include "sandbox/launcher.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include "os/child-error.hpp"
#include "os/signal-mask.hpp"
#include "os/sys.hpp"
#include "sandbox/policy.hpp"

#ifndef MOUNT_ATTR_RDONLY
#include <linux/mount.h>
#endif
#include <linux/sched.h>  // struct clone_args, CLONE_INTO_CGROUP (glibc has no clone3 wrapper)

namespace sbx::sandbox {

namespace {

auto log() {
  static auto l = spdlog::default_logger()->clone("launcher");
  return l;
}

// One step of the mount plan. The plan is built in the parent; the cloned child only walks it
// with plain syscalls (no allocation, no logging), and reports the failing step's index and errno.
struct MountOp {
  enum Kind {
    PrivateRoot,
    CloneTree,
    SetAttr,
    Mount,
    MkDir,
    Touch,
    Symlink,
    Move,
    Mask,
    ReadOnly,
    Pivot,
    RemountRootRO,
    Detach
  };
  Kind kind;
  std::string a, b, fstype, data;  // meaning depends on kind (see run_plan)
  unsigned long flags = 0;         // Mount: MS_*; SetAttr: MOUNT_ATTR_*; MkDir: the mode
  int slot = -1;                   // CloneTree/SetAttr/Move: which detached tree
  bool recursive = false;
  bool optional = false;  // a missing source skips the step
  bool or_else = false;   // run only if the previous step failed (its failure is then forgiven)
  std::string what;       // for the error message
};

// Read-only trees of the host (and the supervisor's binary): no setuid bit or device node in
// them counts inside the box. Writable mounts: nosuid,nodev.
constexpr uint64_t kReadOnlyAttrs = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
constexpr uint64_t kWritableAttrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;

struct Plan {
  std::vector<MountOp> ops;
  std::vector<int> slots;  // detached trees (open_tree fds), sized before the clone
  std::string new_root;
};

// A fresh /proc and a minimal /dev: the devices in `devs` (name, slot of its clone), devpts, shm.
// /dev is nodev: its devices are binds of the host's nodes, each a mount of its own, so a node the
// agent makes there opens nothing.
void add_proc_and_dev(Plan& p, const std::vector<std::pair<std::string, int>>& devs) {
  const std::string& r = p.new_root;
  auto add = [&](MountOp op) { p.ops.push_back(std::move(op)); };
  add({.kind = MountOp::MkDir, .a = r + "/proc", .flags = 0555, .what = "mkdir /proc"});
  add({.kind = MountOp::Mount,
       .a = "proc",
       .b = r + "/proc",
       .fstype = "proc",
       .flags = MS_NOSUID | MS_NODEV | MS_NOEXEC,
       .what = "mount /proc"});
  add({.kind = MountOp::MkDir, .a = r + "/dev", .flags = 0755, .what = "mkdir /dev"});
  add({.kind = MountOp::Mount,
       .a = "tmpfs",
       .b = r + "/dev",
       .fstype = "tmpfs",
       .data = "mode=0755,size=64k",
       .flags = MS_NOSUID | MS_NODEV | MS_NOEXEC,
       .what = "mount /dev"});
  for (auto& [d, s] : devs) {
    add({.kind = MountOp::Touch, .a = r + "/dev/" + d, .what = "create /dev/" + d});
    add({.kind = MountOp::Move, .a = r + "/dev/" + d, .slot = s, .optional = true, .what = "attach /dev/" + d});
  }
  add({.kind = MountOp::MkDir, .a = r + "/dev/pts", .flags = 0755, .what = "mkdir /dev/pts"});
  add({.kind = MountOp::Mount,
       .a = "devpts",
       .b = r + "/dev/pts",
       .fstype = "devpts",
       .data = "newinstance,ptmxmode=0666,mode=0620",
       .flags = MS_NOSUID | MS_NOEXEC,
       .what = "mount /dev/pts"});
  add({.kind = MountOp::Symlink, .a = "pts/ptmx", .b = r + "/dev/ptmx", .what = "symlink /dev/ptmx"});
  add({.kind = MountOp::MkDir, .a = r + "/dev/shm", .flags = 01777, .what = "mkdir /dev/shm"});
  add({.kind = MountOp::Mount,
       .a = "tmpfs",
       .b = r + "/dev/shm",
       .fstype = "tmpfs",
       .data = "mode=1777",
       .flags = MS_NOSUID | MS_NODEV,
       .what = "mount /dev/shm"});
  add({.kind = MountOp::Symlink, .a = "/proc/self/fd", .b = r + "/dev/fd", .what = "symlink /dev/fd"});
  add({.kind = MountOp::Symlink, .a = "/proc/self/fd/0", .b = r + "/dev/stdin", .what = "symlink /dev/stdin"});
  add({.kind = MountOp::Symlink, .a = "/proc/self/fd/1", .b = r + "/dev/stdout", .what = "symlink /dev/stdout"});
  add({.kind = MountOp::Symlink, .a = "/proc/self/fd/2", .b = r + "/dev/stderr", .what = "symlink /dev/stderr"});
}

// What runc (and so Docker) keeps from a container, after the state dir and credential masks:
// the kernel's settings and triggers read-only, its memory, key and timer lists and firmware
// tables masked (an empty read-only tmpfs over a directory, /dev/null over a file). A path this
// kernel lacks is skipped.
void add_kernel_masks(Plan& p) {
  const std::string& r = p.new_root;
  for (auto* path : kKernelReadOnlyPaths)
    p.ops.push_back({.kind = MountOp::ReadOnly,
                     .a = r + path,
                     .optional = true,
                     .what = std::string("make ") + path + " read-only"});
  for (auto* path : kKernelMaskedPaths) {
    struct stat st {};
    if (::stat(path, &st) != 0) continue;
    p.ops.push_back({.kind = MountOp::Mask,
                     .a = r + path,
                     .recursive = S_ISDIR(st.st_mode),
                     .optional = true,
                     .what = std::string("mask ") + path});
  }
}

struct TopEntry {
  std::string name;
  bool dir;
  std::string link;
};

// Where each cloned tree waits (its slot) until it is attached in the new root; -1: none.
struct Clones {
  std::vector<std::pair<std::string, int>> trees;    // target inside the root, slot
  std::vector<std::pair<std::string, int>> devs;     // /dev entry, slot
  std::vector<std::pair<std::string, int>> cgroups;  // name under /sys/fs/cgroup, slot
  int cgroup_tree = -1;                              // the host's /sys/fs/cgroup, where no group is the branch's
  int tmp = -1, exe = -1, resolv = -1, lib = -1, mid = -1;
  int count = 0;
};

// The host's top-level directories (bound read-only) and symlinks (made again) that a plain
// host's branch root shows: not the ones the branch gets of its own.
std::vector<TopEntry> host_top_entries() {
  static const char* kSkip[] = {"lost+found", "boot", "media", "mnt"};
  std::vector<TopEntry> entries;
  if (DIR* d = ::opendir("/")) {
    while (auto* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n == "." || n == ".." || n.starts_with(".")) continue;
      bool skip = std::find(std::begin(kOwnTopDirs), std::end(kOwnTopDirs), n) != std::end(kOwnTopDirs);
      for (auto* s : kSkip) skip |= n == s;
      if (skip) continue;
      struct stat st {};
      std::string path = "/" + n;
      if (::lstat(path.c_str(), &st) != 0) continue;
      if (S_ISLNK(st.st_mode)) {
        char buf[4096];
        ssize_t len = ::readlink(path.c_str(), buf, sizeof buf - 1);
        if (len > 0) entries.push_back({n, false, std::string(buf, static_cast<size_t>(len))});
      } else if (S_ISDIR(st.st_mode)) {
        entries.push_back({n, true, {}});
      }
    }
    ::closedir(d);
  }

  return entries;
}

// The first half of the plan: every tree the root will show is cloned into a slot (a detached
// mount) while the host's paths are still reachable.
Clones clone_trees(Plan& p, const BranchSpec& spec, const std::vector<TopEntry>& entries, const std::string& exe) {
  Clones c;
  auto add = [&](MountOp op) { p.ops.push_back(std::move(op)); };
  // Clone every tree first.
  int slot = 0;
  auto& trees = c.trees;  // target inside root, slot
  for (auto& e : entries) {
    if (!e.dir) continue;
    add({.kind = MountOp::CloneTree, .a = "/" + e.name, .slot = slot, .recursive = true, .what = "clone /" + e.name});
    add({.kind = MountOp::SetAttr,
         .flags = kReadOnlyAttrs,
         .slot = slot,
         .recursive = true,
         .what = "make /" + e.name + " read-only"});
    trees.emplace_back("/" + e.name, slot++);
  }
  // Of the host's /sys only the branch's own cgroups (attach_sys).
  for (auto& [name, dir] : spec.cgroup_view) {
    add({.kind = MountOp::CloneTree, .a = dir, .slot = slot, .what = "clone the branch's cgroup " + dir});
    add({.kind = MountOp::SetAttr,
         .flags = kReadOnlyAttrs | MOUNT_ATTR_NOEXEC,
         .slot = slot,
         .what = "make the branch's cgroup " + dir + " read-only"});
    c.cgroups.emplace_back(name, slot++);
  }
  // A branch without groups of its own (a container whose cgroup filesystem is read-only, or
  // SANDBOXER_CGROUP=none) sees the host's view, as before: in a container, the container's own.
  if (spec.cgroup_view.empty()) {
    c.cgroup_tree = slot++;
    add({.kind = MountOp::CloneTree,
         .a = "/sys/fs/cgroup",
         .slot = c.cgroup_tree,
         .recursive = true,
         .optional = true,
         .what = "clone /sys/fs/cgroup"});
    add({.kind = MountOp::SetAttr,
         .flags = kReadOnlyAttrs | MOUNT_ATTR_NOEXEC,
         .slot = c.cgroup_tree,
         .recursive = true,
         .what = "make /sys/fs/cgroup read-only"});
  }
  static const char* kDevs[] = {"null", "zero", "full", "random", "urandom", "tty"};
  auto& devs = c.devs;
  for (auto* d : kDevs) {
    add({.kind = MountOp::CloneTree,
         .a = std::string("/dev/") + d,
         .slot = slot,
         .optional = true,
         .what = std::string("clone /dev/") + d});
    // The host's own inodes: read-only binds, so root in the box cannot chmod, chown or touch
    // the host's /dev/null (it could, and every user of the host then lost it). A device on a
    // read-only mount is still read and written (only a regular file's data is the mount's).
    add({.kind = MountOp::SetAttr,
         .flags = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC,
         .slot = slot,
         .optional = true,
         .what = std::string("make /dev/") + d + " read-only"});
    devs.emplace_back(d, slot++);
  }
  add({.kind = MountOp::CloneTree, .a = spec.dir + "/workspace", .slot = slot, .what = "clone the workspace"});
  add({.kind = MountOp::SetAttr, .flags = kWritableAttrs, .slot = slot, .what = "make the workspace nosuid,nodev"});
  trees.emplace_back("/workspace", slot++);
  c.tmp = slot++;  // cloned only where the /tmp overlay cannot be had (attach_trees)
  // ns-init's binary, bound at a fixed path: it may live where the branch cannot see
  // (under the host's /tmp, say), and ns-init runs from inside the new root.
  int exe_slot = slot++;
  c.exe = exe_slot;
  add({.kind = MountOp::CloneTree, .a = exe, .slot = exe_slot, .what = "clone " + exe});
  add({.kind = MountOp::SetAttr, .flags = kReadOnlyAttrs, .slot = exe_slot, .what = "make " + exe + " read-only"});
  int& resolv_slot = c.resolv;  // network: the branch's resolv.conf
  if (!spec.resolv_conf.empty()) {
    add({.kind = MountOp::CloneTree, .a = spec.resolv_conf, .slot = slot, .what = "clone the branch's resolv.conf"});
    // A file of the state dir: the agent writes none of those (nor past its disk ceiling).
    add({.kind = MountOp::SetAttr, .flags = kReadOnlyAttrs, .slot = slot, .what = "make resolv.conf read-only"});
    resolv_slot = slot++;
  }
  // A bundle's libraries, found through the $ORIGIN/../lib rpath from kNsInitPath.
  int& lib_slot = c.lib;
  std::string lib_dir = spec.self_exe.substr(0, spec.self_exe.rfind('/') + 1) + "../lib";
  if (struct stat st{}; ::stat(lib_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    lib_slot = slot++;
    add({.kind = MountOp::CloneTree, .a = lib_dir, .slot = lib_slot, .what = "clone " + lib_dir});
    add({.kind = MountOp::SetAttr,
         .flags = kReadOnlyAttrs,
         .slot = lib_slot,
         .what = "make " + lib_dir + " read-only"});
  }
  // The branch's machine id over /etc/machine-id (where the host has one to cover).
  int& mid_slot = c.mid;
  if (struct stat st{}; ::stat("/etc/machine-id", &st) == 0 && S_ISREG(st.st_mode)) {
    mid_slot = slot++;
    add({.kind = MountOp::CloneTree,
         .a = spec.dir + "/" + kMachineIdFile,
         .slot = mid_slot,
         .what = "clone the machine id"});
    add({.kind = MountOp::SetAttr, .flags = kReadOnlyAttrs, .slot = mid_slot, .what = "make the machine id read-only"});
  }
  c.count = slot;
  return c;
}

// A small tmpfs at `at` (mode 0755, nosuid, nodev, noexec) that holds mount points.
MountOp tmpfs_at(const std::string& at, const std::string& size, const std::string& what) {
  return {.kind = MountOp::Mount,
          .a = "tmpfs",
          .b = at,
          .fstype = "tmpfs",
          .data = "mode=0755,size=" + size,
          .flags = MS_NOSUID | MS_NODEV | MS_NOEXEC,
          .what = what};
}

// /sys: a sysfs of the branch's own (its network namespace's interfaces), read-only, and in its
// /sys/fs/cgroup the branch's own groups alone, each where its hierarchy would be (as a
// container's: a runtime reads its limits there), not the host's whole tree.
void attach_sys(Plan& p, const Clones& c) {
  auto add = [&](MountOp op) { p.ops.push_back(std::move(op)); };
  const std::string& r = p.new_root;
  add({.kind = MountOp::MkDir, .a = r + "/sys", .flags = 0755, .what = "mkdir /sys"});
  add({.kind = MountOp::Mount,
       .a = "sysfs",
       .b = r + "/sys",
       .fstype = "sysfs",
       .flags = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
       .what = "mount /sys"});
  std::string cg = r + "/sys/fs/cgroup";
  if (c.cgroup_tree >= 0)
    add({.kind = MountOp::Move, .a = cg, .slot = c.cgroup_tree, .optional = true, .what = "attach /sys/fs/cgroup"});
  if (c.cgroups.empty()) return;
  if (c.cgroups.size() == 1 && c.cgroups[0].first.empty()) {  // v2: the group is the whole of it
    add({.kind = MountOp::Move, .a = cg, .slot = c.cgroups[0].second, .what = "attach the branch's cgroup"});
    return;
  }
  add(tmpfs_at(cg, "4k", "mount /sys/fs/cgroup's tmpfs"));
  for (auto& [name, s] : c.cgroups) {
    add({.kind = MountOp::MkDir, .a = cg + "/" + name, .flags = 0755, .what = "mkdir /sys/fs/cgroup/" + name});
    add({.kind = MountOp::Move, .a = cg + "/" + name, .slot = s, .what = "attach /sys/fs/cgroup/" + name});
  }
  add({.kind = MountOp::Mount,
       .b = cg,
       .flags = MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
       .what = "make /sys/fs/cgroup read-only"});
}

// Filesystems of the kernel's own state. The agent has a /proc, /sys and /dev of its own; one of
// these mounted beneath the host's directories (a chroot's /proc under /var, a build's /sys)
// showed it the host's processes and their command lines, its devices or its tracing, and a
// snapshot carried the mount, so its restore failed once the host had unmounted it. They are
// detached from the agent's view of those directories, as a container sees none of the host's.
constexpr std::string_view kKernelFs[] = {"proc",    "sysfs",    "devpts",    "devtmpfs",    "mqueue",
                                          "cgroup",  "cgroup2",  "debugfs",   "tracefs",     "securityfs",
                                          "pstore",  "bpf",      "nsfs",      "binfmt_misc", "configfs",
                                          "fusectl", "efivarfs", "hugetlbfs", "rpc_pipefs"};

void detach_kernel_mounts(Plan& p, const std::vector<TopEntry>& entries) {
  for (auto& m : os::mounts_under("/")) {
    if (std::find(std::begin(kKernelFs), std::end(kKernelFs), m.fstype) == std::end(kKernelFs)) continue;
    auto slash = m.path.find('/', 1);
    if (slash == std::string::npos) continue;  // a top-level one (/proc, /sys): not cloned
    std::string_view top(m.path.data() + 1, slash - 1);
    if (std::none_of(entries.begin(), entries.end(), [&](const TopEntry& e) { return e.dir && e.name == top; }))
      continue;
    p.ops.push_back(
        {.kind = MountOp::Detach, .a = p.new_root + m.path, .what = "detach " + m.path + " (" + m.fstype + ")"});
  }
}

// The second half: the root is made, the cloned trees attached in it, /tmp, /proc, /dev, /run and
// the masks set up, and the root pivoted into.
void attach_trees(Plan& p, const BranchSpec& spec, const std::vector<TopEntry>& entries, const Clones& c) {
  auto add = [&](MountOp op) { p.ops.push_back(std::move(op)); };
  const auto& trees = c.trees;
  const auto& devs = c.devs;
  int tmp_slot = c.tmp, exe_slot = c.exe, resolv_slot = c.resolv, lib_slot = c.lib, mid_slot = c.mid;
  const std::string& r = p.new_root;
  // The root is a small tmpfs over the branch's root/ (pivot_root needs a mount point): its
  // mount points and symlinks cost no inodes of the host's disk (~20 a start, each 30-130 us on a
  // journal-less ext4 that has just deleted files). criu does not dump the contents of a mount
  // namespace's root, so a checkpoint writes them into the snapshot's root/ (copy_root_top), and a
  // restored copy gets that directory as its --root.
  add(tmpfs_at(r, "64k", "mount the root's tmpfs"));
  for (auto& e : entries)
    if (!e.dir) add({.kind = MountOp::Symlink, .a = e.link, .b = r + "/" + e.name, .what = "symlink /" + e.name});
  for (auto& [target, s] : trees) {
    add({.kind = MountOp::MkDir, .a = r + target, .flags = 0755, .what = "mkdir " + target});
    add({.kind = MountOp::Move, .a = r + target, .slot = s, .what = "attach " + target});
  }
  detach_kernel_mounts(p, entries);
  attach_sys(p, c);
  if (resolv_slot >= 0)
    add({.kind = MountOp::Move,
         .a = r + "/etc/resolv.conf",
         .slot = resolv_slot,
         .optional = true,
         .what = "attach /etc/resolv.conf"});
  if (mid_slot >= 0)
    add({.kind = MountOp::Move,
         .a = r + "/etc/machine-id",
         .slot = mid_slot,
         .optional = true,
         .what = "attach /etc/machine-id"});
  // /tmp: the host's /tmp seen through an overlay whose writes stay the branch's own, so a
  // command under the host's /tmp still runs; where overlay cannot be had (an upper directory on
  // an overlay filesystem, as in a container), a private /tmp of the branch's own.
  add({.kind = MountOp::MkDir, .a = r + "/tmp", .flags = 01777, .what = "mkdir /tmp"});
  // `volatile` (Linux 5.10): the branch's end does not sync the host's disk (clear_volatile_mark);
  // a kernel without it mounts the overlay plain.
  std::string ovl = "lowerdir=/tmp,upperdir=" + spec.dir + "/tmp-upper,workdir=" + spec.dir + "/tmp-work";
  for (bool vol : {true, false})
    add({.kind = MountOp::Mount,
         .a = "overlay",
         .b = r + "/tmp",
         .fstype = "overlay",
         .data = ovl + (vol ? ",volatile" : ""),
         .flags = MS_NOSUID | MS_NODEV,
         .or_else = !vol,
         .what = "mount the /tmp overlay"});
  // Else the branch's own directory. Cloned here and not with the other trees: a detached tree
  // left unused is unmounted when its fd closes, which waits for an RCU grace period (0.1 ms,
  // in the child's close_range before its exec). Its SetAttr and Move do nothing unless it was.
  add({.kind = MountOp::CloneTree,
       .a = spec.dir + "/tmp",
       .slot = tmp_slot,
       .or_else = true,
       .what = "clone the branch's /tmp"});
  add({.kind = MountOp::SetAttr,
       .flags = kWritableAttrs,
       .slot = tmp_slot,
       .what = "make the branch's /tmp nosuid,nodev"});
  add({.kind = MountOp::Move, .a = r + "/tmp", .slot = tmp_slot, .optional = true, .what = "attach /tmp"});
  add_proc_and_dev(p, devs);
  // /run is the branch's own directory, not a tmpfs: it is part of the writable layer, so
  // /run/sandboxer/branch.json can be written into each restored copy before its restore.
  add({.kind = MountOp::MkDir, .a = r + "/run", .flags = 0755, .what = "mkdir /run"});
  add({.kind = MountOp::Mount, .a = spec.dir + "/run", .b = r + "/run", .flags = MS_BIND, .what = "bind /run"});
  // A bind takes its flags from a remount only.
  add({.kind = MountOp::Mount,
       .b = r + "/run",
       .flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV,
       .what = "make /run nosuid,nodev"});
  add({.kind = MountOp::MkDir, .a = r + "/run/sandboxer", .flags = 0755, .what = "mkdir /run/sandboxer"});
  add({.kind = MountOp::MkDir, .a = r + "/run/sandboxer/bin", .flags = 0755, .what = "mkdir /run/sandboxer/bin"});
  if (lib_slot >= 0) {
    add({.kind = MountOp::MkDir, .a = r + kNsInitLibDir, .flags = 0755, .what = std::string("mkdir ") + kNsInitLibDir});
    add({.kind = MountOp::Move,
         .a = r + kNsInitLibDir,
         .slot = lib_slot,
         .what = std::string("attach ") + kNsInitLibDir});
  }
  add({.kind = MountOp::Touch, .a = r + kNsInitPath, .what = std::string("create ") + kNsInitPath});
  add({.kind = MountOp::Move, .a = r + kNsInitPath, .slot = exe_slot, .what = std::string("attach ") + kNsInitPath});
  // Masked where it is: a path through a symlink (a state dir, a token file's directory or a
  // HOME that is one) would be resolved, under the new root, from the host's root, and the
  // mask would land outside the branch's view, leaving the file readable at its real path
  // (or, for the state dir, over the new root itself).
  for (const auto& [path, st] : outermost_masks(spec.masks)) {
    add({.kind = MountOp::Mask,
         .a = r + path,
         .recursive = S_ISDIR(st.st_mode),
         .optional = true,
         .what = "mask " + path});
  }
  add_kernel_masks(p);
  add({.kind = MountOp::Pivot, .a = r, .what = "pivot_root"});
  add({.kind = MountOp::RemountRootRO, .what = "make / read-only"});
}

}  // namespace

std::vector<std::pair<std::string, struct stat>> outermost_masks(const std::vector<std::string>& masks) {
  std::vector<std::pair<std::string, struct stat>> all;
  for (auto& m : masks)
    if (auto real = os::real_path(m)) all.push_back(std::move(*real));
  auto beneath = [](const std::string& path, const std::string& dir) {
    return dir == "/" || (path.size() > dir.size() && path.starts_with(dir) && path[dir.size()] == '/');
  };
  std::vector<std::pair<std::string, struct stat>> out;
  for (auto& m : all) {
    bool hidden = std::any_of(all.begin(), all.end(), [&](const auto& d) {
      return S_ISDIR(d.second.st_mode) && d.first != m.first && beneath(m.first, d.first);
    });
    bool again = std::any_of(out.begin(), out.end(), [&](const auto& o) { return o.first == m.first; });
    if (!hidden && !again) out.push_back(m);
  }
  return out;
}

namespace {

// Builds the branch's root for a plain host: a tmpfs with the host's top-level directories bound
// read-only (cloned before the tmpfs exists, so no copy contains the new root itself), a fresh
// /proc, a minimal /dev, and /workspace and /tmp of the branch's own.
// `exe`: ns-init's program (ns_init_binary), bound at kNsInitPath.
Plan make_plan(const BranchSpec& spec, const std::string& exe) {
  Plan p;
  p.new_root = spec.dir + "/root";
  p.ops.push_back({.kind = MountOp::PrivateRoot, .what = "make / private"});
  auto entries = host_top_entries();
  Clones c = clone_trees(p, spec, entries, exe);
  p.slots.assign(static_cast<size_t>(c.count), -1);
  attach_trees(p, spec, entries, c);
  return p;
}

// What the child reports as its step (os::child_fail): an operation of the mount plan (its
// index, from 0), or one of these.
enum : int { kStepExec = -2, kStepJoinCgroup = -3, kStepNetns = -4 };

// Runs in the cloned child: async-signal-safe syscalls only. Returns the failing op or -1.
int run_plan(Plan& p, int* err) noexcept {
  bool prev_failed = false;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    MountOp& op = p.ops[i];
    if (op.or_else && !prev_failed) continue;
    prev_failed = false;
    int rc = 0;
    switch (op.kind) {
      case MountOp::PrivateRoot:
        rc = ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr);
        break;
      case MountOp::CloneTree: {
        int fd = static_cast<int>(::syscall(SYS_open_tree, AT_FDCWD, op.a.c_str(),
                                            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | (op.recursive ? AT_RECURSIVE : 0)));
        if (fd < 0 && op.optional && errno == ENOENT) break;
        if (fd < 0) rc = -1;
        p.slots[static_cast<size_t>(op.slot)] = fd;
        break;
      }
      case MountOp::SetAttr: {
        int fd = p.slots[static_cast<size_t>(op.slot)];
        if (fd < 0) break;
        struct mount_attr attr {};
        attr.attr_set = op.flags;
        rc = static_cast<int>(::syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH | (op.recursive ? AT_RECURSIVE : 0),
                                        &attr, sizeof attr));
        break;
      }
      case MountOp::Mount:
        rc = ::mount(op.a.empty() ? nullptr : op.a.c_str(), op.b.c_str(),
                     op.fstype.empty() ? nullptr : op.fstype.c_str(), op.flags,
                     op.data.empty() ? nullptr : op.data.c_str());
        break;
      case MountOp::MkDir:
        rc = ::mkdir(op.a.c_str(), static_cast<mode_t>(op.flags));
        if (rc != 0 && errno == EEXIST) rc = 0;
        break;
      case MountOp::Touch: {
        int fd = ::open(op.a.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
        if (fd < 0)
          rc = -1;
        else
          ::close(fd);
        break;
      }
      case MountOp::Symlink:
        rc = ::symlink(op.a.c_str(), op.b.c_str());
        if (rc != 0 && errno == EEXIST) rc = 0;  // the root directory of an earlier start
        break;
      case MountOp::Move: {
        int fd = p.slots[static_cast<size_t>(op.slot)];
        if (fd < 0 && op.optional) break;
        rc = static_cast<int>(::syscall(SYS_move_mount, fd, "", AT_FDCWD, op.a.c_str(), MOVE_MOUNT_F_EMPTY_PATH));
        break;
      }
      case MountOp::Mask: {
        struct stat st {};
        if (::lstat(op.a.c_str(), &st) != 0) break;  // not in the agent's view at all
        if (op.recursive) {
          rc = ::mount("tmpfs", op.a.c_str(), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                       "size=4k,mode=0000");
        } else {
          // Not nodev: the bind is /dev/null itself, and reads as empty.
          rc = ::mount("/dev/null", op.a.c_str(), nullptr, MS_BIND, nullptr);
          if (rc == 0)
            rc = ::mount(nullptr, op.a.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC,
                         nullptr);
        }
        break;
      }
      case MountOp::ReadOnly: {
        struct stat st {};
        if (::lstat(op.a.c_str(), &st) != 0) break;  // not on this kernel
        rc = ::mount(op.a.c_str(), op.a.c_str(), nullptr, MS_BIND | MS_REC, nullptr);
        if (rc == 0)
          rc = ::mount(nullptr, op.a.c_str(), nullptr,
                       MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr);
        break;
      }
      case MountOp::Pivot:
        // pivot_root(".", ".") stacks the old root on the new one; detaching it leaves the new.
        rc = ::chdir(op.a.c_str());
        if (rc == 0) rc = static_cast<int>(::syscall(SYS_pivot_root, ".", "."));
        if (rc == 0) rc = ::umount2(".", MNT_DETACH);
        if (rc == 0) rc = ::chdir("/");
        break;
      case MountOp::Detach:
        // Gone already: detached with one above it.
        rc = ::umount2(op.a.c_str(), MNT_DETACH | UMOUNT_NOFOLLOW);
        if (rc != 0 && (errno == EINVAL || errno == ENOENT)) rc = 0;
        break;
      case MountOp::RemountRootRO:
        // noexec too: the root holds only mount points and symlinks (the programs are on the
        // mounts below it, each with its own flags).
        rc = ::mount(nullptr, "/", nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                     nullptr);
        break;
    }
    if (rc != 0) {
      if (op.optional && errno == ENOENT) continue;
      if (i + 1 < p.ops.size() && p.ops[i + 1].or_else) {
        prev_failed = true;
        continue;
      }
      *err = errno;
      return static_cast<int>(i);
    }
  }
  return -1;
}

struct ChildArgs {
  Plan* plan;  // null: flat mode
  int netns;   // the branch's network namespace to enter (BranchPipes::netns), or -1
  const char* exe;
  char* const* argv;
  char* const* envp;
  int fds[7];                         // sources for 3..9
  int err_pipe;                       // write end, reported to on failure
  int pid_fd;                         // source for kNsAgentPid, or -1
  const std::vector<int>* self_join;  // v1 `tasks` fds the child writes "0" to first, or null
};

// Moves `fds` onto 3..9 even when sources and targets overlap, then closes everything else.
void place_fds(ChildArgs& a) noexcept {
  int high[7];
  for (int i = 0; i < 7; ++i) high[i] = ::fcntl(a.fds[i], F_DUPFD_CLOEXEC, 100);
  int ep = ::fcntl(a.err_pipe, F_DUPFD_CLOEXEC, 100);
  int pf = a.pid_fd >= 0 ? ::fcntl(a.pid_fd, F_DUPFD_CLOEXEC, 100) : -1;
  for (int i = 0; i < 7; ++i) ::dup2(high[i], 3 + i);
  ::dup3(ep, 10, O_CLOEXEC);
  a.err_pipe = 10;
  if (pf >= 0) ::dup2(pf, kNsAgentPid);
  ::close_range(kNsAgentPid + (pf >= 0 ? 1 : 0), ~0U, 0);
}

[[noreturn]] SBX_OWN_STACK void child_main(ChildArgs& a) noexcept {
  os::reset_signals_for_child();
  // Into the branch's cgroups first, as the one thread this process has (v1); or the parent moves
  // us meanwhile (join_cgroups, v2).
  if (a.self_join)
    for (int fd : *a.self_join)
      if (::write(fd, "0", 1) != 1) os::child_fail(a.err_pipe, kStepJoinCgroup, errno);
  // Before the plan: /sys is mounted for the namespace of its mounter.
  if (a.netns >= 0 && a.plan && ::setns(a.netns, CLONE_NEWNET) != 0) os::child_fail(a.err_pipe, kStepNetns, errno);
  if (a.plan) {
    int err = 0;
    if (int op = run_plan(*a.plan, &err); op >= 0) os::child_fail(a.err_pipe, op, err);
  }
  ::setsid();
  place_fds(a);
  ::execve(a.exe, a.argv, a.envp);
  os::child_fail(a.err_pipe, kStepExec, errno);
}

}  // namespace

std::array<int, 7> BranchPipes::child_ends() const {
  return {req.read.get(),  rep.write.get(),      in.read.get(),      out.write.get(),
          err.write.get(), chan_req.write.get(), chan_rep.read.get()};
}

std::array<uint64_t, 7> BranchPipes::inodes() const {
  std::array<uint64_t, 7> out{};
  auto ends = child_ends();
  for (size_t i = 0; i < ends.size(); ++i) {
    struct stat st {};
    if (::fstat(ends[i], &st) == 0) out[i] = st.st_ino;
  }
  return out;
}

namespace {

// The reports: a socket, so that ns-init can hand over an exec'd process's fds (SCM_RIGHTS).
os::Result<void> make_reports(os::Pipe& rep) {
  int rp[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, rp) != 0) return os::last_error();
  rep.read = os::UniqueFd(rp[0]);
  rep.write = os::UniqueFd(rp[1]);
  return {};
}

// A network namespace of a branch's own, made by a thread of ours that enters it alone (the
// supervisor stays where it is): its loopback up, and the reports socket made inside it. The
// thread starts at construction, so that a branch's start does its other work meanwhile.
class NetnsMaker {
 public:
  NetnsMaker() : thread_([this] { make(); }) {}
  ~NetnsMaker() {
    if (thread_.joinable()) thread_.join();
  }
  NetnsMaker(const NetnsMaker&) = delete;
  NetnsMaker& operator=(const NetnsMaker&) = delete;

  /// Waits for the thread; gives `p` the namespace and the reports socket made in it.
  os::Result<void> take(BranchPipes& p) {
    thread_.join();
    if (!out_) return out_;
    p.netns = std::move(netns_);
    p.rep = std::move(rep_);
    return {};
  }

 private:
  void make() {
    if (::unshare(CLONE_NEWNET) != 0) {
      out_ = os::last_error();
      return;
    }
    netns_.reset(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    if (!netns_) {
      out_ = os::last_error();
      return;
    }
    if (int e = bring_up_loopback(); e != 0) {
      out_ = os::sys_error(e);
      return;
    }
    out_ = make_reports(rep_);
  }

  os::Result<void> out_;
  os::UniqueFd netns_;
  os::Pipe rep_;
  std::thread thread_;  // last: it starts once the members it writes are made
};

// The pipes, the reports socket made in `netns` when given (else here).
os::Result<BranchPipes> make_pipes(NetnsMaker* netns) {
  BranchPipes p;
  for (os::Pipe* x : {&p.req, &p.in, &p.out, &p.err, &p.chan_req, &p.chan_rep}) {
    auto r = os::make_pipe();
    if (!r) return r.error();
    *x = std::move(*r);
  }
  if (auto r = netns ? netns->take(p) : make_reports(p.rep); !r) return r.error();
  // SO_PASSCRED before anything is written: the kernel then attaches the writer's credentials.
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sv) != 0) return os::last_error();
  p.pid_read = os::UniqueFd(sv[0]);
  p.pid_write = os::UniqueFd(sv[1]);
  int one = 1;
  if (::setsockopt(sv[0], SOL_SOCKET, SO_PASSCRED, &one, sizeof one) != 0) return os::last_error();
  return p;
}

}  // namespace

os::Result<BranchPipes> make_branch_pipes(bool own_netns) {
  if (!own_netns) return make_pipes(nullptr);
  NetnsMaker netns;
  return make_pipes(&netns);
}

pid_t LaunchedBranch::take_agent_pid() {
  if (!agent_pid) return -1;
  char byte;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(ucred))];
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  ssize_t n = ::recvmsg(agent_pid.get(), &m, MSG_DONTWAIT);
  agent_pid.reset();
  if (n != 1) return -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_CREDENTIALS) continue;
    ucred cr;
    std::memcpy(&cr, CMSG_DATA(c), sizeof cr);
    return cr.pid > 0 ? cr.pid : -1;
  }
  return -1;
}

void LaunchedBranch::take(BranchPipes& p) {
  pipe_inodes = p.inodes();
  requests = std::move(p.req.write);
  reports = std::move(p.rep.read);
  in = std::move(p.in.write);
  out = std::move(p.out.read);
  err = std::move(p.err.read);
  chan_req = std::move(p.chan_req.read);
  chan_rep = std::move(p.chan_rep.write);
  agent_pid = std::move(p.pid_read);
  netns = std::move(p.netns);
  p.pid_write.reset();
  (void)os::set_nonblocking(reports.get());
  (void)os::set_nonblocking(out.get());
  (void)os::set_nonblocking(err.get());
  (void)os::set_nonblocking(chan_req.get());
}

base::Result<void> make_branches_dir(const std::string& state_dir) {
  std::string dir = state_dir + "/branches";
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return base::sys_fail("stat " + dir, errno);
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return base::sys_fail("create " + dir, errno);
    if (::lstat(dir.c_str(), &st) != 0) return base::sys_fail("stat " + dir, errno);
  }
  if (S_ISLNK(st.st_mode)) return base::sys_fail(dir + ": a symlink, refused", ELOOP);
  if (!S_ISDIR(st.st_mode))
    return base::sys_fail(dir + ": " + os::file_type_name(st.st_mode) + ", not a directory", ENOTDIR);
  return {};
}

void ensure_machine_id(const std::string& dir) {
  auto d = os::open_dir(dir);
  struct stat st {};
  if (!d || ::fstatat(d->get(), kMachineIdFile, &st, AT_SYMLINK_NOFOLLOW) == 0) return;
  (void)os::write_file_atomic_at(d->get(), kMachineIdFile, os::random_hex(16) + "\n", 0444);
}

namespace {
// The /tmp overlay is mounted `volatile`: its unmount, at the branch's end, does not sync the
// filesystem of its upper directory. Without it the kernel runs syncfs on that whole filesystem
// (the state dir's, the host's own disk) and the branch's end waits for everything any process
// left dirty there: `-- /bin/true` took 93 ms instead of 12 (medians of 8) while another process
// had 200 MB not yet written on that filesystem. What the agent writes to /tmp is written back
// by the kernel as any file is; a host crash can lose its last seconds. A volatile mount leaves
// work/incompat/volatile in its workdir, and overlayfs refuses the workdir while it is there
// (Documentation/filesystems/overlayfs.rst, "Volatile mount"). It is removed (with the `dirty`
// file the kernel puts in it) before the next mount of the same branch dir: the upper directory
// is what the ended branch left, which is what /tmp is after a crash on any host. Missing is no
// error.
os::Result<void> clear_volatile_mark(int top) {
  auto incompat = os::open_beneath(top, "tmp-work/work/incompat", O_RDONLY | O_DIRECTORY);
  if (!incompat)
    return incompat.error() == std::errc::no_such_file_or_directory ? os::Result<void>{} : incompat.error();
  if (auto mark = os::open_beneath(incompat->get(), "volatile", O_RDONLY | O_DIRECTORY); mark)
    if (::unlinkat(mark->get(), "dirty", 0) != 0 && errno != ENOENT) return os::last_error();
  if (::unlinkat(incompat->get(), "volatile", AT_REMOVEDIR) != 0 && errno != ENOENT) return os::last_error();
  return {};
}

// The dir of the branches' dirs (state/branches) holds what agents wrote, set-id bits and all:
// the box mounts it nosuid, the host's disk does not. No other user of the host may enter it (a
// state dir made 0755 by hand once let any local user run a setuid-root shell an agent left in
// its workspace). Without namespaces the agent's own user, which may not be ours, goes through
// it to its workspace on the host's path: searchable then, never listed.
os::Result<void> narrow_branches_dir(const BranchSpec& spec) {
  auto slash = spec.dir.rfind('/');
  if (slash == std::string::npos || slash == 0) return {};
  std::string dir = spec.dir.substr(0, slash);
  mode_t mode = spec.want_namespaces ? 0700 : 0711;
  if (auto r = os::make_dirs(dir, mode); !r) return r.error();
  auto fd = os::open_dir(dir);  // never through a symlink planted there (a shared state dir)
  struct stat st {};
  if (!fd) return ::lstat(dir.c_str(), &st) == 0 && S_ISLNK(st.st_mode) ? os::sys_error(ELOOP) : fd.error();
  if (::fstat(fd->get(), &st) != 0) return os::last_error();
  if ((st.st_mode & 07777) != mode && st.st_uid == ::geteuid() && ::fchmod(fd->get(), mode) != 0)
    return os::last_error();
  return {};
}

// The branch's writable layer, made (or checked) from the branch's dir by fd: a copy's layer holds
// what its agent wrote, so a symlink anywhere in it is refused, never followed (ELOOP). The mount
// plan then finds real directories, and the file ns-init's binary is bound over, at its paths.
// A branch without namespaces runs in the host's root, where its agent sees workspace/ alone (its
// /tmp is the host's): the rest of the layer, the file ns-init is bound over and the machine id
// (launch_branch) are not made. Each would be a new inode on the state dir's disk, on the agent's
// path: 46-190 us apiece on ext4 without a journal that has just freed inodes (its
// recently_deleted scan). A snapshot copies what the layer holds; a copy's launch makes the rest.
os::Result<void> prepare_layer(const BranchSpec& spec, bool bundle_libs) {
  if (auto r = narrow_branches_dir(spec); !r) return r.error();
  if (auto r = os::make_dirs(spec.dir, 0755); !r) return r.error();
  auto top = os::open_dir(spec.dir);
  if (!top) return top.error();
  if (!spec.want_namespaces) {
    if (auto d = os::make_dirs_at(top->get(), "workspace", 0755); !d) return d.error();
    return {};
  }
  for (const char* sub : {"root", "workspace", "tmp", "run", "tmp-upper", "tmp-work", "run/sandboxer/bin"}) {
    auto d = os::make_dirs_at(top->get(), sub, 0755);
    if (!d) return d.error();
    // /tmp is everyone's, sticky.
    if ((std::string_view(sub) == "tmp" || std::string_view(sub) == "tmp-upper") && ::fchmod(d->get(), 01777) != 0)
      return os::last_error();
  }
  if (bundle_libs)
    if (auto d = os::make_dirs_at(top->get(), "run/sandboxer/lib", 0755); !d) return d.error();
  if (auto r = clear_volatile_mark(top->get()); !r) return r.error();
  auto exe = os::open_beneath(top->get(), std::string(kNsInitPath).substr(1),
                              O_WRONLY | O_CREAT | O_NONBLOCK | O_NOCTTY, 0755);
  if (!exe) return exe.error();
  struct stat st {};
  if (::fstat(exe->get(), &st) != 0) return os::last_error();
  if (!S_ISREG(st.st_mode)) return os::sys_error(EEXIST);
  return {};
}
}  // namespace

NsInitBinary ns_init_binary(const std::string& self_exe) {
  std::string own = self_exe.substr(0, self_exe.rfind('/') + 1) + "sandboxer-ns-init";
  struct stat st {};
  if (::stat(own.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(own.c_str(), X_OK) == 0) return {own, {}};
  return {self_exe, {"--ns-init"}};
}

base::Result<void> can_make_namespaces() {
  pid_t pid = static_cast<pid_t>(::syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0));
  if (pid == 0) ::_exit(0);
  if (pid < 0) return base::sys_fail("clone(CLONE_NEWPID|CLONE_NEWNS)", errno);
  int st;
  ::waitpid(pid, &st, __WALL);
  return {};
}

namespace {
// Moves `pid` into each v2 cgroup (its cgroup.procs fds); 0, or the errno of the first that
// refused. The parent does it while the child walks its mount plan and execs ns-init: a move
// through cgroup.procs waits for an RCU grace period (milliseconds), which the child's own write
// would pay in full on the agent's path (v1 joins through `tasks` in the child instead, which
// waits for none). Nothing of the agent runs before both are done: ns-init forks the agent only
// once it reads the branch's config, which the caller sends after launch_branch returns. A child
// that already failed (ESRCH) is reported by its error pipe instead.
int join_cgroups(const std::vector<int>& procs, pid_t pid) {
  std::string s = std::to_string(pid);
  for (int fd : procs)
    if (::write(fd, s.data(), s.size()) != static_cast<ssize_t>(s.size())) return errno == ESRCH ? 0 : errno;
  return 0;
}

// clone3 into the v2 group `cgroup_dir` where there is one, else clone: a copy of our memory.
pid_t clone_copy(unsigned long flags, int cgroup_dir, bool& in_cgroup) {
  if (cgroup_dir >= 0) {
    struct clone_args args {};
    args.flags = (flags & ~static_cast<unsigned long>(CSIGNAL)) | CLONE_INTO_CGROUP;
    args.exit_signal = flags & CSIGNAL;
    args.cgroup = static_cast<uint64_t>(cgroup_dir);
    long pid = ::syscall(SYS_clone3, &args, sizeof args);
    if (pid >= 0) {
      in_cgroup = true;
      return static_cast<pid_t>(pid);
    }
    log()->debug("clone3 into the branch's cgroup: {}; clone, then move it", std::strerror(errno));
  }
  return static_cast<pid_t>(::syscall(SYS_clone, flags, 0, 0, 0, 0));
}

SBX_OWN_STACK int child_entry(void* args) { child_main(*static_cast<ChildArgs*>(args)); }

// The child's own stack for a clone that shares our memory, with a guard page below it.
class ChildStack {
 public:
  static constexpr size_t kSize = 1 << 20;  // the plan's syscalls need little; ASan's frames more
  ChildStack() {
    void* p =
        ::mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return;
    if (::mprotect(p, static_cast<size_t>(::getpagesize()), PROT_NONE) != 0) {
      ::munmap(p, kSize);
      return;
    }
    base_ = static_cast<char*>(p);
  }
  ~ChildStack() {
    if (base_) ::munmap(base_, kSize);
  }
  ChildStack(const ChildStack&) = delete;
  ChildStack& operator=(const ChildStack&) = delete;
  void* top() const { return base_ ? base_ + kSize : nullptr; }

 private:
  char* base_ = nullptr;
};

// Starts the branch's child, which runs child_main(ca). Three ways:
// - into the v2 group `cgroup_dir` where there is one, by clone3 (CLONE_INTO_CGROUP, Linux 5.7):
//   the child starts inside it, where a move through cgroup.procs waits for an RCU grace period;
// - where the parent moves the child into its groups by pid (v2 where clone3 is refused: ENOSYS
//   from an older kernel or a seccomp filter such as Docker's default), a clone that copies our
//   memory, so that we move it while it walks its mount plan;
// - otherwise (v1, whose child joins its groups itself, or no groups) as posix_spawn does: the
//   child shares our memory (CLONE_VM) on a stack of its own until its exec, and we wait for that
//   exec (CLONE_VFORK), as launch_branch did anyway for the child's error pipe. No copy of our page
//   tables at the clone, no copy-on-write faults after it, no copy to tear down at the exec. The
//   child only walks the plan with plain syscalls (run_plan), which write nothing of ours but the
//   plan's slots, errno and its own stack; its signal handlers are its own (no CLONE_SIGHAND), and
//   our handled signals are blocked (signal-mask.hpp) until it resets them. Nothing of our memory
//   survives its exec, as with a copy.
// `flags` as clone's, exit signal included. Returns the child's pid (never 0), or -1 with errno.
pid_t clone_branch(unsigned long flags, int cgroup_dir, bool parent_moves, ChildArgs& ca, bool& in_cgroup) {
  in_cgroup = false;
  if (cgroup_dir < 0 && !parent_moves) {
    ChildStack stack;
    if (stack.top()) return ::clone(child_entry, stack.top(), static_cast<int>(flags | CLONE_VM | CLONE_VFORK), &ca);
    log()->debug("a stack for the branch's child: {}; clone a copy instead", std::strerror(errno));
  }
  pid_t pid = clone_copy(flags, cgroup_dir, in_cgroup);
  if (pid == 0) child_main(ca);
  return pid;
}

}  // namespace

os::Result<void> copy_root_top(pid_t ns_init, const std::string& dest) {
  auto out = os::make_dirs(dest, 0755);
  if (!out) return out.error();
  auto dst = os::open_dir(dest);
  if (!dst) return dst.error();
  int src = ::open(("/proc/" + std::to_string(ns_init) + "/root").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (src < 0) return os::last_error();
  DIR* d = ::fdopendir(src);
  if (!d) {
    int e = errno;
    ::close(src);
    return os::sys_error(e);
  }
  os::Result<void> result;
  while (auto* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n == "." || n == "..") continue;
    struct stat st {};
    if (::fstatat(src, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // gone meanwhile
    int rc = 0;
    if (S_ISDIR(st.st_mode)) {
      rc = ::mkdirat(dst->get(), e->d_name, 0755);
    } else if (S_ISLNK(st.st_mode)) {
      char buf[4096];
      ssize_t len = ::readlinkat(src, e->d_name, buf, sizeof buf - 1);
      if (len < 0) continue;
      buf[len] = '\0';
      rc = ::symlinkat(buf, dst->get(), e->d_name);
    }
    if (rc != 0 && errno != EEXIST) {
      result = os::last_error();
      break;
    }
  }
  ::closedir(d);
  return result;
}

namespace {

// The launch's error where the namespaces failed and the branch may not run without them.
base::Error flat_refused(const BranchSpec& spec, const std::string& why) {
  return base::fail("no pid and mount namespace for the branch (" + why + "), and it may not run without them" +
                        (spec.flat_refusal.empty() ? "" : ": " + spec.flat_refusal),
                    "unavailable");
}

}  // namespace

base::Result<LaunchedBranch> launch_branch(const BranchSpec& spec) {
  // Its network namespace is made before the clone, so that the reports socket is made in it; on
  // a thread, beside the rest of the work before the clone.
  bool own_net = spec.want_namespaces && spec.new_net;
  std::optional<NetnsMaker> netns;
  if (own_net) netns.emplace();
  std::string lib_dir = spec.self_exe.substr(0, spec.self_exe.rfind('/') + 1) + "../lib";
  struct stat lst {};
  if (auto r = prepare_layer(spec, ::stat(lib_dir.c_str(), &lst) == 0 && S_ISDIR(lst.st_mode)); !r) {
    log()->error("branch {}: prepare its writable layer in {}: {}", spec.name, spec.dir, r.error().message());
    return base::sys_fail("prepare the branch's writable layer in " + spec.dir, r.error());
  }
  if (spec.want_namespaces) ensure_machine_id(spec.dir);

  auto pipes = make_pipes(netns ? &*netns : nullptr);
  std::string netns_why;
  if (!pipes && own_net) {
    netns_why = "a network namespace of its own: " + pipes.error().message();
    pipes = make_pipes(nullptr);
  }
  if (!pipes) return base::sys_fail("make the branch's pipes", pipes.error());

  NsInitBinary bin = spec.ns_init.path.empty() ? ns_init_binary(spec.self_exe) : spec.ns_init;
  std::vector<std::string> args = {bin.path};
  args.insert(args.end(), bin.args.begin(), bin.args.end());

  LaunchedBranch lb;
  std::string why_not;
  if (spec.want_namespaces && !netns_why.empty() && !spec.flat_fallback) return flat_refused(spec, netns_why);
  bool try_ns = spec.want_namespaces && netns_why.empty();
  if (!spec.want_namespaces) why_not = "namespaces are off in the profile";
  if (!netns_why.empty()) why_not = netns_why;

  for (int attempt = 0; attempt < 2; ++attempt) {
    bool ns = try_ns && attempt == 0;
    args[0] = ns ? kNsInitPath : bin.path;
    if (!ns) args.push_back("--flat");
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    char* envp[] = {nullptr};
    Plan plan;
    if (ns) plan = make_plan(spec, bin.path);
    auto ep = os::make_pipe();
    if (!ep) return base::sys_fail("make the branch's error pipe", ep.error());
    ChildArgs ca{ns ? &plan : nullptr,
                 pipes->netns ? pipes->netns.get() : -1,
                 ns ? kNsInitPath : bin.path.c_str(),
                 argv.data(),
                 envp,
                 {},
                 ep->write.get(),
                 pipes->pid_write.get(),
                 spec.cgroup_self_join ? &spec.cgroup_join : nullptr};
    auto ends = pipes->child_ends();
    for (size_t i = 0; i < ends.size(); ++i) ca.fds[i] = ends[i];
    unsigned long flags = SIGCHLD | (ns ? (CLONE_NEWPID | CLONE_NEWNS) : 0);
    bool in_cgroup = false;
    bool parent_moves = !spec.cgroup_self_join && !spec.cgroup_join.empty();
    pid_t pid = clone_branch(flags, spec.cgroup_dir, parent_moves, ca, in_cgroup);
    if (pid < 0) {
      if (ns) {
        why_not = std::string("clone(CLONE_NEWPID|CLONE_NEWNS): ") + std::strerror(errno);
        if (!spec.flat_fallback) return flat_refused(spec, why_not);
        continue;
      }
      return base::sys_fail("start ns-init", errno);
    }
    ep->write.reset();
    int join_err = in_cgroup || spec.cgroup_self_join ? 0 : join_cgroups(spec.cgroup_join, pid);
    if (in_cgroup) log()->debug("branch {}: ns-init cloned into its cgroup (CLONE_INTO_CGROUP)", spec.name);
    if (auto ce = os::read_child_error(ep->read.get())) {
      // The child failed before exec; collect it here (it is ours alone, not yet the reaper's).
      int st;
      ::waitpid(pid, &st, __WALL);
      std::string step = ce->step >= 0                 ? plan.ops[static_cast<size_t>(ce->step)].what
                         : ce->step == kStepJoinCgroup ? std::string("join the branch's cgroup")
                         : ce->step == kStepNetns      ? std::string("enter the branch's network namespace")
                                                       : "exec " + bin.path;
      std::string msg = step + ": " + std::strerror(ce->err);
      if (ns && ce->step >= 0) {
        if (!spec.flat_fallback) return flat_refused(spec, msg);
        log()->warn("branch {}: {}; running without namespaces", spec.name, msg);
        why_not = msg;
        continue;
      }
      return base::fail(msg);
    }
    if (join_err != 0) {
      ::kill(pid, SIGKILL);
      int st;
      ::waitpid(pid, &st, __WALL);
      log()->error("branch {}: join the branch's cgroup: {}", spec.name, std::strerror(join_err));
      return base::sys_fail("join the branch's cgroup", join_err);
    }
    lb.pid = pid;
    lb.namespaced = ns;
    break;
  }
  if (lb.pid < 0) return base::sys_fail("start ns-init", ECHILD);
  lb.why_not = lb.namespaced ? "" : why_not;
  if (!lb.namespaced) pipes->netns.reset();  // made, but ns-init runs in ours
  lb.take(*pipes);
  return lb;
}

}  // namespace sbx::sandbox
