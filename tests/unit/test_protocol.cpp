// The request parser and the binary header against the shared protocol vectors (tests/protocol/),
// and the client URL parser of sdk/cpp.
#include <doctest/doctest.h>

#include <boost/json.hpp>
#include <sandboxer/client.hpp>

#include "os/sys.hpp"
#include "protocol/protocol.hpp"

namespace protocol = sbx::protocol;


namespace {
boost::json::array load(const std::string& name) {
  auto text = sbx::os::read_file(std::string(SBX_PROTOCOL_VECTORS) + "/" + name);
  REQUIRE(text);
  return boost::json::parse(*text).as_array();
}
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
    protocol::BinaryHeader h{static_cast<uint32_t>(o.at("id").to_number<uint64_t>()), o.at("offset").to_number<uint64_t>(),
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
