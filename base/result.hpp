#pragma once
// The error convention (docs/errors.md): an expected failure is a value, `Result<T>`, whose error
// says what went wrong in words a person can act on ("<operation> <object>: <reason>") and, where
// the failure reaches a client, a stable code. Syscall-level code returns os::Result<T>, whose
// error is the errno as a std::error_code; exceptions are for programming errors and for parsing
// at start-up, caught once per thread or callback at its boundary.
#include <boost/system/result.hpp>
#include <string>
#include <system_error>
#include <utility>

namespace boost {
struct source_location;
}

namespace sbx::base {

struct Error {
  Error() = default;
  // Both parts, always (fail() supplies the usual code): an Error constructible from one string
  // would make every `return some_string;` into a Result<std::string> ambiguous.
  Error(std::string m, std::string c) : message(std::move(m)), code(std::move(c)) {}
  std::string message;          // "<operation> <object>: <reason>", never a secret
  std::string code = "failed";  // stable, for programs: bad_request, not_found, untrusted, ...
};

template <class T>
using Result = boost::system::result<T, Error>;

/// An Error with `message` and `code`.
inline Error fail(std::string message, std::string code = "failed") {
  return Error{std::move(message), std::move(code)};
}

/// "<what>: <strerror(err)>" for a failed system call.
Error sys_fail(const std::string& what, int err, std::string code = "failed");
Error sys_fail(const std::string& what, std::error_code ec, std::string code = "failed");

/// What Result<T>::value() throws when it holds an Error: a programming error (the caller did not
/// check), reported with the Error's message.
[[noreturn]] void throw_exception_from_error(const Error& e, const boost::source_location& loc);

}  // namespace sbx::base
