#include "shims/docker/docker.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/process.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "archive/archive.hpp"
#include "os/files.hpp"
#include "os/sys.hpp"
#include "profile/profile.hpp"
#include "protocol/probe.hpp"

namespace bp = boost::process;
namespace json = boost::json;

namespace sbx::shims::docker {

namespace {

// Where sandboxer-init finds what the host hands it, inside the container.
constexpr const char* kStateIn = "/var/lib/sandboxer/box";
constexpr const char* kTokenIn = "/etc/sandboxer/secret/token";  // as shims/common.py
constexpr const char* kProfileIn = "/etc/sandboxer/profile.json";
constexpr const char* kRestoreIn = "/etc/sandboxer/restore.tar.zst";  // boxes forked before issue 17
constexpr const char* kSigningKeyIn = "/etc/sandboxer/secret/signing-key";
constexpr const char* kTrustDirIn = "/etc/sandboxer/trust/";  // 0.pub, 1.pub, ...
// The API's port inside a container on a bridge network.
constexpr int kBridgePort = 7777;  // as shims/common.py
// Above the grace period: sandboxer-init needs time after the agent's end to write the journal.
constexpr int kStopMarginS = 5;
// The supervisor, ns-init, `docker exec` and the HEALTHCHECK need pids beside the agent's.
constexpr int64_t kPidsMargin = 32;

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

// "2G", "512M", "64k", "1.5G" or a number of bytes (1024-based, as the profiles mean it).
int64_t size_bytes(const json::value& v, const std::string& field) {
  if (v.is_int64()) return v.as_int64();
  if (v.is_uint64()) return static_cast<int64_t>(v.as_uint64());
  if (v.is_double()) return static_cast<int64_t>(v.as_double());
  if (!v.is_string()) throw std::runtime_error(field + ": expected a size such as \"2G\"");
  std::string s(v.as_string());
  char* end = nullptr;
  double x = std::strtod(s.c_str(), &end);
  std::string unit = end ? std::string(end) : "";
  double mult = 1;
  if (unit.empty() || unit == "B" || unit == "b")
    mult = 1;
  else if (unit[0] == 'k' || unit[0] == 'K')
    mult = 1024.0;
  else if (unit[0] == 'm' || unit[0] == 'M')
    mult = 1024.0 * 1024;
  else if (unit[0] == 'g' || unit[0] == 'G')
    mult = 1024.0 * 1024 * 1024;
  else if (unit[0] == 't' || unit[0] == 'T')
    mult = 1024.0 * 1024 * 1024 * 1024;
  else
    throw std::runtime_error(field + ": unknown unit in \"" + s + "\"");
  if (end == s.c_str() || x < 0) throw std::runtime_error(field + ": not a size: \"" + s + "\"");
  return static_cast<int64_t>(x * mult);
}

double number(const json::value& v, const std::string& field) {
  if (v.is_number()) return v.to_number<double>();
  throw std::runtime_error(field + ": expected a number");
}

void apply_override_json(json::object& root, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) throw std::runtime_error("--set " + assignment + ": expected FIELD=VALUE");
  std::string path = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  boost::system::error_code ec;
  json::value v = json::parse(text, ec);
  if (ec) v = json::string(text);
  // As the supervisor's --set: an environment variable's value is a string (PORT=8080).
  if (path.starts_with("env.") && !v.is_null()) v = json::string(text);
  json::object* o = &root;
  size_t start = 0;
  for (;;) {
    auto dot = path.find('.', start);
    std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (key.empty()) throw std::runtime_error("--set " + assignment + ": empty field name");
    if (dot == std::string::npos) {
      (*o)[key] = v;
      return;
    }
    auto& next = (*o)[key];
    if (!next.is_object()) next = json::object();
    o = &next.as_object();
    start = dot + 1;
  }
}

// Whether the profile asks for live checkpoint: `persistence: "checkpoint"`; a profile from before
// that field existed asks for it by wanting namespaces of its own (live checkpoint needs them).
bool wants_live_checkpoint(const json::object& p) {
  if (auto* pers = p.if_contains("persistence")) return pers->is_string() && pers->as_string() == "checkpoint";
  auto* iso = p.if_contains("isolation");
  if (!iso || !iso->is_object()) return true;  // the default is namespaces on
  auto* ns = iso->as_object().if_contains("namespaces");
  if (!ns) return true;
  if (ns->is_bool()) return ns->as_bool();
  if (ns->is_array()) return !ns->as_array().empty();
  return false;
}

// A bound socket on a free loopback port: the port stays taken while the fd lives.
os::UniqueFd bound_loopback_socket(int* port) {
  os::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd.get() < 0 || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw std::runtime_error("pick a loopback port: " + os::last_error().message());
  *port = ntohs(a.sin_port);
  return fd;
}

int free_loopback_port() {
  int port = 0;
  bound_loopback_socket(&port);
  return port;
}

std::string docker_error(const std::string& what, const DockerResult& r) {
  std::string e = trim(r.err.empty() ? r.out : r.err);
  return what + ": docker exited with " + std::to_string(r.status) + (e.empty() ? "" : ": " + e);
}

DockerResult must(const std::string& what, const std::vector<std::string>& args) {
  auto r = run_docker(args);
  if (r.status != 0) throw std::runtime_error(docker_error(what, r));
  return r;
}

const char* kPsFormat =
    "{{.Names}}\t{{.Label \"io.sandboxer.url\"}}\t{{.Label \"io.sandboxer.state\"}}\t{{.Image}}\t{{.Status}}";

std::vector<BoxRecord> parse_ps(const std::string& out) {
  std::vector<BoxRecord> boxes;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    std::vector<std::string> f;
    std::istringstream ls(line);
    for (std::string x; std::getline(ls, x, '\t');) f.push_back(x);
    f.resize(5);
    boxes.push_back({.name = f[0], .url = f[1], .state_dir = f[2], .image = f[3], .status = f[4]});
  }
  return boxes;
}

// Where the dockerd is: this machine, or another one reached by tcp:// or ssh://.
struct Daemon {
  bool remote = false;
  std::string endpoint;    // as the docker CLI names it
  std::string publish_ip;  // remote: the address boxes' APIs are published on, which this machine reaches
};

// The host of tcp://H:P or ssh://[USER@]H[:P] ("" for a local endpoint).
std::string remote_host(const std::string& endpoint) {
  std::string rest;
  if (endpoint.starts_with("tcp://"))
    rest = endpoint.substr(6);
  else if (endpoint.starts_with("ssh://"))
    rest = endpoint.substr(6);
  else
    return "";
  rest = rest.substr(0, rest.find('/'));
  if (auto at = rest.rfind('@'); at != std::string::npos) rest = rest.substr(at + 1);
  if (rest.starts_with("[")) return rest.substr(1, rest.find(']') - 1);
  return rest.substr(0, rest.find(':'));
}

// A host name as the numeric address this machine reaches it at (the one a port is published on).
std::string numeric_address(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res); rc != 0 || !res)
    throw std::runtime_error("resolve " + host + ": " + ::gai_strerror(rc) + " (give --publish-address IP)");
  char buf[INET6_ADDRSTRLEN] = {};
  const void* a = res->ai_family == AF_INET6
                      ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(res->ai_addr)->sin6_addr)
                      : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr);
  ::inet_ntop(res->ai_family, a, buf, sizeof buf);
  ::freeaddrinfo(res);
  return buf;
}

// DOCKER_HOST if set, else the docker CLI's current context (DOCKER_CONTEXT or `docker context use`).
Daemon find_daemon(const std::string& publish_address) {
  Daemon d;
  if (auto* h = std::getenv("DOCKER_HOST"); h && *h) {
    d.endpoint = h;
  } else {
    auto r = run_docker({"context", "inspect", "--format", "{{.Endpoints.docker.Host}}"});
    d.endpoint = r.status == 0 ? trim(r.out) : "";
  }
  std::string host = remote_host(d.endpoint);
  // A tcp:// endpoint on this machine's loopback is still this machine.
  d.remote = !host.empty() && host != "localhost" && !host.starts_with("127.") && host != "::1";
  if (d.remote) d.publish_ip = numeric_address(publish_address.empty() ? host : publish_address);
  return d;
}

}  // namespace

bool docker_installed() {
  if (auto* e = std::getenv("SANDBOXER_DOCKER"); e && *e) return true;
  return !bp::search_path("docker").empty();
}

DockerResult run_docker(const std::vector<std::string>& args) {
  std::string exe;
  if (auto* e = std::getenv("SANDBOXER_DOCKER"); e && *e)
    exe = e;
  else
    exe = bp::search_path("docker").string();
  if (exe.empty()) throw std::runtime_error("docker: not found on PATH (or set SANDBOXER_DOCKER)");
  boost::asio::io_context ios;
  std::future<std::string> out, err;
  std::optional<bp::child> started;
  try {
    started.emplace(exe, bp::args(args), bp::std_in<bp::null, bp::std_out> out, bp::std_err > err, ios);
  } catch (const bp::process_error& e) {
    // Boost.Process says only "execve failed: ...": name the program.
    throw std::runtime_error("docker: run " + exe + ": " + e.code().message());
  }
  bp::child& c = *started;
  ios.run();
  c.wait();
  return {c.exit_code(), out.get(), err.get()};
}

std::vector<std::string> docker_limits(const json::object& res) {
  std::vector<std::string> args;
  if (auto* m = res.if_contains("memory")) {
    if (int64_t b = size_bytes(*m, "resources.memory"); b > 0) {
      // Swap equal to memory: the ceiling is the memory itself, not twice it.
      args.insert(args.end(), {"--memory", std::to_string(b), "--memory-swap", std::to_string(b)});
    }
  }
  if (auto* c = res.if_contains("cpus")) {
    if (double x = number(*c, "resources.cpus"); x > 0) {
      std::ostringstream s;
      s << x;
      args.insert(args.end(), {"--cpus", s.str()});
    }
  }
  if (auto* p = res.if_contains("pids")) {
    if (auto n = static_cast<int64_t>(number(*p, "resources.pids")); n > 0)
      args.insert(args.end(), {"--pids-limit", std::to_string(n + kPidsMargin)});
  }
  return args;
}

RunPlan plan_for_profile(json::object profile, const std::vector<std::string>& overrides) {
  for (auto& s : overrides) apply_override_json(profile, s);
  // The supervisor's own parser: the box would refuse what it refuses, so refuse it here first.
  profile::Profile parsed = profile::parse_profile(json::serialize(profile));
  RunPlan plan;
  plan.profile = profile;
  plan.grace_ms = parsed.resources.grace_ms;
  plan.stop_timeout_s = static_cast<int>((plan.grace_ms + 999) / 1000) + kStopMarginS;
  plan.live_checkpoint_caps = wants_live_checkpoint(profile);
  plan.persist = parsed.checkpoint.enabled();
  plan.namespace_caps = !plan.live_checkpoint_caps && parsed.isolation.namespaces;
  if (auto* r = profile.if_contains("resources"); r && r->is_object()) plan.limit_args = docker_limits(r->as_object());
  // on-failure, not always: a box that hibernated (on_idle) or checkpointed at `docker stop`
  // exits 0 and stays down until started; a crash (the supervisor killed, dockerd gone) exits
  // otherwise and is started again, which resumes the agent. docker stop and kill are the
  // user's: Docker does not restart those.
  if (plan.persist) plan.limit_args.insert(plan.limit_args.end(), {"--restart", "on-failure"});
  return plan;
}

namespace {

// Everything a box's container gets but its mounts and its network.
struct Launch {
  BoxRecord box;
  RunPlan plan;
  std::string profile_text;             // the profile with the overrides applied
  std::string signing_key;              // host file
  std::vector<std::string> trust_keys;  // host files, i.pub in kTrustDirIn
  std::vector<std::string> opts;        // docker run/create options before the image
  std::vector<std::string> init_args(const UpOptions& o, const std::string& listen) const;
};

std::vector<std::string> Launch::init_args(const UpOptions& o, const std::string& listen) const {
  std::vector<std::string> a = {"--state-dir", kStateIn,   "--profile", kProfileIn,      "--token-file",
                                kTokenIn,      "--listen", listen,      "--signing-key", kSigningKeyIn};
  for (size_t i = 0; i < trust_keys.size(); ++i)
    a.insert(a.end(), {"--trust-key", kTrustDirIn + std::to_string(i) + ".pub"});
  if (o.allow_unsigned) a.push_back("--allow-unsigned");
  for (auto& kv : o.env) a.insert(a.end(), {"--env", kv});
  if (o.idle) {
    a.push_back("--idle");
  } else {
    a.push_back("--");
    a.insert(a.end(), o.argv.begin(), o.argv.end());
  }
  return a;
}

Launch prepare(const UpOptions& o) {
  if (o.argv.empty() && !o.idle) throw std::runtime_error("no command given (expected -- COMMAND ...)");
  if (!o.argv.empty() && o.idle) throw std::runtime_error("a box starts with a command or idle, not both");
  std::string text = o.profile_text, where = "given with the fork";
  if (text.empty()) {
    auto source = profile::find_profile(o.profile);
    text = source.text;
    where = source.where;
  }
  boost::system::error_code ec;
  auto pv = json::parse(text, ec);
  if (ec || !pv.is_object()) throw std::runtime_error("profile " + where + ": not a JSON object");
  Launch l;
  l.plan = plan_for_profile(pv.as_object(), o.overrides);
  l.profile_text = json::serialize(l.plan.profile) + "\n";
  l.box.name = o.name.empty() ? "sbx-" + os::random_hex(5) : o.name;
  l.box.image = o.image.empty() ? std::string("sandboxer/agent:") + SBX_VERSION : o.image;
  l.box.token = os::random_hex(32);
  // The archive keys: the user's pair unless the caller names others.
  l.signing_key = o.signing_key;
  l.trust_keys = o.trust_keys;
  if (l.signing_key.empty()) {
    std::string dir = archive::user_key_dir();
    auto k = archive::ensure_user_key(dir);
    if (!k) throw std::runtime_error("the archive signing key: " + k.error().message);
    l.signing_key = *k;
    l.trust_keys.push_back(dir + "/signing.pub");
  }
  const RunPlan& plan = l.plan;
  l.opts = {"--label",        "io.sandboxer.box=" + l.box.name,   "--label", "io.sandboxer.profile=" + o.profile,
            "--stop-timeout", std::to_string(plan.stop_timeout_s)};
  if (plan.live_checkpoint_caps) {
    l.opts.insert(l.opts.end(), {"--cap-add", "SYS_ADMIN", "--cap-add", "SYS_PTRACE", "--cap-add", "NET_ADMIN",
                                 "--cap-add", "SYS_TIME", "--security-opt", "seccomp=unconfined", "--tmpfs", "/run"});
  } else if (plan.namespace_caps) {
    // Docker's seccomp profile refuses pivot_root even with SYS_ADMIN; the agent gets its own filter.
    l.opts.insert(l.opts.end(),
                  {"--cap-add", "SYS_ADMIN", "--cap-add", "NET_ADMIN", "--security-opt", "seccomp=unconfined"});
  }
  l.opts.insert(l.opts.end(), plan.limit_args.begin(), plan.limit_args.end());
  for (auto& v : o.volumes) l.opts.insert(l.opts.end(), {"--volume", v});
  for (auto& lb : o.labels) l.opts.insert(l.opts.end(), {"--label", lb});
  return l;
}

void describe(const Launch& l, bool bridge, std::ostream& log, const std::string& where) {
  log << "box " << l.box.name << ": image " << l.box.image << ", "
      << (l.plan.live_checkpoint_caps ? "live-checkpoint capabilities"
          : l.plan.namespace_caps     ? "namespace capabilities (SYS_ADMIN NET_ADMIN)"
                                      : "no added capabilities")
      << ", " << (bridge ? "bridge network" : "host network") << ", stop timeout " << l.plan.stop_timeout_s << "s"
      << where << "\n";
}

// Ready when the API answers; a container that ends first is reported with its log. The probe is
// a connect (cheap, every 10 ms); whether the container still runs costs a docker CLI run, so
// that is asked every 400 ms. `cleanup` runs before any throw.
//
// With `token`, only the box answers: the probe sends it, and a server that refuses it is another
// one, which took the port between its pick and the box's bind (a host network has no way to
// hold it across `docker run`). That returns false, the container left as it is.
bool wait_until_serving(const BoxRecord& box, const std::string& host, int port, const std::function<void()>& cleanup,
                        const std::string& token = "") {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  auto next_state_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(400);
  for (;;) {
    auto probe = protocol::probe_websocket(host, port, 500, token);
    if (probe) return true;
    if (probe.error().code == "unauthorized") return false;
    if (auto now = std::chrono::steady_clock::now(); now > next_state_check || now > deadline) {
      next_state_check = now + std::chrono::milliseconds(400);
      auto st = run_docker({"inspect", "--format", "{{.State.Status}}", box.name});
      std::string state = trim(st.out);
      if (state != "running" && state != "created") {
        auto logs = run_docker({"logs", "--tail", "20", box.name});
        // Its bind found the port taken by a server that is not a WebSocket one.
        if (!token.empty() && (logs.out + logs.err).find("listen on " + std::string(host)) != std::string::npos &&
            (logs.out + logs.err).find(std::strerror(EADDRINUSE)) != std::string::npos)
          return false;
        run_docker({"rm", "--force", box.name});
        cleanup();
        throw std::runtime_error("box " + box.name + " ended before its API answered (" + state + "); its log:\n" +
                                 trim(logs.out + logs.err));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        // Running, and still not serving: what the box said is the only clue left once it is gone.
        auto logs = run_docker({"logs", "--tail", "20", box.name});
        run_docker({"rm", "--force", box.name});
        cleanup();
        throw std::runtime_error("box " + box.name + ": the API on " + box.url + " did not answer in 30 s; its log:\n" +
                                 trim(logs.out + logs.err));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// One `docker run` of a local box on `port`: false when another server turned out to hold it.
bool run_local(const UpOptions& o, Launch& l, bool bridge, int port, const std::string& token_file, std::ostream& log) {
  BoxRecord& box = l.box;
  std::string box_dir = o.box_root + "/" + box.name;
  std::string profile_copy = box_dir + "/profile.json";
  box.url = "ws://127.0.0.1:" + std::to_string(port);
  std::vector<std::string> args = {"run",      "--detach",
                                   "--name",   box.name,
                                   "--label",  "io.sandboxer.url=" + box.url,
                                   "--label",  "io.sandboxer.state=" + box.state_dir,
                                   "--volume", box.state_dir + ":" + kStateIn,
                                   "--volume", token_file + ":" + kTokenIn + ":ro",
                                   "--volume", profile_copy + ":" + kProfileIn + ":ro",
                                   "--volume", l.signing_key + ":" + kSigningKeyIn + ":ro"};
  for (size_t i = 0; i < l.trust_keys.size(); ++i)
    args.insert(args.end(), {"--volume", l.trust_keys[i] + ":" + kTrustDirIn + std::to_string(i) + ".pub:ro"});
  if (bridge)
    args.insert(args.end(), {"--publish", "127.0.0.1:" + std::to_string(port) + ":" + std::to_string(kBridgePort)});
  else
    args.insert(args.end(), {"--network", "host"});
  args.insert(args.end(), l.opts.begin(), l.opts.end());
  args.push_back(box.image);
  auto init = l.init_args(o, bridge ? "0.0.0.0:" + std::to_string(kBridgePort) : "127.0.0.1:" + std::to_string(port));
  args.insert(args.end(), init.begin(), init.end());
  describe(l, bridge, log, "");
  auto forget = [&] { ::unlink(token_file.c_str()); };
  if (auto r = run_docker(args); r.status != 0) {
    // A published port another process took since it was picked.
    if (bridge && (r.err.find("already allocated") != std::string::npos ||
                   r.err.find(std::strerror(EADDRINUSE)) != std::string::npos))
      return false;
    forget();
    throw std::runtime_error(docker_error("docker run " + box.name, r));
  }
  return wait_until_serving(box, "127.0.0.1", port, forget, box.token);
}

// A dockerd on this machine: the state dir, token, profile and keys are bind mounts from
// BOX_ROOT/NAME, so the journal outlives the container.
BoxRecord up_local(const UpOptions& o, Launch& l, std::ostream& log) {
  BoxRecord& box = l.box;
  std::string box_dir = o.box_root + "/" + box.name;
  box.state_dir = box_dir + "/state";
  for (auto& d : {box_dir, box.state_dir})
    if (auto r = os::make_dirs(d, 0700); !r) throw std::runtime_error("create " + d + ": " + r.error().message());
  std::string token_file = box_dir + "/token";
  std::string profile_copy = box_dir + "/profile.json";
  if (auto r = os::write_file_atomic(token_file, box.token + "\n", 0600); !r)
    throw std::runtime_error("write " + token_file + ": " + r.error().message());
  if (auto r = os::write_file_atomic(profile_copy, l.profile_text, 0644); !r)
    throw std::runtime_error("write " + profile_copy + ": " + r.error().message());
  // A bridge lets the API sit in the container's own network namespace, published on loopback;
  // without one (dockerd --bridge=none), host networking with a loopback listener.
  bool bridge = run_docker({"network", "inspect", "bridge", "--format", "{{.Name}}"}).status == 0;
  auto forget = [&] { ::unlink(token_file.c_str()); };
  for (int attempt = 0, port = o.port > 0 ? o.port : free_loopback_port();; ++attempt) {
    if (run_local(o, l, bridge, port, token_file, log)) return box;
    run_docker({"rm", "--force", box.name});
    if (attempt >= 4) {
      forget();
      throw std::runtime_error("box " + box.name + ": every loopback port picked for its API (the last " +
                               std::to_string(port) + ") was taken by another server before the box bound it");
    }
    // The token went to that server: the next container gets a new one.
    log << "box " << box.name << ": port " << port << " was taken by another server before the box bound it"
        << "; trying another port, with a new token\n";
    port = free_loopback_port();
    box.token = os::random_hex(32);
    if (auto r = os::write_file_atomic(token_file, box.token + "\n", 0600); !r) {
      forget();
      throw std::runtime_error("write " + token_file + ": " + r.error().message());
    }
  }
}

// A dockerd on another machine (DOCKER_HOST tcp:// or ssh://, or such a context): nothing of
// this machine's filesystem reaches it. The container is created, the token, profile and keys
// are copied into it (`docker cp`, root's, 0600 for the secrets) before it starts, its state dir
// is a volume of its own on that host, and the API is published on the address this machine
// reaches the host at, on a port picked here (another is tried if the host has it taken).
BoxRecord up_remote(const UpOptions& o, Launch& l, const Daemon& d, std::ostream& log) {
  BoxRecord& box = l.box;
  if (run_docker({"network", "inspect", "bridge", "--format", "{{.Name}}"}).status != 0)
    throw std::runtime_error("the dockerd at " + d.endpoint +
                             " has no bridge network: a box on another machine is reached through a published port");
  // A name of its own: a later box of the same name never finds this one's snapshots.
  std::string volume = "sbx-state-" + box.name + "-" + os::random_hex(3);
  box.state_dir = "volume:" + volume;
  // What goes into /etc/sandboxer, staged here and removed when copied.
  const char* tmp = std::getenv("TMPDIR");
  std::string stage = std::string(tmp && *tmp ? tmp : "/tmp") + "/sbx-up-XXXXXX";
  if (!::mkdtemp(stage.data())) throw std::runtime_error("create " + stage + ": " + os::last_error().message());
  struct RemoveStage {
    std::string dir;
    ~RemoveStage() { os::remove_tree(dir); }
  } remove_stage{stage};
  for (auto& dir : {stage + "/secret", stage + "/trust"})
    if (auto r = os::make_dirs(dir, 0700); !r) throw std::runtime_error("create " + dir + ": " + r.error().message());
  auto put = [](const std::string& path, const std::string& text, mode_t mode) {
    if (auto r = os::write_file_atomic(path, text, mode); !r)
      throw std::runtime_error("write " + path + ": " + r.error().message());
  };
  auto read = [](const std::string& path) {
    auto t = os::read_file(path);
    if (!t) throw std::runtime_error("read " + path + ": " + t.error().message());
    return *t;
  };
  put(stage + "/profile.json", l.profile_text, 0644);
  put(stage + "/secret/token", box.token + "\n", 0600);
  put(stage + "/secret/signing-key", read(l.signing_key), 0600);
  ::chmod((stage + "/trust").c_str(), 0755);
  for (size_t i = 0; i < l.trust_keys.size(); ++i)
    put(stage + "/trust/" + std::to_string(i) + ".pub", read(l.trust_keys[i]), 0644);
  describe(l, true, log, ", on " + d.endpoint + " (API published on " + d.publish_ip + ")");
  for (int attempt = 0;; ++attempt) {
    // o.port is one free on this machine's loopback (fork picks them): it says nothing of that host.
    int port = 20000 + static_cast<int>(std::stoul(os::random_hex(2), nullptr, 16) % 12000);
    box.url = "ws://" + (d.publish_ip.find(':') != std::string::npos ? "[" + d.publish_ip + "]" : d.publish_ip) + ":" +
              std::to_string(port);
    std::vector<std::string> args = {"create",
                                     "--name",
                                     box.name,
                                     "--label",
                                     "io.sandboxer.url=" + box.url,
                                     "--label",
                                     "io.sandboxer.state=" + box.state_dir,
                                     "--label",
                                     "io.sandboxer.profile-json=" + l.profile_text,
                                     "--volume",
                                     volume + ":" + kStateIn,
                                     "--publish",
                                     d.publish_ip + ":" + std::to_string(port) + ":" + std::to_string(kBridgePort)};
    args.insert(args.end(), l.opts.begin(), l.opts.end());
    args.push_back(box.image);
    auto init = l.init_args(o, "0.0.0.0:" + std::to_string(kBridgePort));
    args.insert(args.end(), init.begin(), init.end());
    must("docker create " + box.name, args);
    auto drop = [&] { run_docker({"rm", "--force", box.name}); };
    if (auto r = run_docker({"cp", stage + "/.", box.name + ":/etc/sandboxer/"}); r.status != 0) {
      drop();
      throw std::runtime_error(docker_error("docker cp into " + box.name, r));
    }
    auto r = run_docker({"start", box.name});
    if (r.status == 0) {
      wait_until_serving(box, d.publish_ip, port, [] {});
      return box;
    }
    drop();
    bool taken = r.err.find("already allocated") != std::string::npos || r.err.find("in use") != std::string::npos;
    if (!taken || attempt >= 4) throw std::runtime_error(docker_error("docker start " + box.name, r));
  }
}

}  // namespace

BoxRecord up(const UpOptions& o, std::ostream& log) {
  Launch l = prepare(o);
  Daemon d = find_daemon(o.publish_address);
  if (!d.remote && !o.publish_address.empty())
    throw std::runtime_error("--publish-address " + o.publish_address + ": the dockerd at " +
                             (d.endpoint.empty() ? std::string("the default socket") : d.endpoint) +
                             " is this machine's, whose boxes publish their API on 127.0.0.1 only");
  BoxRecord box = d.remote ? up_remote(o, l, d, log) : up_local(o, l, log);
  box.status = "running";
  return box;
}

std::vector<int> free_loopback_ports(int n) {
  std::vector<os::UniqueFd> held;
  std::vector<int> ports;
  for (int i = 0; i < n; ++i) {
    int p = 0;
    held.push_back(bound_loopback_socket(&p));
    ports.push_back(p);
  }
  return ports;
}

BoxSpec inspect_box(const std::string& url) {
  auto spec = find_box(url);
  if (!spec) throw std::runtime_error("no box container for " + url + " (see sandboxer ps)");
  return *spec;
}

std::string image_with_id(const std::string& id) {
  auto r = must("docker images", {"images", "--quiet", "--no-trunc", "--filter", "label=io.sandboxer.image.id=" + id});
  std::string first = trim(r.out.substr(0, r.out.find('\n')));
  if (first.empty())
    throw std::runtime_error("this dockerd has no image of sandboxer image id " + id +
                             " (build it there with `sandboxer image build`, or docker save | docker load it)");
  return first;
}

std::optional<BoxSpec> find_box(const std::string& url) {
  auto boxes = parse_ps(must("docker ps", {"ps", "--all", "--filter", "label=io.sandboxer.box", "--filter",
                                           "label=io.sandboxer.url=" + url, "--format", kPsFormat})
                            .out);
  if (boxes.empty()) return std::nullopt;
  BoxSpec spec;
  spec.name = boxes.front().name;
  auto r = must("docker inspect " + spec.name, {"inspect", spec.name});
  boost::system::error_code ec;
  auto v = json::parse(r.out, ec);
  if (ec || !v.is_array() || v.as_array().empty() || !v.as_array()[0].is_object())
    throw std::runtime_error("docker inspect " + spec.name + ": not the JSON array docker prints");
  auto& c = v.as_array()[0].as_object();
  if (auto* img = c.if_contains("Image"); img && img->is_string()) spec.image = std::string(img->as_string());
  if (spec.image.empty()) throw std::runtime_error("docker inspect " + spec.name + ": no image");
  if (auto* mounts = c.if_contains("Mounts"); mounts && mounts->is_array()) {
    for (auto& m : mounts->as_array()) {
      if (!m.is_object()) continue;
      auto& mo = m.as_object();
      auto str = [&](const char* k) {
        auto* x = mo.if_contains(k);
        return x && x->is_string() ? std::string(x->as_string()) : std::string();
      };
      std::string dst = str("Destination"), type = str("Type");
      if (dst == kProfileIn) {
        auto text = os::read_file(str("Source"));
        if (!text)
          throw std::runtime_error("box " + spec.name + ": its profile " + str("Source") + ": " +
                                   text.error().message());
        spec.profile_text = *text;
        continue;
      }
      if (dst == kStateIn || dst == kTokenIn || dst == kRestoreIn || dst == kSigningKeyIn ||
          dst.starts_with(kTrustDirIn))
        continue;
      std::string src = type == "volume" ? str("Name") : str("Source");
      if (type != "bind" && type != "volume") continue;
      bool rw = mo.contains("RW") && mo.at("RW").is_bool() && mo.at("RW").as_bool();
      spec.volumes.push_back(src + ":" + dst + (rw ? "" : ":ro"));
    }
  }
  // sandboxer-init's arguments (after the image): the agent's --env K=V.
  if (auto* args = c.if_contains("Args"); args && args->is_array()) {
    auto& a = args->as_array();
    for (size_t i = 0; i + 1 < a.size(); ++i) {
      if (!a[i].is_string() || a[i].as_string() == "--") break;
      if (a[i].as_string() == "--env" && a[i + 1].is_string()) spec.env.emplace_back(a[++i].as_string());
    }
  }
  // A box on another machine has its profile copied in, and in a label.
  if (spec.profile_text.empty())
    if (auto* cfg = c.if_contains("Config"); cfg && cfg->is_object())
      if (auto* labels = cfg->as_object().if_contains("Labels"); labels && labels->is_object())
        if (auto* p = labels->as_object().if_contains("io.sandboxer.profile-json"); p && p->is_string())
          spec.profile_text = std::string(p->as_string());
  if (spec.profile_text.empty())
    throw std::runtime_error("box " + spec.name + ": no profile mounted at " + kProfileIn +
                             " nor in its labels (not started by sandboxer up?)");
  return spec;
}

std::vector<BoxRecord> ps() {
  return parse_ps(must("docker ps", {"ps", "--all", "--filter", "label=io.sandboxer.box", "--format", kPsFormat}).out);
}

BoxRecord down(const std::string& url_or_name) {
  std::string filter = url_or_name.starts_with("ws://") || url_or_name.starts_with("wss://")
                           ? "label=io.sandboxer.url=" + url_or_name
                           : "name=^" + url_or_name + "$";
  auto boxes = parse_ps(must("docker ps", {"ps", "--all", "--filter", "label=io.sandboxer.box", "--filter", filter,
                                           "--format", kPsFormat})
                            .out);
  if (boxes.empty()) throw std::runtime_error("no box container for " + url_or_name + " (see sandboxer ps)");
  BoxRecord b = boxes.front();
  // docker stop waits the container's own --stop-timeout (set above the grace period by `up`).
  must("docker stop " + b.name, {"stop", b.name});
  must("docker rm " + b.name, {"rm", b.name});
  // A box on another machine keeps its journal in its volume there (its name never reused).
  if (auto slash = b.state_dir.rfind('/'); slash != std::string::npos && !b.state_dir.starts_with("volume:")) {
    std::string box_dir = b.state_dir.substr(0, slash);
    ::unlink((box_dir + "/token").c_str());
    // Ended for good: a box that persists its agent loses its snapshots, so that a box started
    // again under this name begins anew; the journal stays.
    if (auto text = os::read_file(box_dir + "/profile.json")) try {
        if (profile::parse_profile(*text).checkpoint.enabled()) os::remove_tree(b.state_dir + "/snapshots");
      } catch (const profile::ProfileError&) {
        // A profile copy edited since `up` that no longer parses: its snapshots stay.
      }
  }
  b.status = "removed";
  return b;
}

}  // namespace sbx::shims::docker
