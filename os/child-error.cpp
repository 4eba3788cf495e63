#include "os/child-error.hpp"

#include <unistd.h>

#include <cerrno>

namespace sbx::os {

SBX_OWN_STACK void child_fail(int fd, int step, int err, int detail) noexcept {
  ChildError e{step, err, detail};
  (void)!::write(fd, &e, sizeof e);
  ::_exit(127);
}

std::optional<ChildError> read_child_error(int fd) noexcept {
  ChildError e;
  ssize_t n;
  do n = ::read(fd, &e, sizeof e);
  while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof e)) return std::nullopt;
  return e;
}

}  // namespace sbx::os
