#pragma once
// The broker's reading of a request's target and headers: pure functions, no I/O, so that the
// unit tests and the libFuzzer target (tests/fuzz/fuzz_broker.cpp) reach every branch.
#include <string>
#include <string_view>

namespace sbx::egress {

/// host[:port] from an authority or CONNECT target (IPv6 in brackets); false for anything else
/// (an empty host, userinfo, a port that is not 1..65535 in decimal).
bool split_authority(std::string_view a, std::string& host, int& port, int default_port);

/// Whether a path could leave the prefix it is appended to: a "." or ".." segment, plain or
/// percent-encoded, an encoded slash, or a backslash (which some servers read as a slash).
bool escapes_prefix(std::string_view path);

/// Whether a Content-Encoding or Transfer-Encoding value names a coding other than identity (and,
/// for `transfer`, chunked, which the parser undoes): a body coded so is bytes no scrub can search.
bool coded(std::string_view value, bool transfer);

/// What an origin- or absolute-form target asks of the broker.
struct Target {
  enum class Kind { Plain, Credential, Bad };
  Kind kind = Kind::Bad;
  std::string authority;   // Plain: host[:port] as sent
  std::string path;        // Plain: the path and query to send upstream ("/" at least)
  std::string credential;  // Credential: the first segment
  std::string rest;        // Credential: what follows it ("/" at least)
  bool own_url = false;    // Credential reached through the broker's own absolute URL
};

/// Reads a request target: `http://host[:port]/path` is plain HTTP unless it names the broker
/// itself (127.0.0.1 or localhost at `proxy_port`), which, like `/name/rest`, is the credential
/// route; anything else is Bad.
Target route_target(std::string_view target, int proxy_port);

}  // namespace sbx::egress
