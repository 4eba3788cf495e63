// sandboxer-ns-init: PID 1 of a branch's pid namespace (sandbox/ns-init.hpp), a program of its own
// so that the exec every branch pays loads little (sandbox/CMakeLists.txt). sandboxer-init execs
// it as `ns-init [--flat]`; it takes nothing else, and its config arrives on fd 3.
#include <unistd.h>

#include <cstring>

#include "os/signal-mask.hpp"
#include "sandbox/ns-init.hpp"

int main(int argc, char** argv) {
  // Before anything else, as sandboxer-init does: a SIGTERM from now on waits for the signalfd.
  sbx::os::block_handled_signals();
  bool flat = argc == 2 && std::strcmp(argv[1], "--flat") == 0;
  if (argc > 2 || (argc == 2 && !flat)) {
    static constexpr char kUsage[] = "usage: sandboxer-ns-init [--flat]   (started by sandboxer-init, not by hand)\n";
    (void)!::write(2, kUsage, sizeof kUsage - 1);
    return 125;
  }
  return sbx::sandbox::ns_init_main(flat);
}
