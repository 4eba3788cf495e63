#include "base/result.hpp"

#include <boost/assert/source_location.hpp>
#include <cstring>
#include <stdexcept>

namespace sbx::base {

Error sys_fail(const std::string& what, int err, std::string code) {
  return Error{what + ": " + std::strerror(err), std::move(code)};
}

Error sys_fail(const std::string& what, std::error_code ec, std::string code) {
  return Error{what + ": " + ec.message(), std::move(code)};
}

void throw_exception_from_error(const Error& e, const boost::source_location&) {
  throw std::logic_error("unchecked Result holds an error: " + e.message);
}

}  // namespace sbx::base
