#pragma once
// The egress broker: the only way out of an agent's network namespace in `network: proxy` mode.
//
// Its listening sockets are created inside the agent's namespace (see network.hpp) and served
// here, on the supervisor's side, so every connection it makes leaves from the supervisor's
// namespace. It serves, on one TCP port:
//   - CONNECT host:port tunnels to allowed hosts (bytes relayed, no TLS interception);
//   - absolute-form plain HTTP (`GET http://host/...`) to allowed hosts, read and forwarded;
//   - the credential endpoint `/<credential>/<path>`: forwarded over TLS to the credential's
//     binding with the real secret injected (caller-supplied auth headers stripped);
// and a DNS resolver on port 53 (UDP, and TCP when given a socket) that answers only for allowed
// names.
//
// Boost.Beast parses and writes HTTP, Boost.Asio with OpenSSL does the sockets and TLS, on an
// io_context of the broker's own thread; refusals go out through the sink (on that thread).
#include <sys/types.h>

#include <boost/json.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "os/socket-owner.hpp"
#include "os/unique-fd.hpp"
#include "profile/profile.hpp"

namespace sbx::broker {

struct BrokerConfig {
  profile::NetworkPolicy network;
  std::vector<profile::Credential> credentials;
  std::vector<std::string> secrets;  // the real values, by index of `credentials`
  std::string proc = "main";         // whom refusals are reported for
  pid_t netns_pid = -1;              // a process in the agent's network namespace (ns-init)
  os::NsId netns;                    // that namespace (ns-init is not dumpable: its /proc/PID/ns
                                     // is closed to a supervisor without CAP_SYS_PTRACE)
};

class Broker {
 public:
  /// Called on the broker's thread with each event (a `policy.denied`, without seq/ts/box).
  using Sink = std::function<void(boost::json::object)>;

  /// Starts serving `tcp` (a listening stream socket), `udp` (a bound datagram socket, or none)
  /// and `dns_tcp` (a listening stream socket for DNS over TCP, or none) on a thread of its own.
  /// Throws std::runtime_error naming what failed (a ca_file that cannot be read, for one).
  Broker(BrokerConfig cfg, os::UniqueFd tcp, os::UniqueFd udp, Sink sink, os::UniqueFd dns_tcp = {});
  /// Stops serving and joins the thread.
  ~Broker();
  Broker(const Broker&) = delete;
  Broker& operator=(const Broker&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sbx::broker
