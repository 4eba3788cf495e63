#include "protocol/probe.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "os/unique-fd.hpp"

namespace sbx::protocol {

namespace {

using Clock = std::chrono::steady_clock;

int remaining_ms(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms > 0 ? static_cast<int>(ms) : 0;
}

}  // namespace

base::Result<void> probe_websocket(const std::string& addr, int port, int timeout_ms, const std::string& token) {
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  sockaddr_storage ss{};
  socklen_t len = 0;
  std::string host = addr == "0.0.0.0" ? "127.0.0.1" : addr == "::" ? "::1" : addr;
  if (auto* a4 = reinterpret_cast<sockaddr_in*>(&ss); ::inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(static_cast<uint16_t>(port));
    len = sizeof *a4;
  } else if (auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
             ::inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof *a6;
  } else {
    return base::fail("address " + addr + ": not a numeric IPv4 or IPv6 address");
  }
  os::UniqueFd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) return base::fail(std::string("socket: ") + std::strerror(errno));
  std::string where = host + ":" + std::to_string(port);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    if (errno != EINPROGRESS) return base::fail("connect " + where + ": " + std::strerror(errno));
    pollfd p{fd.get(), POLLOUT, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return base::fail("connect " + where + ": no answer in time");
    int err = 0;
    socklen_t el = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &el);
    if (err) return base::fail("connect " + where + ": " + std::strerror(err));
  }
  // An HTTP request, not WebSocket framing: the probe stops at the handshake's status line.
  std::string req = "GET / HTTP/1.1\r\nHost: " + where +
                    "\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    "Sec-WebSocket-Key: c2FuZGJveGVyLWhlYWx0aA==\r\nSec-WebSocket-Version: 13\r\n"
                    "Sec-WebSocket-Protocol: sandboxer.v1\r\n" +
                    (token.empty() ? std::string() : "Authorization: Bearer " + token + "\r\n") + "\r\n";
  size_t off = 0;
  while (off < req.size()) {
    ssize_t n = ::send(fd.get(), req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) return base::fail("send to " + where + ": " + std::strerror(errno));
    pollfd p{fd.get(), POLLOUT, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return base::fail("send to " + where + ": timed out");
  }
  std::string got;
  while (got.find("\r\n") == std::string::npos && got.size() < 512) {
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, remaining_ms(deadline)) <= 0) return base::fail(where + ": no HTTP answer in time");
    char buf[256];
    ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
    if (n == 0) return base::fail(where + ": closed without an answer");
    if (n < 0 && errno != EAGAIN && errno != EINTR)
      return base::fail("recv from " + where + ": " + std::strerror(errno));
    if (n > 0) got.append(buf, static_cast<size_t>(n));
  }
  std::string status = got.substr(0, got.find("\r\n"));
  // 503: the server answers, with its unauthenticated slots full (anyone who reaches the port can
  // fill them): that is load, not a dead supervisor.
  if (!token.empty()) {
    if (status.starts_with("HTTP/1.1 101")) return {};
    if (status.starts_with("HTTP/1.1 401"))
      return base::fail(where + " refused the token (401): another server than the box answers there", "unauthorized");
  } else if (status.starts_with("HTTP/1.1 101") || status.starts_with("HTTP/1.1 401") ||
             status.starts_with("HTTP/1.1 503")) {
    return {};
  }
  return base::fail(where + " answered \"" + status + "\", not a WebSocket upgrade");
}

}  // namespace sbx::protocol
