#pragma once
// The signal mask of the supervisor and of its children: which signals are blocked (read from a
// signalfd instead), and the clean slate a child gets before exec.
#include <signal.h>

namespace sbx::os {

/// The signals the supervisor handles: blocked at start, before any thread exists.
const sigset_t& handled_signals();
/// Blocks handled_signals() in the calling thread (call first thing in main).
void block_handled_signals();
/// Restores an empty mask and default dispositions: for a child between fork and exec.
/// Async-signal-safe.
void reset_signals_for_child() noexcept;

}  // namespace sbx::os
