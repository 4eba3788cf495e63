#include "supervisor/network.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <optional>
#include <stdexcept>
#include <thread>

#include <spdlog/spdlog.h>

#include "base/result.hpp"
#include "os/sys.hpp"

namespace sbx::supervisor {

namespace {

struct NsSockets {
  os::UniqueFd tcp, udp, dns_tcp;
};

base::Result<os::UniqueFd> bound_socket(int type, int port) {
  os::UniqueFd s(::socket(AF_INET, type | SOCK_CLOEXEC, 0));
  if (!s) return base::sys_fail("socket", errno);
  int one = 1;
  ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    int e = errno;
    return base::sys_fail("bind 127.0.0.1:" + std::to_string(port), e);
  }
  if (type == SOCK_STREAM && ::listen(s.get(), 128) != 0) return base::sys_fail("listen", errno);
  return s;
}

// The broker's sockets, in the network namespace the calling thread has entered.
base::Result<NsSockets> sockets_in_netns(int port) {
  NsSockets out;
  auto tcp = bound_socket(SOCK_STREAM, port);
  if (!tcp) return tcp.error();
  auto udp = bound_socket(SOCK_DGRAM, 53);
  if (!udp) return udp.error();
  auto dns_tcp = bound_socket(SOCK_STREAM, 53);
  if (!dns_tcp) return dns_tcp.error();
  out.tcp = std::move(*tcp);
  out.udp = std::move(*udp);
  out.dns_tcp = std::move(*dns_tcp);
  return out;
}

// Runs on a thread of its own, which alone enters the branch's network namespace and ends.
base::Result<NsSockets> setup_in_netns(int netns, int port) {
  std::optional<base::Result<NsSockets>> out;
  std::thread t([&] {
    if (::setns(netns, CLONE_NEWNET) != 0) {
      out = base::sys_fail("enter the branch's network namespace", errno);
      return;
    }
    out = sockets_in_netns(port);
  });
  t.join();
  return std::move(*out);
}

bool env_key_is(std::string_view kv, std::string_view key, bool any_case = false) {
  if (kv.size() <= key.size() || kv[key.size()] != '=') return false;
  auto k = kv.substr(0, key.size());
  if (!any_case) return k == key;
  for (size_t i = 0; i < k.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(k[i])) != std::tolower(static_cast<unsigned char>(key[i])))
      return false;
  return true;
}

}  // namespace

std::string load_secret(const profile::Credential& c) {
  std::string v;
  if (!c.source_file.empty()) {
    auto text = os::read_file(c.source_file);
    if (!text)
      throw std::runtime_error("credential " + c.name + ": read " + c.source_file + ": " + text.error().message());
    v = std::move(*text);
    while (!v.empty() && (v.back() == '\n' || v.back() == '\r')) v.pop_back();
  } else {
    const char* e = std::getenv(c.source_env.c_str());
    if (!e) throw std::runtime_error("credential " + c.name + ": the supervisor's environment has no " + c.source_env);
    v = e;
  }
  if (v.empty()) throw std::runtime_error("credential " + c.name + ": its source is empty");
  for (unsigned char ch : v)
    if (ch < 0x20 || ch == 0x7f)
      throw std::runtime_error("credential " + c.name +
                               ": the value holds a control character (a header cannot carry it)");
  return v;
}

void BranchNetwork::prepare(const profile::Profile& profile, sandbox::BranchSpec& spec) {
  if (profile.network.mode == profile::NetworkPolicy::Mode::Host) return;
  spec.new_net = true;
  // Names resolve through the broker's DNS (for `none`, nothing answers there: lookups fail fast).
  if (auto r = os::make_dirs(spec.dir, 0755); !r)
    throw std::runtime_error("create " + spec.dir + ": " + r.error().message());
  spec.resolv_conf = spec.dir + "/resolv.conf";
  if (auto r = os::write_file_atomic(spec.resolv_conf, "nameserver 127.0.0.1\n", 0644); !r)
    throw std::runtime_error("write " + spec.resolv_conf + ": " + r.error().message());
  for (auto& m : masked_files(profile)) spec.masks.push_back(m);
}

std::vector<std::string> BranchNetwork::masked_files(const profile::Profile& profile) {
  std::vector<std::string> out;
  for (auto& c : profile.credentials)
    if (!c.source_file.empty()) out.push_back(c.source_file);
  return out;
}

BranchNetwork::BranchNetwork(uv_loop_t* loop, const profile::Profile& profile, const sandbox::LaunchedBranch& branch,
                             Emit emit, const std::string& proc)
    : profile_(profile), emit_(std::move(emit)) {
  const auto& net = profile.network;
  if (net.mode == profile::NetworkPolicy::Mode::Host) return;
  if (!branch.namespaced)
    throw std::runtime_error(std::string("network mode \"") + profile::network_mode_name(net.mode) +
                             "\" needs the agent in namespaces of its own, and it is not: " + branch.why_not);
  bool proxy = net.mode == profile::NetworkPolicy::Mode::Proxy;
  broker::BrokerConfig cfg;
  if (proxy) {
    cfg.network = net;
    cfg.credentials = profile.credentials;
    cfg.netns_pid = branch.pid;
    struct stat ns {};
    if (::fstat(branch.netns.get(), &ns) == 0) cfg.netns = {ns.st_dev, ns.st_ino};
    cfg.proc = proc;
    for (auto& c : profile.credentials) cfg.secrets.push_back(load_secret(c));
  }
  if (!branch.netns)
    throw std::runtime_error("network mode \"" + std::string(profile::network_mode_name(net.mode)) +
                             "\": the branch has no network namespace of its own");
  // `none`: the namespace and its loopback are all (sandbox::make_branch_pipes made both).
  if (!proxy) return;
  auto socks = setup_in_netns(branch.netns.get(), net.proxy_port);
  if (!socks) throw std::runtime_error("network of the branch: " + socks.error().message);

  auto async = loop::UvHandle<uv_async_t>::make(loop, uv_async_init, [](uv_async_t* a) noexcept {
    if (auto* self = static_cast<BranchNetwork*>(a->data)) self->drain();
  });
  if (!async) throw std::runtime_error("network of the branch: " + async.error().message);
  async_ = std::move(*async);
  async_->data = this;
  broker_ = std::make_unique<broker::Broker>(
      std::move(cfg), std::move(socks->tcp), std::move(socks->udp),
      [this](boost::json::object e) {
        {
          std::lock_guard lk(mu_);
          if (queue_.size() >= 10000) return;  // a flood of refusals cannot grow the supervisor without bound
          queue_.push_back(std::move(e));
        }
        uv_async_send(async_.get());
      },
      std::move(socks->dns_tcp));
}

BranchNetwork::~BranchNetwork() {
  broker_.reset();
  if (async_) {
    drain();
    async_.reset();
  }
}

void BranchNetwork::drain() noexcept {
  std::vector<boost::json::object> q;
  {
    std::lock_guard lk(mu_);
    q.swap(queue_);
  }
  // Called from the loop's async callback: an event that cannot be written is logged and
  // dropped, and the broker goes on.
  try {
    for (auto& e : q) emit_(std::move(e));
  } catch (const std::exception& e) {
    spdlog::error("record the broker's events: {}", e.what());
  }
}

void BranchNetwork::edit_env(std::vector<std::string>& env) const {
  const auto& net = profile_.network;
  std::vector<std::string> drop;
  for (auto& c : profile_.credentials)
    for (auto* k : {&c.source_env, &c.placeholder_env, &c.base_url_env})
      if (!k->empty()) drop.push_back(*k);
  bool isolated = net.mode != profile::NetworkPolicy::Mode::Host;
  std::vector<std::string> out;
  for (auto& v : env) {
    std::string_view kv = v;
    bool skip = false;
    for (auto& k : drop) skip |= env_key_is(kv, k);
    if (isolated)
      for (auto* k : {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}) skip |= env_key_is(kv, k, true);
    if (!skip) out.push_back(v);
  }
  if (net.mode == profile::NetworkPolicy::Mode::Proxy) {
    std::string url = "http://127.0.0.1:" + std::to_string(net.proxy_port);
    for (auto* k : {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"})
      out.emplace_back(std::string(k) + "=" + url);
    for (auto* k : {"NO_PROXY", "no_proxy"}) out.emplace_back(std::string(k) + "=localhost,127.0.0.1,::1");
    for (auto& c : profile_.credentials) {
      if (!c.placeholder_env.empty()) out.emplace_back(c.placeholder_env + "=" + c.placeholder);
      if (!c.base_url_env.empty()) out.emplace_back(c.base_url_env + "=" + url + "/" + c.name);
    }
  }
  env = std::move(out);
}

boost::json::object BranchNetwork::describe() const {
  const auto& net = profile_.network;
  boost::json::object o{{"mode", profile::network_mode_name(net.mode)},
                        {"isolated", net.mode != profile::NetworkPolicy::Mode::Host}};
  if (net.mode == profile::NetworkPolicy::Mode::Proxy) {
    boost::json::array allow, deny, creds, cidrs;
    for (auto& a : net.allow) allow.emplace_back(a);
    for (auto& c : net.allow_cidrs) cidrs.emplace_back(c);
    for (auto& d : net.deny) deny.emplace_back(d);
    for (auto& c : profile_.credentials)
      creds.emplace_back(boost::json::object{
          {"name", c.name}, {"bound_to", c.scheme + "://" + c.host + ":" + std::to_string(c.port) + c.path_prefix}});
    o["allow"] = std::move(allow);
    o["deny"] = std::move(deny);
    o["allow_cidrs"] = std::move(cidrs);  // the special-purpose ranges the broker may reach
    o["credentials"] = std::move(creds);
    o["proxy"] = "http://127.0.0.1:" + std::to_string(net.proxy_port);
    o["dns"] = "127.0.0.1:53";
  }
  return o;
}

}  // namespace sbx::supervisor
