#pragma once
// A forked child's failure before exec (docs/errors.md, section 4): the child cannot log or
// allocate, so it writes which step failed and errno to a close-on-exec pipe and exits 127; the
// parent reads the pipe, which closes empty when exec succeeded.
#include <optional>

namespace sbx::os {

/// What the child reports: the step that failed (the caller's own numbering), its errno, and a
/// detail where a step has parts (which operation of a mount plan, of a policy).
struct ChildError {
  int step = 0;
  int err = 0;
  int detail = 0;
};

/// For the functions a child runs on a stack of its own (a clone with CLONE_VM, as
/// sandbox/launcher.cpp's): AddressSanitizer knows only the thread's stack, and at every call of a
/// noreturn function on another one it warns that it ignores the call, and that false reports may
/// follow. These children make plain syscalls, with nothing for it to check.
#define SBX_OWN_STACK __attribute__((no_sanitize("address")))

/// In the child: writes the error to `fd` (the pipe's write end) and calls _exit(127).
/// Async-signal-safe: no allocation, no logging.
[[noreturn]] SBX_OWN_STACK void child_fail(int fd, int step, int err, int detail = 0) noexcept;

/// In the parent, once its copy of the write end is closed: waits until the child has exec'd (the
/// pipe closes empty: nullopt) or has reported a failure.
std::optional<ChildError> read_child_error(int fd) noexcept;

}  // namespace sbx::os
