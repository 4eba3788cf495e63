#include "ui/store.hpp"

#include <algorithm>
#include <boost/json.hpp>

namespace sbx::ui {

namespace {
std::string string_field(const boost::json::object& o, std::string_view key) {
  auto it = o.find(key);
  return it != o.end() && it->value().is_string() ? std::string(it->value().as_string()) : std::string();
}
}  // namespace

bool Filter::matches(const StoredEvent& e) const {
  if (!branch.empty() && e.branch != branch) return false;
  if (!proc.empty() && e.proc != proc) return false;
  return types.empty() || std::find(types.begin(), types.end(), e.type) != types.end();
}

bool Store::append(std::string_view line) {
  boost::system::error_code ec;
  auto v = boost::json::parse(line, ec);
  if (ec || !v.is_object()) return false;
  const auto& o = v.as_object();
  auto seq = o.find("seq");
  if (seq == o.end() || !seq->value().is_int64() || seq->value().as_int64() <= 0) return false;
  StoredEvent e{.seq = static_cast<uint64_t>(seq->value().as_int64()),
                .type = string_field(o, "type"),
                .branch = string_field(o, "branch"),
                .proc = string_field(o, "proc"),
                .line = std::string(line)};
  if (e.seq <= last_seq()) return false;
  if (e.type == "box.exit") ended_ = true;
  events_.push_back(std::move(e));
  return true;
}

size_t Store::first_after(uint64_t since) const {
  auto it = std::upper_bound(events_.begin(), events_.end(), since,
                             [](uint64_t s, const StoredEvent& e) { return s < e.seq; });
  return static_cast<size_t>(it - events_.begin());
}

std::vector<size_t> Store::matching(const Filter& f) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < events_.size(); ++i)
    if (f.matches(events_[i])) out.push_back(i);
  return out;
}

}  // namespace sbx::ui
