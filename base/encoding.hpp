#pragma once
// Text encodings: UTF-8 validity, base64, hex, and the time stamps events carry.
#include <boost/json.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sbx::base {

/// RFC 3339 UTC with microseconds: 2026-11-21T23:58:47.123456Z.
std::string rfc3339_now();
/// The same of a time since the epoch (seconds, nanoseconds).
std::string rfc3339(int64_t sec, long nsec);

/// Length of the longest prefix of `s` that is valid UTF-8 (RFC 3629: no overlongs, no
/// surrogates, nothing above U+10FFFF).
size_t utf8_valid_prefix(std::string_view s) noexcept;

/// `s` with each byte that does not begin or continue valid UTF-8 replaced by U+FFFD: text a
/// peer may show, from bytes the agent chose (a file's name in an error message).
std::string utf8_lossy(std::string_view s);

/// How many bytes at the end of `s` are the start of a multi-byte sequence that could still be
/// completed by more input (0..3). Only meaningful when everything before them is valid.
size_t utf8_incomplete_tail(std::string_view s) noexcept;

/// Appends the JSON text of `v` to `out`: byte for byte what boost::json::serialize writes where
/// every string is UTF-8 (but for its C1 controls, below), in one pass over strings (Boost 1.81's
/// serializer copies a string byte by byte after its first escape, and every line of an agent's
/// output has one, its newline). Where a string is not UTF-8, each byte that does not begin or
/// continue a valid sequence is written as U+FFFD, where boost writes it as it is: the text is
/// always UTF-8, which every client's parser requires (a name the agent chose, quoted by an error
/// message, would otherwise make every reader of the journal from there on close with 1007). Each
/// C1 control (U+0080..U+009F), which JSON may carry raw and some terminals act on (U+009B as
/// ESC [), is written as its \u escape, as json_escape_c1 does: the same string to every parser,
/// and nothing the agent wrote acts on a terminal that shows the journal or `--events -`. The
/// journal writes every event through this; the server its replies, and the agent channel its
/// lines (json_text).
void json_append(std::string& out, const boost::json::value& v);
void json_append(std::string& out, const boost::json::object& o);
std::string json_text(const boost::json::object& o);
/// JSON text with each C1 control (U+0080..U+009F, UTF-8 C2 80..C2 9F) written as its \u escape:
/// the same JSON, safe in a terminal (for text another writer made, such as boost::json's).
std::string json_escape_c1(std::string_view json);

std::string base64_encode(std::string_view in);
/// Decodes standard base64 (padding optional); false on any invalid character.
bool base64_decode(std::string_view in, std::string& out);

/// Bytes that need not be UTF-8 (a path, a program's argument, an environment entry) in a JSON
/// object: `key` as text where they are UTF-8; else `key` with U+FFFD for each byte that is not,
/// for whoever shows it, and `key`_b64 with the bytes. A list is one field: `key`, an array of
/// each item's text as above, and where any item is not UTF-8, `key`_b64, an array of every
/// item's base64.
void put_bytes_field(boost::json::object& o, std::string_view key, std::string_view v);
void put_bytes_list(boost::json::object& o, std::string_view key, const std::vector<std::string>& v);
/// The inverse: `key`_b64's bytes where it is there, else `key`'s text; nullopt where neither
/// is. std::invalid_argument naming the field where one is not of its type or not base64.
std::optional<std::string> get_bytes_field(const boost::json::object& o, std::string_view key);
std::optional<std::vector<std::string>> get_bytes_list(const boost::json::object& o, std::string_view key);

}  // namespace sbx::base
