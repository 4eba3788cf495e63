// The network of a restored or forked copy. A branch's broker lives in the supervisor: its
// listening sockets sit inside the branch's network namespace but belong to the supervisor, so
// criu dumps none of them, and a copy comes back in a network namespace of its own with nothing
// listening there. These hooks (which checkpoint/restore.cpp reaches through checkpoint::Host,
// box-checkpoint.cpp) give each copy what the original had: loopback, and for `proxy` a broker of
// its own at the same address and port (the restored agent holds its *_BASE_URL and proxy
// variables in memory), with the same allowlist and credentials, its refusals reported on the
// copy's branch.
#include <spdlog/spdlog.h>

#include "supervisor/box.hpp"

namespace sbx::supervisor {

base::Result<void> Box::prepare_copy_network(sandbox::BranchSpec& spec) {
  try {
    BranchNetwork::prepare(opts_.profile, spec);
    return {};
  } catch (const std::exception& e) {
    return base::fail(std::string("network of the copy: ") + e.what());
  }
}

base::Result<void> Box::attach_copy_network(Branch& b, std::vector<std::string>* env) {
  try {
    auto net = std::make_unique<BranchNetwork>(
        loop_, opts_.profile, b.launched, [this, name = b.name](boost::json::object e) { emit(name, std::move(e)); },
        b.main_proc);
    if (env) net->edit_env(*env);
    // A box started from an archive says in its box.started what its restored branch got.
    if (b.name == "main" && !pending_started_.empty()) pending_started_["network"] = net->describe();
    copy_networks_[b.name] = std::move(net);
    return {};
  } catch (const std::exception& e) {
    return base::fail(std::string("network of the copy: ") + e.what());
  }
}

std::vector<std::string> Box::branch_masks() const {
  auto masks = base_masks();
  for (auto& m : BranchNetwork::masked_files(opts_.profile)) masks.push_back(m);
  return masks;
}

boost::json::object Box::network_manifest() const {
  const auto& net = opts_.profile.network;
  boost::json::object o{{"mode", profile::network_mode_name(net.mode)}};
  if (net.mode == profile::NetworkPolicy::Mode::Proxy) {
    o["proxy_port"] = net.proxy_port;
    boost::json::array creds;
    for (auto& c : opts_.profile.credentials) creds.emplace_back(c.name);
    o["credentials"] = std::move(creds);
  }
  return o;
}

base::Result<void> Box::copy_network_possible(const boost::json::object& manifest) const {
  auto* v = manifest.if_contains("network");
  if (!v || !v->is_object()) return {};  // an archive from before the field: nothing to compare
  const auto& theirs = v->as_object();
  const auto& net = opts_.profile.network;
  std::string mode =
      theirs.contains("mode") && theirs.at("mode").is_string() ? std::string(theirs.at("mode").as_string()) : "";
  std::string mine = profile::network_mode_name(net.mode);
  if (mode != mine)
    return base::fail("the snapshot's agent ran with network \"" + mode + "\", and this box's profile has network \"" +
                          mine + "\": its copy would not get the network it expects",
                      "incompatible");
  if (net.mode != profile::NetworkPolicy::Mode::Proxy) return {};
  auto* port = theirs.if_contains("proxy_port");
  if (port && port->is_int64() && port->as_int64() != net.proxy_port)
    return base::fail("the snapshot's agent reaches its broker at 127.0.0.1:" + std::to_string(port->as_int64()) +
                          ", and this box's profile puts it at port " + std::to_string(net.proxy_port),
                      "incompatible");
  if (auto* creds = theirs.if_contains("credentials"); creds && creds->is_array())
    for (auto& c : creds->as_array()) {
      if (!c.is_string()) continue;
      bool found = false;
      for (auto& mine_c : opts_.profile.credentials) found |= mine_c.name == c.as_string();
      if (!found)
        return base::fail("the snapshot's agent uses credential \"" + std::string(c.as_string()) +
                              "\", which this box's profile does not name",
                          "incompatible");
    }
  return {};
}

}  // namespace sbx::supervisor
