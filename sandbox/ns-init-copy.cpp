// The copy of sandboxer-ns-init that a box runs its branches' ns-init from (launcher.hpp,
// stable_ns_init): kept in the user's state dir, one per installed version, so that an upgrade
// that replaces the installed file leaves what every running box's ns-init runs linked.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "os/files.hpp"
#include "os/sys.hpp"
#include "sandbox/launcher.hpp"

namespace sbx::sandbox {

namespace {

constexpr const char* kPrefix = "ns-init-";
constexpr size_t kKept = 4;  // copies of earlier versions kept beside the current one (snapshots' restores)

// The copy's name: the installed file's size, modification time and inode, so that a file a
// package manager replaced (a new inode, as a rule a new time) gets a copy of its own.
std::string copy_name(const struct stat& st) {
  char name[128];
  std::snprintf(name, sizeof name, "%s%llx-%llx.%09ld-%llx", kPrefix, static_cast<unsigned long long>(st.st_size),
                static_cast<unsigned long long>(st.st_mtim.tv_sec), st.st_mtim.tv_nsec,
                static_cast<unsigned long long>(st.st_ino));
  return name;
}

// A copy made earlier that may be run: a regular file of this user's, which no one else may write,
// of the installed file's size.
bool usable(const struct stat& have, const struct stat& want) {
  return S_ISREG(have.st_mode) && have.st_uid == ::geteuid() && (have.st_mode & 022) == 0 &&
         have.st_size == want.st_size;
}

// The (device, inode) of every program a process here runs, where it may be read.
std::set<std::pair<dev_t, ino_t>> programs_running() {
  std::set<std::pair<dev_t, ino_t>> out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (auto* e = ::readdir(d)) {
    if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
    struct stat st {};
    if (::stat(("/proc/" + std::string(e->d_name) + "/exe").c_str(), &st) == 0) out.emplace(st.st_dev, st.st_ino);
  }
  ::closedir(d);
  return out;
}

// After a new copy: those of earlier versions past the newest kKept go, but for one a running
// process (a box's ns-init) runs.
void prune(int dir, const std::string& current) {
  std::vector<std::pair<struct stat, std::string>> old;
  auto listed = os::for_each_name(dir, [&](const char* name) {
    std::string n = name;
    struct stat st {};
    if (n.starts_with(kPrefix) && n != current && ::fstatat(dir, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode))
      old.emplace_back(st, n);
    return true;
  });
  if (!listed || old.size() <= kKept) return;
  std::sort(old.begin(), old.end(), [](const auto& a, const auto& b) {
    const struct timespec &x = a.first.st_ctim, &y = b.first.st_ctim;
    return x.tv_sec != y.tv_sec ? x.tv_sec > y.tv_sec : x.tv_nsec > y.tv_nsec;
  });
  auto running = programs_running();
  for (size_t i = kKept; i < old.size(); ++i)
    if (!running.contains({old[i].first.st_dev, old[i].first.st_ino})) (void)::unlinkat(dir, old[i].second.c_str(), 0);
}

}  // namespace

base::Result<NsInitBinary> stable_ns_init(const NsInitBinary& bin, const std::string& state_home) {
  // sandboxer-init's own --ns-init mode finds a bundle's libraries from where it is installed.
  if (!bin.args.empty()) return bin;
  if (state_home.empty()) return base::fail("no state dir to keep its copy in");
  struct stat want {};
  if (::stat(bin.path.c_str(), &want) != 0) return base::sys_fail("stat " + bin.path, errno);
  auto dir = os::open_dir(state_home);
  if (!dir) return base::sys_fail("open " + state_home, dir.error());
  std::string name = copy_name(want);
  NsInitBinary copy{state_home + "/" + name, {}};
  if (struct stat have{}; ::fstatat(dir->get(), name.c_str(), &have, AT_SYMLINK_NOFOLLOW) == 0 && usable(have, want))
    return copy;
  // A miss: the first start of this installed version here.
  struct statvfs vfs {};
  if (::fstatvfs(dir->get(), &vfs) == 0 && (vfs.f_flag & ST_NOEXEC))
    return base::fail(state_home + " is on a filesystem mounted noexec");
  // Copied in the kernel: a 3 MB read into this process's heap stayed there (RssAnon 4.4 MiB
  // against 0.4 for the rest of the supervisor's life, and the start's peak RSS 10 MiB).
  os::UniqueFd in(::open(bin.path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat got {};
  if (!in || ::fstat(in.get(), &got) != 0) return base::sys_fail("open " + bin.path, errno);
  if (got.st_dev != want.st_dev || got.st_ino != want.st_ino || got.st_size != want.st_size)
    return base::fail(bin.path + " was replaced while it was copied");
  if (auto w = os::copy_file_atomic_at(dir->get(), name, in.get(), static_cast<uint64_t>(want.st_size), 0755); !w)
    return base::sys_fail("copy " + bin.path + " to " + copy.path, w.error());
  prune(dir->get(), name);
  return copy;
}

}  // namespace sbx::sandbox
