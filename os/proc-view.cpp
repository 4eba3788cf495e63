#include "os/proc-view.hpp"

#include <sched.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstdio>

#include "os/sys.hpp"

namespace sbx::os {

std::optional<std::string> proc_nspid() {
  auto text = read_file("/proc/self/status");
  if (!text) return std::nullopt;
  auto at = text->find("\nNSpid:");
  if (at == std::string::npos) return std::string();
  at += 7;
  auto eol = text->find('\n', at);
  std::string line = text->substr(at, eol == std::string::npos ? std::string::npos : eol - at);
  // "\t26689\t1" -> "26689 1"
  std::string out;
  for (char c : line) {
    if (c == ' ' || c == '\t') {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += c;
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

base::Result<std::string> own_proc() {
  auto seen = proc_nspid();
  if (seen && seen->find(' ') == std::string::npos) return std::string();
  std::string what = seen ? "NSpid " + *seen : std::string("no /proc/self/status");
  if (::unshare(CLONE_NEWNS) != 0)
    return base::sys_fail(
        "/proc is another pid namespace's (" + what + "): make a mount namespace for a proc of this one", errno);
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_SLAVE, nullptr) != 0)
    return base::sys_fail("make the supervisor's mount namespace a slave of the host's", errno);
  if (::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0)
    return base::sys_fail("/proc is another pid namespace's (" + what + "): mount a proc of this one on /proc", errno);
  return what;
}

bool in_initial_user_namespace() {
  static const bool initial = [] {
    auto map = read_file("/proc/self/uid_map");
    if (!map) return true;  // no /proc to tell: as before
    unsigned long inside = 1, outside = 1, count = 0;
    return std::sscanf(map->c_str(), "%lu %lu %lu", &inside, &outside, &count) == 3 && inside == 0 && outside == 0 &&
           count == 4294967295UL && map->find('\n') == map->size() - 1;
  }();
  return initial;
}

bool setgroups_denied() {
  auto text = read_file("/proc/self/setgroups");
  return text && text->starts_with("deny");
}

}  // namespace sbx::os
