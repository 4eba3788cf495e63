#pragma once
// Whether /proc shows this process's own pid namespace, and a /proc of its own where it does not.
#include <optional>
#include <string>

#include "base/result.hpp"

namespace sbx::os {

/// The pids /proc/self/status's NSpid line gives this process, from the proc mount's pid namespace
/// down to its own: one where /proc is of this process's namespace, more where it is an
/// ancestor's (`unshare --pid --fork` without --mount-proc: the host's /proc), space-separated.
/// "" where the kernel writes no NSpid line (before Linux 4.1); nullopt where /proc/self/status
/// cannot be read (no proc, or one of a namespace this process is not in).
std::optional<std::string> proc_nspid();

/// Where /proc is not of this process's pid namespace, every /proc/PID this process opens by a pid
/// of its own names another process (the branch's /proc/PID/root, the trees it signals, criu's
/// view). Then this gives the process a mount namespace of its own, a slave of the one it was in
/// (mounts made outside still reach it; its own do not leave it), with a proc of its own pid
/// namespace on /proc, as `unshare --mount-proc` would. Returns what /proc showed before
/// (proc_nspid) when it did so, "" when /proc was already this namespace's; an error names the
/// step that failed. Where the kernel gives no NSpid, /proc is taken to be this namespace's.
base::Result<std::string> own_proc();

/// Whether this process is in the host's (the initial) user namespace, whose uid_map maps all of
/// 0..4294967294 onto itself; false in one a user made (`unshare --user`, rootless), where the
/// kernel's checks against the initial namespace (capable(): PTRACE_O_SUSPEND_SECCOMP, which criu
/// needs to dump a process under seccomp) fail whatever it holds there. Read once.
bool in_initial_user_namespace();

/// Whether setgroups(2) is denied to every process of this user namespace (its
/// /proc/self/setgroups says "deny": the rule where an unprivileged user wrote the gid_map, as
/// `unshare --map-root-user` does), so supplementary groups cannot be dropped.
bool setgroups_denied();

}  // namespace sbx::os
