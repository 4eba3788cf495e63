// The request parser, the agent channel's parser and replies, and the binary header against the
// shared protocol vectors (tests/protocol/), and the client URL parser of sdk/cpp.
#include <doctest/doctest.h>

#include <boost/json.hpp>
#include <sandboxer/client.hpp>

#include "os/sys.hpp"
#include "protocol/channel.hpp"
#include "protocol/protocol.hpp"

namespace protocol = sbx::protocol;

namespace {
boost::json::value load_value(const std::string& name) {
  auto text = sbx::os::read_file(std::string(SBX_PROTOCOL_VECTORS) + "/" + name);
  REQUIRE(text);
  return boost::json::parse(*text);
}
boost::json::array load(const std::string& name) { return load_value(name).as_array(); }
boost::json::array channel_vectors(const char* part) { return load_value("channel.json").at(part).as_array(); }
}  // namespace

TEST_CASE("protocol: every valid request vector parses to the vector's op, id and fields") {
  int checked = 0;
  for (auto& v : load("requests.json")) {
    auto& o = v.as_object();
    if (!o.at("valid").as_bool()) continue;
    CAPTURE(o.at("name"));
    auto& expect = o.at("expect").as_object();
    auto r = protocol::parse_request(o.at("text").as_string());
    CHECK(r.op == expect.at("op").as_string());
    CHECK(r.id == expect.at("id"));
    // The parsed object keeps id and op beside the op's own fields; every other key is expected.
    auto fields = r.fields;
    fields.erase("id");
    fields.erase("op");
    CHECK(fields == expect.at("fields").as_object());
    ++checked;
  }
  CHECK(checked >= 19);
}

TEST_CASE("protocol: frames that are not requests fail with the vector's code") {
  for (auto& v : load("requests.json")) {
    auto& o = v.as_object();
    if (o.at("valid").as_bool()) continue;
    std::string code(o.at("code").as_string());
    if (code != "bad_json" && code != "unknown_op") continue;  // the rest needs the server
    CAPTURE(o.at("name"));
    if (code == "unknown_op") {
      CHECK_NOTHROW(protocol::parse_request(o.at("text").as_string()));
      continue;
    }
    boost::json::value id;
    try {
      protocol::parse_request(o.at("text").as_string(), &id);
      FAIL("parsed");
    } catch (const protocol::RequestError& e) {
      CHECK(e.code == code);
      CHECK(id == o.at("id"));
    }
  }
}

TEST_CASE("protocol: binary headers match the vectors both ways") {
  for (auto& v : load("binary.json")) {
    auto& o = v.as_object();
    CAPTURE(o.at("name"));
    protocol::BinaryHeader h{static_cast<uint32_t>(o.at("id").to_number<uint64_t>()),
                             o.at("offset").to_number<uint64_t>(),
                             static_cast<uint8_t>(o.at("flags").to_number<uint64_t>())};
    std::string out;
    protocol::put_header(out, h);
    static const char* hex = "0123456789abcdef";
    std::string got;
    for (unsigned char c : out) {
      got.push_back(hex[c >> 4]);
      got.push_back(hex[c & 15]);
    }
    CHECK(got == std::string(o.at("hex").as_string()));
    auto back = protocol::get_header(out);
    REQUIRE(back);
    CHECK(back->id == h.id);
    CHECK(back->offset == h.offset);
    CHECK(back->last() == o.at("last").as_bool());
  }
  CHECK_FALSE(protocol::get_header("short"));
}

TEST_CASE("protocol: field accessors name the field and the problem") {
  auto o = boost::json::parse(R"({"a": "x", "n": -1, "b": 1, "big": 1e400})").as_object();
  try {
    protocol::opt_int(o, "a", 0, 10);
    FAIL("no throw");
  } catch (const protocol::RequestError& e) {
    CHECK(std::string(e.what()).find("field a") != std::string::npos);
  }
  CHECK_THROWS_AS(protocol::opt_int(o, "n", 0, 10), sbx::protocol::RequestError);
  CHECK_THROWS_AS(protocol::opt_bool(o, "b"), sbx::protocol::RequestError);
  CHECK_THROWS_AS(protocol::opt_int(o, "big", 0, INT64_MAX), sbx::protocol::RequestError);
  CHECK(protocol::opt_duration_ms(boost::json::parse(R"({"g": "2s"})").as_object(), "g") == 2000);
  CHECK(protocol::opt_duration_ms(boost::json::parse(R"({"g": 1.5})").as_object(), "g") == 1500);
}

TEST_CASE("channel: every valid request vector parses to its fields") {
  for (auto& v : channel_vectors("requests")) {
    auto& o = v.as_object();
    if (!o.at("valid").as_bool()) continue;
    CAPTURE(o.at("name"));
    auto r = protocol::parse_channel_request(o.at("text").as_string());
    auto& want = o.at("parsed").as_object();
    CHECK(protocol::channel_op_name(r.op) == std::string_view(want.at("op").as_string()));
    CHECK(r.id == boost::json::parse(o.at("text").as_string()).as_object().at("id"));
    if (auto* n = want.if_contains("name")) CHECK(r.name == std::string_view(n->as_string()));
    if (auto* l = want.if_contains("leave_running")) CHECK(r.leave_running == l->as_bool());
    if (auto* n = want.if_contains("n")) CHECK(r.n == n->to_number<int>());
    if (auto* s = want.if_contains("snapshot")) CHECK(r.snapshot == std::string_view(s->as_string()));
    if (auto* e = want.if_contains("event")) CHECK(r.event == e->as_object());
  }
}

TEST_CASE("channel: refused request vectors fail with their code, id and message") {
  for (auto& v : channel_vectors("requests")) {
    auto& o = v.as_object();
    if (o.at("valid").as_bool()) continue;
    CAPTURE(o.at("name"));
    boost::json::value id;
    try {
      protocol::parse_channel_request(o.at("text").as_string(), &id);
      FAIL("parsed");
    } catch (const protocol::RequestError& e) {
      CHECK(e.code == std::string_view(o.at("code").as_string()));
      CHECK(id == o.at("id"));
      if (auto* m = o.if_contains("message")) CHECK(std::string_view(e.what()) == std::string_view(m->as_string()));
      // The reply is the server's error reply.
      auto reply = protocol::error_reply(id, e.code, e.what());
      CHECK(reply.at("id") == o.at("id"));
      CHECK(reply.at("ok") == false);
    }
  }
}

TEST_CASE("channel: reply vectors have the server's shape, as the protocol library builds them") {
  for (auto& v : channel_vectors("replies")) {
    auto& frame = v.as_object().at("frame").as_object();
    CAPTURE(v.as_object().at("name"));
    REQUIRE(frame.contains("id"));
    REQUIRE(frame.at("ok").is_bool());
    boost::json::object body = frame;
    body.erase("id");
    CHECK(protocol::reply_with_id(frame.at("id"), body) == frame);
    if (!frame.at("ok").as_bool()) {
      auto& err = frame.at("error").as_object();
      CHECK(protocol::error_reply(frame.at("id"), err.at("code").as_string(), err.at("message").as_string()) == frame);
    }
    auto line = protocol::channel_line(frame);
    CHECK(line.back() == '\n');
    CHECK(boost::json::parse(line) == frame);
  }
  for (auto& v : channel_vectors("identity")) {
    auto& frame = v.as_object().at("frame").as_object();
    CHECK_FALSE(frame.contains("id"));  // how the agent tells it from a reply
    CHECK_FALSE(frame.contains("ok"));
  }
}

TEST_CASE("sdk: URLs") {
  auto u = sbx::sdk::parse_url("ws://127.0.0.1:7000");
  CHECK(u.host == "127.0.0.1");
  CHECK(u.port == 7000);
  CHECK(u.path == "/");
  CHECK_FALSE(u.tls);
  auto s = sbx::sdk::parse_url("wss://[::1]:443/x");
  CHECK(s.tls);
  CHECK(s.host == "::1");
  CHECK(s.path == "/x");
  CHECK_THROWS(sbx::sdk::parse_url("http://x:1"));
  CHECK_THROWS(sbx::sdk::parse_url("ws://x:99999"));
}

TEST_CASE("replies: an error message naming a file the agent named is UTF-8 text") {
  // fs.remove -r names the entry it stopped at; the agent chose its bytes.
  auto reply = protocol::error_reply(7, "permission_denied", "/workspace/d/bad\xffname: Operation not permitted");
  auto text = boost::json::serialize(reply);
  boost::system::error_code ec;
  auto back = boost::json::parse(text, ec);  // boost's parser refuses text that is not UTF-8
  REQUIRE_FALSE(ec);
  CHECK(back.at("error").at("message").as_string() == "/workspace/d/bad\xef\xbf\xbdname: Operation not permitted");
}

TEST_CASE("protocol: the leading id of a frame too large to parse") {
  using sbx::protocol::leading_id;
  std::string pad(2000, 'x');
  CHECK(leading_id(R"({"id": 7, "op": "ping", "pad": ")" + pad) == boost::json::value(7));
  CHECK(leading_id(" {\n\"id\" :\t\"r-\\\"7\\\"\",\"op\":\"x\"") == boost::json::value("r-\"7\""));
  CHECK(leading_id(R"({"id":18446744073709551615,)") == boost::json::value(18446744073709551615ull));
  // Not first, not an id parse_request would take, cut off, or too long: none.
  CHECK(leading_id(R"({"op": "ping", "id": 7})").is_null());
  CHECK(leading_id(R"({"id": 1.5, "op": "ping"})").is_null());
  CHECK(leading_id(R"({"id": [7], "op": "ping"})").is_null());
  CHECK(leading_id(R"({"id": "unterminated)").is_null());
  CHECK(leading_id(R"({"id": 12)").is_null());
  CHECK(leading_id(R"({"id": ")" + std::string(300, 'a') + R"(", "op": "x"})").is_null());
  CHECK(leading_id("").is_null());
  CHECK(leading_id("[1, 2]").is_null());
}
