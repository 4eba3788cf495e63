// bench/ws's reader in C++: N WebSocket clients, one thread each, that read a producer's lines
// until its END line and report when they got there, so that bench/ws can measure the servers
// rather than its own Python client (which was the limit with 50 clients: one process, one core).
//
//   sbx-ws-reader sandboxer HOST PORT TOKEN N   subscribe from seq 0 on sandboxer.v1; the lines
//                                               are the data of main's proc.output events
//   sbx-ws-reader websocketd HOST PORT - N      one message per line, without its newline
//
// Prints "ready" once every client is connected (and subscribed), then one line per client:
// "<bytes> <seconds>" (the bytes of lines it read, END's included, and CLOCK_MONOTONIC when END
// arrived, as Python's time.monotonic()), followed, where the lines were the producer's stamped
// ones ("T <ns>", its `rate` mode), by "latency <ms> <ms> ...": for each line, the wall clock when
// its message was read here less its stamp. Exits 1 naming what failed. Not a test: no assertion.
#include <time.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/websocket.hpp>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace websocket = beast::websocket;

namespace {

struct Args {
  bool sandboxer = false;
  std::string host, port, token;
  int clients = 1;
};

double realtime_ns() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

double monotonic() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

// The bytes a JSON string stands for, from just past its opening quote at `i` to its closing one
// (the scan stops there): escapes count as what they decode to. Returns (bytes, end) where `end`
// is the index of the closing quote.
std::pair<size_t, size_t> json_string_bytes(std::string_view m, size_t i) {
  size_t bytes = 0;
  for (;;) {
    size_t q = m.find('"', i), b = m.find('\\', i);
    if (q == std::string_view::npos) throw std::runtime_error("a string without its end");
    if (b == std::string_view::npos || q < b) return {bytes + (q - i), q};
    bytes += b - i;
    if (b + 1 < m.size() && m[b + 1] == 'u') {
      unsigned cp = static_cast<unsigned>(std::stoul(std::string(m.substr(b + 2, 4)), nullptr, 16));
      bytes += cp < 0x80                       ? 1
               : cp < 0x800                    ? 2
               : (cp >= 0xD800 && cp < 0xDC00) ? 4
               : (cp >= 0xDC00 && cp < 0xE000) ? 0
                                               : 3;
      i = b + 6;
    } else {
      bytes += 1;
      i = b + 2;
    }
  }
}

// The stamps of the producer's "T <ns>" lines in `lines` (lines ended by `nl`), each appended to
// `lat` as milliseconds before `now_ns`.
void stamps(std::string_view lines, std::string_view nl, double now_ns, std::vector<double>& lat) {
  for (size_t at = 0; at < lines.size();) {
    size_t end = lines.find(nl, at);
    std::string_view line = lines.substr(at, end == std::string_view::npos ? std::string_view::npos : end - at);
    if (line.starts_with("T ")) lat.push_back((now_ns - std::stod(std::string(line.substr(2)))) / 1e6);
    if (end == std::string_view::npos) break;
    at = end + nl.size();
  }
}

// The producer's lines in one message: websocketd's is one line; sandboxer's is an event, whose
// data (main's stdout) is any number of lines. Returns the bytes and whether END was among them.
// The event's data is measured without building it (a JSON parse of every event made the reader,
// not the server, the limit with 50 clients).
std::pair<size_t, bool> lines_in(const Args& a, std::string_view msg, double now_ns, std::vector<double>& lat) {
  if (!a.sandboxer) {
    stamps(msg, "\n", now_ns, lat);
    return {msg.size() + 1, msg == "END"};
  }
  if (msg.substr(0, 200).find("\"proc.output\"") == std::string_view::npos) return {0, false};
  // Quotes inside a string are escaped: these keys are found only as keys.
  if (msg.find("\"proc\":\"main\"") == std::string_view::npos) return {0, false};
  size_t at = msg.find("\"data\":\"");
  if (at == std::string_view::npos) return {0, false};
  auto [n, end] = json_string_bytes(msg, at + 8);
  std::string_view raw = msg.substr(at + 8, end - at - 8);
  if (raw.starts_with("T ")) stamps(raw, "\\n", now_ns, lat);
  return {n, raw == "END\\n" || raw.ends_with("\\nEND\\n")};
}

class Barrier {
 public:
  explicit Barrier(int n) : left_(n) {}
  void arrive() {
    std::lock_guard l(mu_);
    if (--left_ == 0) {
      std::cout << "ready" << std::endl;
    }
  }

 private:
  std::mutex mu_;
  int left_;
};

struct Result {
  size_t bytes = 0;
  double at = 0;
  std::vector<double> latency_ms;
  std::string error;
};

void one_client(const Args& a, Barrier& ready, Result& r) {
  try {
    asio::io_context io;
    asio::ip::tcp::resolver resolver(io);
    websocket::stream<beast::tcp_stream> ws(io);
    beast::get_lowest_layer(ws).connect(resolver.resolve(a.host, a.port));
    ws.read_message_max(64u << 20);
    ws.set_option(websocket::stream_base::decorator([&a](websocket::request_type& req) {
      if (!a.sandboxer) return;
      req.set(beast::http::field::sec_websocket_protocol, "sandboxer.v1");
      req.set(beast::http::field::authorization, "Bearer " + a.token);
    }));
    ws.handshake(a.host + ":" + a.port, "/");
    if (a.sandboxer) ws.write(asio::buffer(std::string(R"({"id":1,"op":"subscribe","since":0})")));
    ready.arrive();
    beast::flat_buffer buf;
    for (;;) {
      ws.read(buf);
      auto [n, end] = lines_in(a, beast::buffers_to_string(buf.data()), realtime_ns(), r.latency_ms);
      buf.consume(buf.size());
      r.bytes += n;
      if (end) break;
    }
    r.at = monotonic();
    beast::error_code ec;
    ws.close(websocket::close_code::normal, ec);
  } catch (const std::exception& e) {
    r.error = e.what();
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 || (std::string(argv[1]) != "sandboxer" && std::string(argv[1]) != "websocketd")) {
    std::cerr << "usage: sbx-ws-reader sandboxer|websocketd HOST PORT TOKEN|- N\n";
    return 2;
  }
  Args a{std::string(argv[1]) == "sandboxer", argv[2], argv[3], argv[4], std::atoi(argv[5])};
  if (a.clients < 1) {
    std::cerr << "sbx-ws-reader: N must be at least 1\n";
    return 2;
  }
  Barrier ready(a.clients);
  std::vector<Result> results(static_cast<size_t>(a.clients));
  std::vector<std::thread> threads;
  for (auto& r : results) threads.emplace_back([&a, &ready, &r] { one_client(a, ready, r); });
  for (auto& t : threads) t.join();
  int status = 0;
  for (auto& r : results) {
    if (!r.error.empty()) {
      std::cerr << "sbx-ws-reader: " << r.error << "\n";
      status = 1;
      continue;
    }
    std::printf("%zu %.6f\n", r.bytes, r.at);
    if (r.latency_ms.empty()) continue;
    std::printf("latency");
    for (double ms : r.latency_ms) std::printf(" %.4f", ms);
    std::printf("\n");
  }
  return status;
}
