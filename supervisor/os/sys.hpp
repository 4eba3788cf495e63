#pragma once
// Thin, non-throwing helpers over syscalls. Errors come back as boost::system::result.
#include <sys/types.h>

#include <boost/system/result.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "os/unique-fd.hpp"

namespace sbx::os {

template <class T>
using Result = boost::system::result<T>;

/// An error_code from errno as it is now.
boost::system::error_code last_error() noexcept;

/// A pipe with both ends close-on-exec; `flags` adds O_NONBLOCK etc.
Result<Pipe> make_pipe(int flags = 0) noexcept;

/// Writes all of `data`, retrying on EINTR and short writes (blocking fds).
Result<void> write_all(int fd, std::string_view data) noexcept;

/// Reads until EOF (blocking fd).
Result<std::string> read_all(int fd);

/// Reads a whole file.
Result<std::string> read_file(const std::string& path);

/// Writes a whole file atomically: a temporary beside it, then rename.
Result<void> write_file_atomic(const std::string& path, std::string_view data, mode_t mode = 0644);

/// mkdir -p.
Result<void> make_dirs(const std::string& path, mode_t mode = 0755);

Result<void> set_nonblocking(int fd, bool on = true) noexcept;

/// The pids of the direct children of `pid` (all threads), from /proc/PID/task/*/children.
std::vector<pid_t> children_of(pid_t pid);

/// Every descendant of `pid` (not `pid` itself), parents before their children; at most `limit`.
std::vector<pid_t> descendants_of(pid_t pid, size_t limit = 100000);

/// This process's executable (/proc/self/exe), and the directory it is in ("" / "." if unknown).
std::string exe_path();
std::string exe_dir();

/// Random bytes as lowercase hex (getrandom).
std::string random_hex(size_t bytes);

/// The name of a signal without "SIG" ("TERM"), or its number as text.
std::string signal_name(int sig);
/// Parses "TERM", "SIGTERM" or "15"; nullopt if unknown.
std::optional<int> parse_signal(std::string_view s);

}  // namespace sbx::os
