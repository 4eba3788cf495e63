#pragma once

namespace sbx::sandbox {

/// The ns-init mode of sandboxer-init: PID 1 of a branch's pid namespace (or, with `flat`, a
/// child subreaper). Reaps the agent's orphans, forwards signals to the agent's process group,
/// runs the shutdown (TERM, grace, KILL) and reports the agent's raw wait status. See launcher.hpp
/// for its fds.
int ns_init_main(bool flat);

}  // namespace sbx::sandbox
