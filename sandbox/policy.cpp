#include "sandbox/policy.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sys/capability.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string_view>

#include "base/encoding.hpp"
#include "os/proc-view.hpp"
#include "os/sys.hpp"
#include "sandbox/capabilities.hpp"
#include "sandbox/launcher.hpp"

#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_RAISE 2
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

namespace sbx::sandbox {

namespace {

// Landlock, as far as ABI 6 (Debian 12's header knows ABI 2; the kernel here reports 7). Every
// right is listed, used or not: an enumeration, so those unused draw no warning.
namespace ll {
enum : uint64_t {
  kExecute = 1ULL << 0,
  kWriteFile = 1ULL << 1,
  kReadFile = 1ULL << 2,
  kReadDir = 1ULL << 3,
  kRemoveDir = 1ULL << 4,
  kRemoveFile = 1ULL << 5,
  kMakeChar = 1ULL << 6,
  kMakeDir = 1ULL << 7,
  kMakeReg = 1ULL << 8,
  kMakeSock = 1ULL << 9,
  kMakeFifo = 1ULL << 10,
  kMakeBlock = 1ULL << 11,
  kMakeSym = 1ULL << 12,
  kRefer = 1ULL << 13,
  kTruncate = 1ULL << 14,
  kIoctlDev = 1ULL << 15
};
constexpr uint64_t kScopeAbstractUnix = 1ULL << 0, kScopeSignal = 1ULL << 1;
constexpr unsigned kCreateVersion = 1U << 0;
constexpr int kRulePathBeneath = 1;
struct RulesetAttr {
  uint64_t handled_access_fs;
  uint64_t handled_access_net;
  uint64_t scoped;
};
struct __attribute__((packed)) PathBeneath {
  uint64_t allowed_access;
  int32_t parent_fd;
};

uint64_t fs_rights(int abi) {
  uint64_t r = (kMakeSym << 1) - 1;  // ABI 1: bits 0..12
  if (abi >= 2) r |= kRefer;
  if (abi >= 3) r |= kTruncate;
  if (abi >= 5) r |= kIoctlDev;
  return r;
}
// Rights that make sense on a file (the kernel refuses directory rights on one).
constexpr uint64_t kFileRights = kExecute | kWriteFile | kReadFile | kTruncate | kIoctlDev;
}  // namespace ll

int landlock_abi() {
  long abi = ::syscall(SYS_landlock_create_ruleset, nullptr, 0, ll::kCreateVersion);
  return abi > 0 ? static_cast<int>(abi) : 0;
}

os::UniqueFd build_landlock(const boost::json::object& l) {
  int abi = landlock_abi();
  if (abi <= 0) throw std::runtime_error("landlock: not available on this kernel");
  ll::RulesetAttr attr{ll::fs_rights(abi), 0, 0};
  // ABI 6: the agent may not signal processes outside its domain (ns-init, the supervisor) nor
  // reach abstract unix sockets outside it.
  if (abi >= 6) attr.scoped = ll::kScopeAbstractUnix | ll::kScopeSignal;
  size_t size = abi >= 6 ? sizeof attr : abi >= 4 ? 16 : 8;
  int fd = static_cast<int>(::syscall(SYS_landlock_create_ruleset, &attr, size, 0));
  if (fd < 0) throw std::runtime_error(std::string("landlock: create ruleset: ") + std::strerror(errno));
  os::UniqueFd ruleset(fd);
  auto add = [&](const boost::json::value& paths, uint64_t rights, const char* which) {
    for (auto& v : paths.as_array()) {
      std::string path(v.as_string());
      os::UniqueFd pfd(::open(path.c_str(), O_PATH | O_CLOEXEC));
      if (!pfd) {
        if (errno == ENOENT) continue;  // not in this root: nothing to allow
        throw std::runtime_error(std::string("isolation.landlock.") + which + ": open " + path + ": " +
                                 std::strerror(errno));
      }
      struct stat st {};
      ::fstat(pfd.get(), &st);
      ll::PathBeneath pb{rights & attr.handled_access_fs, pfd.get()};
      if (!S_ISDIR(st.st_mode)) pb.allowed_access &= ll::kFileRights;
      if (::syscall(SYS_landlock_add_rule, ruleset.get(), ll::kRulePathBeneath, &pb, 0) != 0)
        throw std::runtime_error(std::string("isolation.landlock.") + which + ": add " + path + ": " +
                                 std::strerror(errno));
    }
  };
  if (auto* ro = l.if_contains("ro")) add(*ro, ll::kExecute | ll::kReadFile | ll::kReadDir, "ro");
  if (auto* rw = l.if_contains("rw")) add(*rw, ll::fs_rights(abi), "rw");
  return ruleset;
}

int cap_last() {
  if (auto t = os::read_file("/proc/sys/kernel/cap_last_cap")) {
    try {
      return std::stoi(*t);
    } catch (...) {
    }
  }
  return CAP_LAST_CAP;
}

std::optional<int> cap_number(std::string name) {
  for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!name.starts_with("cap_")) name = "cap_" + name;
  cap_value_t v;
  if (cap_from_name(name.c_str(), &v) != 0) return std::nullopt;
  return static_cast<int>(v);
}

const char* const kSteps[] = {"oom_score_adj",
                              "drop the capability bounding set",
                              "setgroups",
                              "setresgid",
                              "keep capabilities across setuid",
                              "setresuid",
                              "capset",
                              "ambient capabilities",
                              "RLIMIT_CORE",
                              "RLIMIT_NOFILE",
                              "no_new_privs",
                              "landlock_restrict_self",
                              "seccomp filter"};

}  // namespace

std::optional<CapSets> own_capabilities() {
  struct __user_cap_header_struct hdr {
    _LINUX_CAPABILITY_VERSION_3, 0
  };
  struct __user_cap_data_struct data[2]{};
  if (::syscall(SYS_capget, &hdr, data) != 0) return std::nullopt;
  return CapSets{data[0].effective | (static_cast<uint64_t>(data[1].effective) << 32),
                 data[0].permitted | (static_cast<uint64_t>(data[1].permitted) << 32)};
}

const char* policy_step_name(int step) noexcept {
  if (step < 0 || step >= static_cast<int>(sizeof kSteps / sizeof kSteps[0])) return "policy";
  return kSteps[step];
}

int bring_up_loopback() noexcept {
  int s = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) return errno;
  struct ifreq ifr {};
  std::memcpy(ifr.ifr_name, "lo", 3);
  int rc = ::ioctl(s, SIOCGIFFLAGS, &ifr);
  if (rc == 0) {
    ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP | IFF_RUNNING);
    rc = ::ioctl(s, SIOCSIFFLAGS, &ifr);
  }
  int e = rc == 0 ? 0 : errno;
  ::close(s);
  return e;
}

std::vector<std::string> credential_paths() {
  std::vector<std::string> out;
  // A path that is not there costs nothing (no mount is made for it); each one there is a mount
  // at every branch's start.
  auto add_home = [&](const std::string& home) {
    for (const char* rel :
         {"/.local/state/sandboxer", "/.ssh", "/.gnupg", "/.password-store", "/.local/share/keyrings",
          // clouds and clusters
          "/.aws", "/.config/gcloud", "/.azure", "/.kube", "/.oci", "/.config/doctl", "/.fly", "/.boto", "/.s3cfg",
          "/.config/rclone", "/.vault-token", "/.terraform.d/credentials.tfrc.json", "/.config/op",
          // registries, forges and package indexes
          "/.docker/config.json", "/.netrc", "/.git-credentials", "/.config/gh", "/.config/hub", "/.pypirc", "/.npmrc",
          "/.cargo/credentials.toml", "/.cargo/credentials", "/.gem/credentials",
          // model providers and coding agents (their keys, logins and session transcripts)
          "/.anthropic", "/.config/anthropic", "/.claude", "/.claude.json", "/.codex", "/.gemini",
          "/.config/github-copilot",
          // browsers' profiles (cookies, saved logins)
          "/.mozilla", "/.config/chromium", "/.config/google-chrome"})
      out.push_back(home + rel);
  };
  if (auto* x = std::getenv("XDG_STATE_HOME"); x && *x) out.push_back(std::string(x) + "/sandboxer");
  // Each home once: a mask given twice is two more mounts on every branch's start.
  const char* h = std::getenv("HOME");
  if (h && *h && std::string(h) != "/" && std::string(h) != "/root") add_home(h);
  add_home("/root");
  out.push_back("/etc/sandboxer/tokens");
  out.push_back("/run/sandboxer/token");
  out.push_back("/var/lib/sandboxer");
  // A pod's service-account tokens (kubernetes.io, eks.amazonaws.com, azure, ...): in the agent's
  // view beneath /var where an image's /var/run is a directory, not the usual symlink to /run
  // (the branch's own /run holds none of the host's).
  out.push_back("/var/run/secrets");
  // The host's own secrets, which root in the box read through the host's /etc: password hashes,
  // TLS private keys, the SSH daemon's host keys (with which the agent could pass for the host).
  for (const char* f : {"/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssl/private"})
    out.push_back(f);
  if (DIR* d = ::opendir("/etc/ssh")) {
    while (auto* e = ::readdir(d)) {
      std::string_view n = e->d_name;
      if (n.starts_with("ssh_host_") && n.ends_with("_key")) out.push_back("/etc/ssh/" + std::string(n));
    }
    ::closedir(d);
  }
  if (auto* t = std::getenv("SANDBOXER_TOKEN_FILE"); t && *t) out.push_back(t);
  return out;
}

// Without this check every agent of such a supervisor ended with 127 at its first step.
void check_supervisor_privileges(const profile::Profile& p) {
  auto own = own_capabilities();
  if (!own) return;  // cannot tell: the agent's start says
  uint64_t eff = own->effective;
  std::vector<std::string> missing;
  auto need = [&](int cap, const char* name) {
    if (!(eff & (1ULL << cap))) missing.push_back(name);
  };
  std::string wants;
  if (p.isolation.uid) {
    uid_t uid = *p.isolation.uid;
    gid_t gid = p.isolation.gid.value_or(uid);
    wants = "runs its agent as " + std::to_string(uid) + ":" + std::to_string(gid);
    need(CAP_SETGID, "CAP_SETGID");
    if (uid != ::geteuid()) need(CAP_SETUID, "CAP_SETUID");
  }
  if (p.isolation.capabilities) {
    wants += std::string(wants.empty() ? "" : " and ") + "narrows its capabilities";
    need(CAP_SETPCAP, "CAP_SETPCAP");
  }
  if (missing.empty()) return;
  std::string names;
  for (size_t i = 0; i < missing.size(); ++i)
    names += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + missing[i];
  throw profile::ProfileError(
      "isolation: the profile " + wants + ", which takes " + names + ", and this supervisor (uid " +
      std::to_string(::geteuid()) +
      ") does not hold them. Run it as root, or rootless in a user namespace of its own (unshare --user "
      "--map-root-user --net --pid --fork --mount-proc sandboxer-init ...), or give the profile "
      "isolation.user null and isolation.capabilities null (the agent then runs as this user, with no "
      "capabilities)");
}

void check_profile_for_host(const profile::Profile& p) {
  if (p.resources.open_files > 0) {
    struct rlimit rl {};
    ::getrlimit(RLIMIT_NOFILE, &rl);
    if (rl.rlim_max != RLIM_INFINITY && static_cast<rlim_t>(p.resources.open_files) > rl.rlim_max)
      throw profile::ProfileError("resources.open_files: " + std::to_string(p.resources.open_files) +
                                  " is above this host's hard limit " + std::to_string(rl.rlim_max) +
                                  " (raising it needs CAP_SYS_RESOURCE)");
  }
  if (p.isolation.capabilities) {
    for (size_t i = 0; i < p.isolation.capabilities->size(); ++i) {
      auto& n = (*p.isolation.capabilities)[i];
      if (n == "ALL" || n == "all") continue;
      if (!cap_number(n))
        throw profile::ProfileError("isolation.capabilities[" + std::to_string(i) + "]: unknown capability \"" + n +
                                    "\"");
    }
  }
  (void)seccomp_description(p.isolation.seccomp);  // throws naming the field
  check_supervisor_privileges(p);
}

bool shares_host_network(const profile::Profile& p, bool namespaced) {
  return p.network.mode == profile::NetworkPolicy::Mode::Host || !namespaced;
}

boost::json::object policy_to_json(const profile::Profile& p, int landlock_abi, bool host_net,
                                   const std::vector<struct sock_filter>& seccomp) {
  boost::json::object o;
  // Capabilities removed from every set and the bounding set, even when the profile keeps all.
  if (host_net) o["drop"] = boost::json::array{CAP_NET_RAW};
  o["oom_score_adj"] = 1000;
  if (p.isolation.uid) {
    o["uid"] = *p.isolation.uid;
    o["gid"] = p.isolation.gid.value_or(*p.isolation.uid);
  }
  if (p.isolation.capabilities) {
    boost::json::array caps;
    for (auto& n : *p.isolation.capabilities) {
      if (n == "ALL" || n == "all") {
        for (int c = 0; c <= cap_last(); ++c) caps.push_back(c);
        continue;
      }
      if (auto c = cap_number(n)) caps.push_back(*c);
    }
    o["caps"] = std::move(caps);
  }
  if (p.resources.open_files > 0) o["nofile"] = p.resources.open_files;
  // Landlock does not survive criu: only a tree that is never checkpointed gets it.
  if (p.isolation.landlock && p.persistence != "checkpoint" && landlock_abi > 0) {
    boost::json::array rw, ro;
    for (auto& s : p.isolation.landlock->rw) rw.emplace_back(s);
    for (auto& s : p.isolation.landlock->ro) ro.emplace_back(s);
    o["landlock"] = boost::json::object{{"rw", rw}, {"ro", ro}};
  }
  if (!seccomp.empty()) o["seccomp_bpf"] = base::base64_encode(seccomp_program_bytes(seccomp));
  return o;
}

boost::json::object describe_enforcement(const profile::Profile& p, const boost::json::object& cg, int landlock_abi,
                                         bool namespaced) {
  boost::json::object e;
  auto from_cg = [&](const char* field, bool wanted) {
    if (!wanted && !cg.contains(field)) {
      e[field] = "no ceiling in the profile";
      return;
    }
    auto* v = cg.if_contains(field);
    e[field] = v ? *v : boost::json::value("not enforced: no cgroup");
  };
  from_cg("memory", p.resources.memory > 0);
  from_cg("cpus", p.resources.cpus > 0);
  from_cg("pids", p.resources.pids > 0);
  e["open_files"] = p.resources.open_files > 0 ? "RLIMIT_NOFILE" : "inherited";
  from_cg("disk", p.resources.disk > 0);
  from_cg("devices", true);
  e["timeout"] = p.resources.timeout_ms > 0 ? "supervisor timer" : "none";
  e["idle"] = p.resources.idle_ms > 0 ? "supervisor timer (output and cgroup cpu time)" : "none";
  std::string user = p.isolation.uid
                         ? std::to_string(*p.isolation.uid) + ":" + std::to_string(p.isolation.gid.value_or(0))
                         : std::string("the supervisor's");
  if (p.isolation.uid && os::setgroups_denied())
    user +=
        "; supplementary groups the supervisor's (setgroups is denied in its user namespace, as in one an "
        "unprivileged user made)";
  e["user"] = user;
  std::string caps = p.isolation.capabilities ? "bounding set cleared to the profile's" : "the supervisor's";
  if (shares_host_network(p, namespaced))
    caps +=
        ", less CAP_NET_RAW (the agent shares the supervisor's network namespace, where the API's token crosses "
        "loopback)";
  e["capabilities"] = caps;
  e["no_new_privs"] = true;
  e["core_dumps"] = "RLIMIT_CORE=0";
  if (::geteuid() == 0)
    e["oom_score_adj"] = 1000;
  else
    e["oom_score_adj"] = "not raised: a supervisor that is not root may not write it before the agent's exec";
  if (!p.isolation.landlock)
    e["landlock"] = "not in the profile";
  else if (p.persistence == "checkpoint")
    e["landlock"] = "not applied: criu does not restore Landlock (persistence checkpoint)";
  else if (landlock_abi <= 0)
    e["landlock"] = "not enforced: the kernel has no Landlock";
  else
    e["landlock"] = "ABI " + std::to_string(landlock_abi);
  e["seccomp"] = p.isolation.seccomp == "none" ? std::string("none") : p.isolation.seccomp;
  e["filesystem"] = namespaced ? "read-only root, own /tmp and workspace, state dir and credentials masked; every "
                                 "mount nosuid,nodev (/dev's devices are binds of the host's)"
                               : "not enforced: no mount namespace";
  if (namespaced) {
    std::string ro = "/sys", masked;
    for (auto* path : kKernelReadOnlyPaths) ro += std::string(", ") + path;
    for (auto* path : kKernelMaskedPaths) masked += (masked.empty() ? "" : ", ") + std::string(path);
    e["read_only"] = ro + " (where this kernel has them)";
    e["masked"] = masked + " (where this kernel has them)";
  } else {
    e["read_only"] = e["masked"] = "not enforced: no mount namespace (the host's /proc and /sys)";
  }
  e["network"] = profile::network_mode_name(p.network.mode);
  return e;
}

PreparedPolicy prepare_policy(const boost::json::object& o) {
  PreparedPolicy p;
  p.set_oom_score = o.contains("oom_score_adj");
  if (auto* u = o.if_contains("uid")) {
    p.have_ids = true;
    p.uid = static_cast<uid_t>(u->to_number<int64_t>());
    p.gid = static_cast<gid_t>(o.at("gid").to_number<int64_t>());
    p.setgroups_denied = os::setgroups_denied();
  }
  p.cap_last = cap_last();
  auto* c = o.if_contains("caps");
  auto* drop = o.if_contains("drop");
  if (c || drop) {
    p.caps = true;
    // Only what this process has can be kept.
    auto own = own_capabilities();
    uint64_t have = own ? own->permitted : ~0ULL;
    auto mask_of = [&](const boost::json::array& list) {
      uint64_t m = 0;
      for (auto& v : list) {
        auto n = v.to_number<int64_t>();
        if (n >= 0 && n < 64 && n <= p.cap_last) m |= (1ULL << n);
      }
      return m;
    };
    // Without a list the capabilities are left as they were: all this process has for a root
    // agent (less what is dropped), none for another user (setresuid clears them).
    p.keep_mask = c ? mask_of(c->as_array()) : p.have_ids && p.uid != 0 ? 0 : ~0ULL;
    if (drop) p.keep_mask &= ~mask_of(drop->as_array());
    p.keep_mask &= have;
    // A process that holds no capability (a supervisor that is not root) has nothing to narrow,
    // and may not touch its bounding set (CAP_SETPCAP): the agent starts with none, and
    // no_new_privs keeps it from gaining any at an exec.
    if (have == 0) p.caps = false;
  }
  if (auto* n = o.if_contains("nofile")) {
    p.set_nofile = true;
    p.nofile = static_cast<uint64_t>(n->to_number<int64_t>());
  }
  if (auto* l = o.if_contains("landlock"); l && l->is_object()) p.landlock = build_landlock(l->as_object());
  // The program the supervisor built (cached_seccomp): ns-init links no libseccomp. A description
  // would mean a supervisor that expects ns-init to build it: refused, never run without a filter.
  if (o.contains("seccomp")) throw std::runtime_error("seccomp: a policy description, not a program, came to ns-init");
  if (auto* s = o.if_contains("seccomp_bpf")) {
    std::string bytes;
    std::optional<std::vector<struct sock_filter>> prog;
    if (s->is_string() && base::base64_decode(s->as_string(), bytes)) prog = seccomp_program_from(bytes);
    if (!prog) throw std::runtime_error("seccomp: the program from the supervisor is not a whole BPF program");
    p.seccomp = std::move(*prog);
  }
  return p;
}

int apply_policy(const PreparedPolicy& p, int* step) noexcept {
  auto fail = [&](int s) {
    *step = s;
    return errno ? errno : EINVAL;
  };
  // 0: the agent, not the supervisor, is the OOM killer's choice (raising needs no privilege).
  if (p.set_oom_score) {
    int fd = ::open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    // Until the exec this process is ns-init's copy, not dumpable, so its /proc/self files are
    // root's: a supervisor that is not root leaves the agent's score as its own.
    bool not_ours = fd < 0 && errno == EACCES && ::geteuid() != 0;
    if (!not_ours && (fd < 0 || ::write(fd, "1000", 4) != 4)) {
      if (fd >= 0) ::close(fd);
      return fail(0);
    }
    if (fd >= 0) ::close(fd);
  }
  // 1: the bounding set, while we still have CAP_SETPCAP.
  if (p.caps) {
    for (int c = 0; c <= p.cap_last && c < 64; ++c)
      if (!(p.keep_mask & (1ULL << c)) && ::prctl(PR_CAPBSET_DROP, c, 0, 0, 0) != 0 && errno != EINVAL) return fail(1);
  }
  bool keep_across_setuid = p.caps && p.keep_mask != 0 && p.have_ids && p.uid != 0;
  if (p.have_ids) {
    if (!p.setgroups_denied && ::setgroups(0, nullptr) != 0) return fail(2);
    if (::setresgid(p.gid, p.gid, p.gid) != 0) return fail(3);
    if (keep_across_setuid && ::prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0) return fail(4);
    if (::setresuid(p.uid, p.uid, p.uid) != 0) return fail(5);
  }
  if (p.caps) {
    struct __user_cap_header_struct hdr {
      _LINUX_CAPABILITY_VERSION_3, 0
    };
    struct __user_cap_data_struct data[2]{};
    auto lo = static_cast<uint32_t>(p.keep_mask), hi = static_cast<uint32_t>(p.keep_mask >> 32);
    data[0] = {lo, lo, lo};
    data[1] = {hi, hi, hi};
    if (::syscall(SYS_capset, &hdr, data) != 0) return fail(6);
    // A non-root agent keeps its capabilities across exec only as ambient ones.
    if (p.have_ids && p.uid != 0) {
      ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
      for (int c = 0; c <= p.cap_last && c < 64; ++c)
        if ((p.keep_mask & (1ULL << c)) && ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, c, 0, 0) != 0) return fail(7);
    }
  }
  struct rlimit none {
    0, 0
  };
  if (::setrlimit(RLIMIT_CORE, &none) != 0) return fail(8);
  if (p.set_nofile) {
    struct rlimit rl {
      p.nofile, p.nofile
    };
    if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) return fail(9);
  }
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return fail(10);
  if (p.landlock) {
    if (::syscall(SYS_landlock_restrict_self, p.landlock.get(), 0) != 0) return fail(11);
  }
  if (!p.seccomp.empty()) {
    struct sock_fprog prog {
      static_cast<unsigned short>(p.seccomp.size()), const_cast<struct sock_filter*>(p.seccomp.data())
    };
    if (::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) return fail(12);
  }
  errno = 0;
  return 0;
}

}  // namespace sbx::sandbox
