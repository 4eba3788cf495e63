// sandboxer-init: PID 1 of a sandbox box. The only code not linked into the tests.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include "archive/archive.hpp"
#include "archive/signing.hpp"
#include "loop/finish.hpp"
#include "os/proc-view.hpp"
#include "os/signal-mask.hpp"
#include "os/sys.hpp"
#include "sandbox/ns-init.hpp"
#include "supervisor/box.hpp"
#include "supervisor/health.hpp"
#include "supervisor/heap.hpp"
#include "supervisor/options.hpp"
#include "supervisor/signals.hpp"

using namespace sbx::supervisor;

namespace {

// The archive keys (archive/signing.hpp): the signing key (given, else the user's pair, made at
// the box's first checkpoint when this user has none yet), masked from the agent with the user's
// key dir; the trusted keys; the size bound. Only the files are checked here: the keys are parsed,
// or made, at the first checkpoint, import or restore (archive::ArchiveKeys), so a box that makes
// none never loads OpenSSL, even the first box of a user.
bool load_keys(const InitOptions& o, BoxOptions& bo) {
  std::string signing = o.signing_key;
  std::string user_dir = sbx::archive::user_key_dir();
  bool users_key = false;
  if (signing.empty()) {
    if (auto p = sbx::archive::ensure_user_key(user_dir, sbx::archive::UserKey::Check)) {
      signing = *p;
      users_key = true;
    } else {
      // No key store (a read-only home, say): a key of this box alone, so its own checkpoints
      // still restore; another box trusts them only when given its key, which nobody has.
      spdlog::warn(
          "the user's archive key: {}; this box signs with a key of its own (give one with "
          "--signing-key FILE)",
          p.error().message);
    }
  }
  bo.keys =
      std::make_shared<const sbx::archive::ArchiveKeys>(signing, o.trust_keys, users_key ? user_dir : std::string());
  if (auto r = bo.keys->check_files(); !r) {
    spdlog::critical("{}", r.error().message);
    return false;
  }
  // The key, and the user's key dir (whatever key this box was given: another box's agent must
  // not read the pair every box of this user trusts).
  if (!signing.empty() && !signing.starts_with(user_dir + "/")) bo.masks.push_back(signing);
  struct stat st {};
  if (::stat(user_dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) bo.masks.push_back(user_dir);
  bo.allow_unsigned = o.allow_unsigned;
  if (!o.max_archive_bytes.empty()) {
    try {
      auto n = sbx::profile::parse_size(o.max_archive_bytes, "--max-archive-bytes");
      if (n <= 0) throw std::invalid_argument("--max-archive-bytes " + o.max_archive_bytes + ": must be above 0");
      bo.max_archive_bytes = static_cast<uint64_t>(n);
    } catch (const std::exception& e) {
      spdlog::critical("{}", e.what());
      return false;
    }
  }
  spdlog::debug("archives: signed with {}, {} more trusted key(s){}", signing.empty() ? "a key of this box" : signing,
                o.trust_keys.size(), bo.allow_unsigned ? ", unsigned ones accepted (cold)" : "");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread exists: every thread inherits the mask, so the signalfd sees them all.
  sbx::os::block_handled_signals();

  InitOptions o;
  try {
    o = parse_init_options(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "sandboxer-init: " << e.what() << "\n" << kInitUsage;
    return 125;
  }
  // The agent's command came from there: the agent does not see it, even with --env-inherit.
  if (!o.command_env.empty()) ::unsetenv(o.command_env.c_str());
  if (o.mode == InitOptions::NsInit) return sbx::sandbox::ns_init_main(o.flat);
  if (o.mode == InitOptions::Version) {
    std::cout << "sandboxer-init " << SBX_VERSION << "\n";
    return 0;
  }
  if (o.mode == InitOptions::Health) return health_main();
  if (o.mode == InitOptions::Help) {
    std::cout << kInitUsage;
    return 0;
  }

  tune_heap();
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("sandboxer-init", sink);
  logger->set_pattern("sandboxer-init: %^%l%$ [%n] %v");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(o.log_level));

  // Not dumpable: opening our /proc/PID/mem, environ or fd/, ptrace and process_vm_readv then
  // need CAP_SYS_PTRACE, whatever else a process of the same user holds. Without it, an agent that
  // can see us (a box without namespaces) and holds our capabilities (a container without added
  // ones, where the profile keeps Docker's defaults) could read the token from our memory or write
  // into it. Children get the flag back at their exec.
  if (::prctl(PR_SET_DUMPABLE, 0) != 0) {
    spdlog::critical("make the supervisor non-dumpable: {}", std::strerror(errno));
    return 125;
  }
  if (::getpid() != 1 && ::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    spdlog::critical("become a child subreaper (not PID 1): {}; orphans of the agent could not be reaped",
                     std::strerror(errno));
    return 125;
  }

  // PID 1 of a pid namespace under the host's /proc (`unshare --pid --fork` without --mount-proc):
  // /proc/PID by our pids named host processes, so the branch's /tmp was a host process's root.
  if (auto proc = sbx::os::own_proc(); !proc) {
    spdlog::critical("{} (give the box a proc of its pid namespace: unshare --mount-proc, or a container)",
                     proc.error().message);
    return 125;
  } else if (!proc->empty()) {
    spdlog::info(
        "/proc was another pid namespace's ({}): the supervisor mounted its own, in a mount namespace of its own",
        *proc);
  }

  BoxOptions bo;
  try {
    bo.profile = sbx::profile::load_profile(o.profile);
    for (auto& s : o.overrides) sbx::profile::apply_override(bo.profile, s);
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    return 125;
  }
  try {
    bo.metrics_ms = o.metrics_interval.empty() ? bo.profile.metrics.interval_ms
                    : o.metrics_interval == "0"
                        ? 0
                        : sbx::profile::parse_duration_ms(o.metrics_interval, "--metrics-interval");
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    return 125;
  }
  // The token never stays in our environment: processes we start must not inherit it.
  if (char* t = std::getenv("SANDBOXER_TOKEN")) {
    bo.token = t;
    // unsetenv only unlinks the string: the bytes stay in the initial environment block that
    // /proc/PID/environ shows, so overwrite them first.
    std::memset(t, 'x', std::strlen(t));
    ::unsetenv("SANDBOXER_TOKEN");
  }
  if (!o.token_file.empty()) {
    auto t = sbx::os::read_file(o.token_file);
    if (!t) {
      spdlog::critical("read --token-file {}: {}", o.token_file, t.error().message());
      return 125;
    }
    bo.token = *t;
    while (!bo.token.empty() && (bo.token.back() == '\n' || bo.token.back() == '\r' || bo.token.back() == ' '))
      bo.token.pop_back();
    bo.masks.push_back(o.token_file);
  }
  if (!load_keys(o, bo)) return 125;
  if (!o.listen.empty() && bo.token.empty()) {
    spdlog::critical("--listen needs a token: --token-file FILE or SANDBOXER_TOKEN (empty tokens are refused)");
    return 125;
  }
  bo.listen = o.listen;
  bo.tls_cert = o.tls_cert;
  bo.tls_key = o.tls_key;
  // The TLS key is the server's secret, as the token is: the agent sees neither file.
  for (auto* f : {&o.tls_cert, &o.tls_key})
    if (!f->empty()) bo.masks.push_back(*f);
  bo.env = o.env;
  bo.env_inherit = o.env_inherit;
  bo.argv = o.argv;
  bo.idle = o.idle;
  bo.restore_file = o.restore_file;
  bo.restore_index = o.restore_index;
  bo.events_path = o.events;
  bo.workdir = o.workdir;
  bo.self_exe = sbx::os::exe_path();
  // A container's init says where it serves, for `--health` (the image's HEALTHCHECK).
  if (::getpid() == 1) {
    if (auto path = health_file_path())
      bo.health_file = *path;
    else
      spdlog::warn("no health file: {}", path.error().message);
  }
  bo.state_dir = o.state_dir.empty() ? sbx::os::default_box_root() + "/" + sbx::os::random_hex(6) : o.state_dir;

  uv_loop_t loop;
  uv_loop_init(&loop);
  int status;
  {
    Box box(&loop, std::move(bo));
    status = box.run();
  }
  if (auto r = sbx::loop::finish(&loop); !r) spdlog::warn("{}", r.error().message);
  return status;
}
