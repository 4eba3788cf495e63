// sandboxer-ns-init: PID 1 of a branch's pid namespace (sandbox/ns-init.hpp), a program of its own
// so that the exec every branch pays loads little (sandbox/CMakeLists.txt). sandboxer-init execs
// it as `ns-init [--flat]`; it takes nothing else, and its config arrives on fd 3.
#include <unistd.h>

#include <cstring>

#include "os/signal-mask.hpp"
#include "sandbox/ns-init.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SBX_NS_INIT_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(SBX_NS_INIT_ASAN)
// The sanitizer build (scripts/sanitize): no leak check at ns-init's exit. LeakSanitizer stops the
// process for it from a clone of its own that ptraces it and waits, and the parent spins until the
// clone is done (google/sanitizers#777, #1330: a hang where the tracer never finishes). Once, in
// this suite, ns-init (PID 1 of its branch's pid namespace, its supervisor killed) spun so with its
// tracer in wait4, a CPU burnt for the rest of the run. ASan's checks of every access stay on.
extern "C" int __lsan_is_turned_off() { return 1; }
#endif

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
