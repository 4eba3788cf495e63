#include "ui/store.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <limits>

namespace sbx::ui {

namespace {

constexpr size_t kFlushAt = 256 << 10;    // lines gathered before one write to the spool
constexpr size_t kRetryAfter = 4u << 20;  // more lines before a spool that failed is tried again

std::string string_field(const boost::json::object& o, std::string_view key) {
  auto it = o.find(key);
  return it != o.end() && it->value().is_string() ? std::string(it->value().as_string()) : std::string();
}

}  // namespace

Store::Store(std::string spool_dir, WarnFn warn) : spool_dir_(std::move(spool_dir)), warn_(std::move(warn)) {
  if (!warn_) warn_ = [](const std::string& m) { std::cerr << "sandboxer ui: " << m << "\n"; };
  name_id("");  // id 0: no such field
}

uint32_t Store::name_id(std::string_view name) {
  auto [it, added] = ids_.try_emplace(std::string(name), static_cast<uint32_t>(names_.size()));
  if (added) names_.emplace_back(name);
  return it->second;
}

bool Store::matches(const Entry& e, const Filter& f) const {
  if (!f.branch.empty() && names_[e.branch] != f.branch) return false;
  if (!f.proc.empty() && names_[e.proc] != f.proc) return false;
  return f.types.empty() || std::find(f.types.begin(), f.types.end(), names_[e.type]) != f.types.end();
}

bool Store::append(std::string_view line) {
  if (line.size() > std::numeric_limits<uint32_t>::max()) return false;
  boost::system::error_code ec;
  auto v = boost::json::parse(line, ec);
  if (ec || !v.is_object()) return false;
  const auto& o = v.as_object();
  auto seq = o.find("seq");
  if (seq == o.end() || !seq->value().is_int64() || seq->value().as_int64() <= 0) return false;
  auto s = static_cast<uint64_t>(seq->value().as_int64());
  if (s <= last_seq()) return false;
  std::string type = string_field(o, "type");
  if (type == "box.exited") ended_ = true;
  index_.push_back({.seq = s,
                    .offset = flushed_ + pending_.size(),
                    .length = static_cast<uint32_t>(line.size()),
                    .type = name_id(type),
                    .branch = name_id(string_field(o, "branch")),
                    .proc = name_id(string_field(o, "proc"))});
  pending_.append(line);
  if (pending_.size() >= next_flush_) flush();
  return true;
}

void Store::open_spool() {
  spool_tried_ = true;
  if (spool_dir_.empty()) return;
  // Unnamed: nothing to remove when this process ends, however it ends, and nothing another user
  // can open by name.
  int fd = ::open(spool_dir_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    warn_("the events' spool in " + spool_dir_ + ": " + std::strerror(errno) + "; the events are kept in memory");
    return;
  }
  spool_.reset(fd);
}

void Store::flush() {
  if (!spool_tried_) open_spool();
  if (!spool_) {
    next_flush_ = std::numeric_limits<size_t>::max();
    return;
  }
  size_t done = 0;
  while (done < pending_.size()) {
    ssize_t n =
        ::pwrite(spool_.get(), pending_.data() + done, pending_.size() - done, static_cast<off_t>(flushed_ + done));
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    // A full disk, a quota: what did not go stays in memory, and the spool is tried again once
    // another kRetryAfter has come.
    if (!spool_failing_)
      warn_("write the events' spool in " + spool_dir_ + ": " + (n < 0 ? std::strerror(errno) : "wrote nothing") +
            "; the events are kept in memory until it can be written again");
    spool_failing_ = true;
    break;
  }
  flushed_ += done;
  pending_.erase(0, done);
  if (pending_.empty() && spool_failing_) {
    spool_failing_ = false;
    warn_("the events' spool in " + spool_dir_ + " is written again");
  }
  next_flush_ = pending_.size() + (spool_failing_ ? kRetryAfter : kFlushAt);
}

std::string Store::line(size_t i) const {
  const Entry& e = index_.at(i);
  std::string out(e.length, '\0');
  size_t got = 0;
  // The part in the spool file, then the part still in memory.
  while (e.offset + got < flushed_ && got < e.length) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(e.length - got, flushed_ - (e.offset + got)));
    ssize_t n = ::pread(spool_.get(), out.data() + got, want, static_cast<off_t>(e.offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::string why = "read the events' spool at seq " + std::to_string(e.seq) + ": " +
                        (n < 0 ? std::strerror(errno) : "it ends early");
      warn_(why);
      boost::json::object lost{{"seq", e.seq}, {"type", "ui.unreadable"}, {"message", why}};
      return boost::json::serialize(lost);
    }
    got += static_cast<size_t>(n);
  }
  if (got < e.length) pending_.copy(out.data() + got, e.length - got, e.offset + got - flushed_);
  return out;
}

size_t Store::first_after(uint64_t since) const {
  auto it = std::upper_bound(index_.begin(), index_.end(), since, [](uint64_t s, const Entry& e) { return s < e.seq; });
  return static_cast<size_t>(it - index_.begin());
}

std::vector<size_t> Store::matching(const Filter& f) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < index_.size(); ++i)
    if (matches(index_[i], f)) out.push_back(i);
  return out;
}

}  // namespace sbx::ui
