// libFuzzer target: one WebSocket text frame through the request parser and every field accessor
// the server uses. Any crash, leak or sanitizer report is a bug; RequestError is the expected way out.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "protocol/protocol.hpp"

using namespace sbx::protocol;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    auto r = parse_request(text);
    const auto& f = r.fields;
    auto guarded = [](auto fn) {
      try {
        fn();
      } catch (const RequestError&) {
      }
    };
    guarded([&] { (void)opt_string(f, "proc"); });
    guarded([&] { (void)need_string(f, "path"); });
    guarded([&] { (void)opt_int(f, "since", 0, INT64_MAX); });
    guarded([&] { (void)opt_int(f, "cols", 1, 10000); });
    guarded([&] { (void)opt_bool(f, "tty"); });
    guarded([&] { (void)need_string_array(f, "argv"); });
    guarded([&] { (void)opt_duration_ms(f, "grace"); });
  } catch (const RequestError&) {
  }
  if (auto h = get_header(text)) {
    std::string out;
    put_header(out, *h);
    if (out.size() != kBinaryHeader) __builtin_trap();
  }
  return 0;
}
