#pragma once
// The wire format of the WebSocket API (tests/protocol/README.md, docs/architecture.md): parsing one request
// frame with errors that name the problem, and the binary frame header for file content.
// Pure code: the server and the fuzz target use it.
#include <boost/json.hpp>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace sbx::protocol {

inline constexpr const char* kSubprotocol = "sandboxer.v1";
inline constexpr size_t kMaxTextFrame = 1u << 20;
inline constexpr size_t kMaxBinaryData = 1u << 20;
inline constexpr size_t kBinaryHeader = 13;  // u32 id, u64 offset, u8 flags; little-endian
inline constexpr uint8_t kFlagLast = 1;
/// The most either end's libwebsockets hands to one send() (its protocol's tx_packet_size): above
/// any frame either sends. Left at 0, lws caps a send at the protocol's rx_buffer_size (64 KiB)
/// and copies the rest of a larger frame into a buffer of its own, sent in later turns.
inline constexpr size_t kSendBytes = 16u << 20;

// Close codes.
inline constexpr int kCloseUnauthorized = 4401;
inline constexpr int kCloseTooSlow = 4008;
inline constexpr int kCloseTooBig = 1009;  // RFC 6455: a message too big to process

/// A refused request: `code` is stable (for programs), `message` says what was wrong.
struct RequestError : std::runtime_error {
  RequestError(std::string c, const std::string& m) : std::runtime_error(m), code(std::move(c)) {}
  std::string code;
};

struct Request {
  boost::json::value id;  // echoed in the reply; null when absent
  std::string op;
  boost::json::object fields;
};

/// Parses a text frame. Throws RequestError (with `id_out` set to the id if one was readable).
Request parse_request(std::string_view text, boost::json::value* id_out = nullptr);

/// The id of a request too large to parse (frame_too_large), where its text begins with it:
/// `{"id": 7, ...` or `{"id": "r7", ...`, as the SDKs and most clients write one. An integer or a
/// string of at most 256 bytes, as parse_request takes; null otherwise (the reply then has none).
boost::json::value leading_id(std::string_view text);

// Field accessors: each throws RequestError("bad_request", "field F: ...") on a wrong type.
std::optional<std::string> opt_string(const boost::json::object& o, std::string_view key);
std::string need_string(const boost::json::object& o, std::string_view key);
std::optional<int64_t> opt_int(const boost::json::object& o, std::string_view key, int64_t min, int64_t max);
std::optional<bool> opt_bool(const boost::json::object& o, std::string_view key);
std::vector<std::string> need_string_array(const boost::json::object& o, std::string_view key);
/// `key`_b64 where a request gives it (not null), else nullptr; a request giving both `key` and
/// `key`_b64 is refused ("give one of them, not both").
const boost::json::value* b64_twin(const boost::json::object& o, std::string_view key);
/// A path (or any name of bytes on disk): `key` as JSON text, or its bytes in `key`_b64 where
/// they are not UTF-8 (as fs.list gives a name); one of the two, not both. A reply writes one
/// with base::put_bytes_field.
std::optional<std::string> opt_path(const boost::json::object& o, std::string_view key);
std::string need_path(const boost::json::object& o, std::string_view key);
/// A list of such names (exec's argv): `key`, an array of text, or `key`_b64, an array of each
/// item's base64; one of the two.
std::vector<std::string> need_path_list(const boost::json::object& o, std::string_view key);
/// A duration: a number of seconds, or a string "3s", "500ms".
std::optional<int64_t> opt_duration_ms(const boost::json::object& o, std::string_view key);

boost::json::object ok_reply(const boost::json::value& id);
boost::json::object error_reply(const boost::json::value& id, std::string_view code, std::string_view message);
/// A reply from a body built later ({"ok": ..., ...}, as the box's snapshot operations answer):
/// the request's id first, then the body, with "ok": true added unless the body says.
boost::json::object reply_with_id(const boost::json::value& id, const boost::json::object& body);

struct BinaryHeader {
  uint32_t id = 0;
  uint64_t offset = 0;
  uint8_t flags = 0;
  bool last() const noexcept { return flags & kFlagLast; }
};
/// Appends the header to `out`.
void put_header(std::string& out, const BinaryHeader& h);
/// Reads the header of a binary frame; nullopt when shorter than the header.
std::optional<BinaryHeader> get_header(std::string_view frame);

/// Puts the bytes `v` into `o` as `key` when they are valid UTF-8 (`known_utf8`: the caller
/// checked), else as `key`_b64 alone: a request's path (opt_path takes it back), an event's data.
void put_text_or_b64(boost::json::object& o, std::string_view key, std::string_view v, bool known_utf8 = false);
/// A list so (a request's argv): `key`, an array of text, where every item is UTF-8, else
/// `key`_b64 alone, an array of every item's base64 (need_path_list takes it back).
void put_list_text_or_b64(boost::json::object& o, std::string_view key, const std::vector<std::string>& v);
/// put_text_or_b64 as "data" / "data_b64".
void put_bytes(boost::json::object& ev, std::string_view data, bool known_utf8 = false);

}  // namespace sbx::protocol
