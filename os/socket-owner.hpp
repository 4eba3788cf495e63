#pragma once
// Which process holds a socket: for attributing a connection the broker accepted (or a DNS
// datagram it received) inside an agent's network namespace to a process of the agent.
#include <sys/types.h>

#include <cstdint>
#include <optional>

namespace sbx::os {

/// A namespace, as the kernel names it: the device and inode of its nsfs file.
struct NsId {
  dev_t dev = 0;
  ino_t ino = 0;
};

/// The pid (in our pid namespace) of a process in the network namespace `netns` (of which
/// `ns_pid` is a process, whose /proc/PID/net is read) that holds the TCP (or UDP) socket whose
/// local port is `local_port` and, for TCP, whose remote port is `remote_port`. Best effort:
/// nullopt once the socket is gone or when nothing matches.
std::optional<pid_t> socket_owner(pid_t ns_pid, NsId netns, bool tcp, uint16_t local_port, uint16_t remote_port);

}  // namespace sbx::os
