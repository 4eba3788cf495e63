// The seccomp policies, built with libseccomp and exported as a BPF program into memory, and the
// cache of those programs in the user's state dir.
#include <fcntl.h>
#include <linux/sched.h>
#include <seccomp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "os/files.hpp"
#include "os/sys.hpp"
#include "sandbox/policy.hpp"

#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif
#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif
#ifndef AF_ALG
#define AF_ALG 38
#endif

namespace sbx::sandbox {

const std::vector<std::string>& default_denied_syscalls() {
  static const std::vector<std::string> names = {
      // kernel and modules
      "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
      // tracing, bpf, perf, userfaultfd
      "bpf", "perf_event_open", "userfaultfd", "ptrace", "process_vm_readv", "process_vm_writev",
      // keyrings
      "add_key", "request_key", "keyctl",
      // mounts, old and new API
      "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
      "mount_setattr", "open_by_handle_at",
      // namespaces
      "unshare", "setns",
      // io_uring (bypasses seccomp for the operations it runs)
      "io_uring_setup", "io_uring_enter", "io_uring_register",
      // host administration
      "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd",
      // the host's names: a branch has no UTS namespace of its own (restored copies do), so a
      // profile that keeps CAP_SYS_ADMIN would otherwise rename the host
      "sethostname", "setdomainname"};
  return names;
}

namespace {

struct CtxDeleter {
  void operator()(void* c) const { seccomp_release(c); }
};

int syscall_number(const std::string& name, const std::string& where) {
  int nr = seccomp_syscall_resolve_name(name.c_str());
  if (nr == __NR_SCMP_ERROR) throw profile::ProfileError(where + ": unknown syscall \"" + name + "\"");
  return nr;
}

void check(int rc, const std::string& what) {
  if (rc < 0) throw std::runtime_error("seccomp: " + what + ": " + std::strerror(-rc));
}

}  // namespace

boost::json::object seccomp_description(const std::string& setting) {
  if (setting == "default" || setting == "none") return {{"policy", setting}};
  auto text = os::read_file(setting);
  if (!text) throw profile::ProfileError("isolation.seccomp: cannot read " + setting + ": " + text.error().message());
  boost::system::error_code ec;
  auto doc = boost::json::parse(*text, ec);
  if (ec || !doc.is_object()) throw profile::ProfileError("isolation.seccomp: " + setting + " is not a JSON object");
  boost::json::object desc{{"policy", "file"}};
  for (auto& kv : doc.as_object()) {
    std::string key(kv.key());
    std::string field = "isolation.seccomp(" + setting + ")." + key;
    if (key == "base") {
      if (!kv.value().is_string() || (kv.value().as_string() != "default" && kv.value().as_string() != "none"))
        throw profile::ProfileError(field + ": expected \"default\" or \"none\"");
      desc["base"] = kv.value();
    } else if (key == "deny" || key == "enosys") {
      if (!kv.value().is_array()) throw profile::ProfileError(field + ": expected a list of syscall names");
      for (auto& n : kv.value().as_array()) {
        if (!n.is_string()) throw profile::ProfileError(field + ": expected a list of syscall names");
        syscall_number(std::string(n.as_string()), field);
      }
      desc[key] = kv.value();
    } else {
      throw profile::ProfileError(field + ": unknown field");
    }
  }
  return desc;
}

std::vector<struct sock_filter> build_seccomp(const boost::json::object& desc) {
  std::string policy = desc.contains("policy") ? std::string(desc.at("policy").as_string()) : "default";
  std::string base =
      policy == "file" ? (desc.contains("base") ? std::string(desc.at("base").as_string()) : "none") : policy;
  if (policy == "none") return {};
  // Anything not named is allowed; other architectures (i386, x32 entry points) are killed,
  // libseccomp's default for an architecture the filter does not list.
  std::unique_ptr<void, CtxDeleter> ctx(seccomp_init(SCMP_ACT_ALLOW));
  if (!ctx) throw std::runtime_error("seccomp: seccomp_init failed");
  auto deny = [&](const std::string& name, int err) {
    int nr = seccomp_syscall_resolve_name(name.c_str());
    if (nr == __NR_SCMP_ERROR) return;  // not on this architecture
    check(seccomp_rule_add(ctx.get(), SCMP_ACT_ERRNO(err), nr, 0), "deny " + name);
  };
  if (base == "default") {
    for (auto& n : default_denied_syscalls()) deny(n, EPERM);
    // clone with any namespace flag; plain fork/thread clones stay allowed.
    for (uint64_t flag :
         {uint64_t(CLONE_NEWNS), uint64_t(CLONE_NEWUTS), uint64_t(CLONE_NEWIPC), uint64_t(CLONE_NEWUSER),
          uint64_t(CLONE_NEWPID), uint64_t(CLONE_NEWNET), uint64_t(CLONE_NEWCGROUP)})
      check(seccomp_rule_add(ctx.get(), SCMP_ACT_ERRNO(EPERM), SCMP_SYS(clone), 1,
                             SCMP_A0(SCMP_CMP_MASKED_EQ, flag, flag)),
            "deny clone with namespace flags");
    // clone3 passes its flags in memory, where seccomp cannot look: ENOSYS makes libc fall back
    // to clone, which the rules above can check.
    check(seccomp_rule_add(ctx.get(), SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0), "clone3");
    for (int family : {AF_PACKET, AF_ALG, AF_VSOCK})
      check(seccomp_rule_add(ctx.get(), SCMP_ACT_ERRNO(EPERM), SCMP_SYS(socket), 1,
                             SCMP_A0(SCMP_CMP_EQ, static_cast<scmp_datum_t>(family))),
            "deny socket family " + std::to_string(family));
  }
  if (policy == "file") {
    if (auto* d = desc.if_contains("deny"))
      for (auto& n : d->as_array()) deny(std::string(n.as_string()), EPERM);
    if (auto* d = desc.if_contains("enosys"))
      for (auto& n : d->as_array()) deny(std::string(n.as_string()), ENOSYS);
  }
  // The filter is applied after no_new_privs; libseccomp must not set it (or anything) itself.
  check(seccomp_attr_set(ctx.get(), SCMP_FLTATR_CTL_NNP, 0), "attr NNP");
  int fd = ::memfd_create("sbx-seccomp", MFD_CLOEXEC);
  if (fd < 0) throw std::runtime_error(std::string("seccomp: memfd_create: ") + std::strerror(errno));
  os::UniqueFd mem(fd);
  check(seccomp_export_bpf(ctx.get(), mem.get()), "export");
  off_t size = ::lseek(mem.get(), 0, SEEK_END);
  if (size <= 0 || size % sizeof(struct sock_filter) != 0) throw std::runtime_error("seccomp: bad exported program");
  std::vector<struct sock_filter> prog(static_cast<size_t>(size) / sizeof(struct sock_filter));
  if (::pread(mem.get(), prog.data(), static_cast<size_t>(size), 0) != size)
    throw std::runtime_error(std::string("seccomp: read exported program: ") + std::strerror(errno));
  return prog;
}

namespace {

// What the exported program depends on besides the policy: libseccomp's version and the API level
// it found in this kernel (both choose the instructions), the architecture, and the kernel itself.
boost::json::object seccomp_cache_host() {
  const scmp_version* v = seccomp_version();
  struct utsname u {};
  (void)::uname(&u);
  return {{"format", 1},
          {"libseccomp", std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->micro)},
          {"api", seccomp_api_get()},
          {"arch", seccomp_arch_native()},
          {"kernel", std::string(u.release) + " " + u.version}};
}

// The first line of a cache file: its host and the policy.
std::string seccomp_cache_key(boost::json::object host, const boost::json::object& desc) {
  host["policy"] = desc;
  return boost::json::serialize(host);
}

std::string seccomp_cache_name(const std::string& key) {
  char name[40];
  std::snprintf(name, sizeof name, "seccomp-%016zx.bpf", std::hash<std::string>{}(key));
  return name;
}

// The program cached for `key` in `dir` (os::read_own_file_at: ours, no one else may write it, no
// symlink followed): its first line is `key`, the rest a whole program.
std::optional<std::vector<struct sock_filter>> read_seccomp_cache(int dir, const std::string& name,
                                                                  const std::string& key) {
  auto text = os::read_own_file_at(dir, name, key.size() + 1 + kMaxSeccompInstructions * sizeof(struct sock_filter));
  if (!text || text->size() <= key.size() || text->compare(0, key.size(), key) != 0 || (*text)[key.size()] != '\n')
    return std::nullopt;
  return seccomp_program_from(std::string_view(*text).substr(key.size() + 1));
}

// Removes the programs `dir` keeps for another host than `host` (an older kernel or libseccomp,
// which this machine runs no more until it boots that kernel again): without it every kernel
// update left one file per policy behind. Run where a program was built, so a start that finds
// its program lists nothing. A file of ours (os::read_own_file_at) whose first line is a key is
// judged; anything else named so is left as it is.
void prune_seccomp_cache(int dir, const boost::json::object& host, const std::string& keep) {
  std::vector<std::string> names;
  auto listed = os::for_each_name(dir, [&](const char* name) {
    std::string_view n(name);
    if (n.starts_with("seccomp-") && n.ends_with(".bpf") && n != keep) names.emplace_back(n);
    return true;
  });
  if (!listed) return;
  for (auto& name : names) {
    auto text = os::read_own_file_at(dir, name, 65536 + kMaxSeccompInstructions * sizeof(struct sock_filter));
    if (!text) continue;
    boost::system::error_code ec;
    auto line = boost::json::parse(std::string_view(*text).substr(0, text->find('\n')), ec);
    if (ec || !line.is_object() || !line.as_object().contains("policy")) continue;
    line.as_object().erase("policy");
    if (line.as_object() != host) (void)::unlinkat(dir, name.c_str(), 0);
  }
}

}  // namespace

std::optional<std::vector<struct sock_filter>> seccomp_program_from(std::string_view bytes) {
  if (bytes.empty() || bytes.size() % sizeof(struct sock_filter) != 0 ||
      bytes.size() / sizeof(struct sock_filter) > kMaxSeccompInstructions)
    return std::nullopt;
  std::vector<struct sock_filter> prog(bytes.size() / sizeof(struct sock_filter));
  std::memcpy(prog.data(), bytes.data(), bytes.size());
  return prog;
}

std::string_view seccomp_program_bytes(const std::vector<struct sock_filter>& prog) noexcept {
  return {reinterpret_cast<const char*>(prog.data()), prog.size() * sizeof(struct sock_filter)};
}

SeccompProgram cached_seccomp(const boost::json::object& desc, const std::string& cache_dir) {
  SeccompProgram out;
  if (desc.contains("policy") && desc.at("policy") == "none") return out;
  auto host = seccomp_cache_host();
  std::string key = seccomp_cache_key(host, desc), name = seccomp_cache_name(key);
  std::optional<os::UniqueFd> dir;
  if (cache_dir.empty())
    out.cache_error = "no state dir to keep it in";
  else if (auto d = os::open_dir(cache_dir))
    dir = std::move(*d);
  else
    out.cache_error = "open " + cache_dir + ": " + d.error().message();
  if (dir)
    if (auto cached = read_seccomp_cache(dir->get(), name, key)) {
      out.program = std::move(*cached);
      out.from_cache = true;
      return out;
    }
  out.program = build_seccomp(desc);
  if (!dir) return out;
  // A cache that cannot be written (a read-only home, a full disk) costs the next start a build.
  std::string text = key + "\n";
  text.append(seccomp_program_bytes(out.program));
  if (auto w = os::write_file_atomic_at(dir->get(), name, text, 0600); !w)
    out.cache_error = "write " + cache_dir + "/" + name + ": " + w.error().message();
  prune_seccomp_cache(dir->get(), host, name);
  return out;
}

}  // namespace sbx::sandbox
