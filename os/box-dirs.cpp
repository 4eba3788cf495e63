// The record of the state dirs outside the default root (box-dirs.hpp).
#include "os/box-dirs.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <set>

#include "os/sys.hpp"

namespace sbx::os {
namespace {

std::string where(const std::string& home) { return home + "/" + kBoxDirsFile; }

// The record, open for appending and locked (LOCK_EX): the file at its name now, not one a
// compaction has renamed over while this process waited for the lock. nullopt where `create` is
// false and there is none.
base::Result<std::optional<UniqueFd>> open_locked(int home, const std::string& home_path, bool create) {
  for (int attempt = 0; attempt < 16; ++attempt) {
    auto fd = open_beneath(home, kBoxDirsFile, O_RDWR | O_APPEND | O_NONBLOCK | (create ? O_CREAT : 0), 0600);
    if (!fd && fd.error() == std::errc::no_such_file_or_directory && !create) return std::optional<UniqueFd>{};
    if (!fd && fd.error() == std::errc::too_many_symbolic_link_levels)
      return base::fail(where(home_path) + " is a symlink: not a record this user's boxes keep");
    if (!fd) return base::sys_fail("open " + where(home_path), fd.error());
    struct stat st {};
    if (::fstat(fd->get(), &st) != 0) return base::sys_fail("stat " + where(home_path), errno);
    if (!S_ISREG(st.st_mode) || !only_ours_to_write(st))
      return base::fail(where(home_path) + " is " +
                        (S_ISREG(st.st_mode) ? std::string("a file others may write, or not this user's")
                                             : file_type_name(st.st_mode)) +
                        ": not a record this user's boxes keep");
    while (::flock(fd->get(), LOCK_EX) != 0)
      if (errno != EINTR) return base::sys_fail("lock " + where(home_path), errno);
    struct stat now {};
    if (::fstatat(home, kBoxDirsFile, &now, AT_SYMLINK_NOFOLLOW) == 0 && now.st_dev == st.st_dev &&
        now.st_ino == st.st_ino)
      return std::optional<UniqueFd>{std::move(*fd)};
  }
  return base::fail("open " + where(home_path) + ": replaced 16 times while this process waited for it");
}

// The dirs a record's text names, each once, in order; `clean` false where a line was a repeat or
// no record (or, with `keep`, a dir it refused): the record is worth rewriting.
struct Parsed {
  std::vector<std::string> dirs;
  bool clean = true;
};
Parsed parse(std::string_view text, const std::function<bool(const std::string&)>& keep) {
  Parsed p;
  auto& out = p.dirs;
  bool& clean = p.clean;
  std::set<std::string> seen;
  for (size_t at = 0, n = 0; at < text.size(); ++n) {
    size_t nl = text.find('\n', at);
    std::string_view line = text.substr(at, nl == std::string_view::npos ? std::string_view::npos : nl - at);
    at = nl == std::string_view::npos ? text.size() : nl + 1;
    boost::system::error_code ec;
    auto v = boost::json::parse(line, ec);
    const boost::json::object* o = !ec && v.is_object() ? &v.as_object() : nullptr;
    const boost::json::value* dir = o ? o->if_contains("dir") : nullptr;
    if (!dir || !dir->is_string()) {
      if (n != 0 || !o || !o->contains("compacted")) clean = false;  // a compaction's first line, else no record
      continue;
    }
    std::string d(dir->as_string());
    if (!d.starts_with('/') || !seen.insert(d).second || (keep && !keep(d))) {
      clean = false;
      continue;
    }
    out.push_back(std::move(d));
  }
  return p;
}

base::Result<std::string> read_record(int fd, const std::string& home_path) {
  if (::lseek(fd, 0, SEEK_SET) < 0) return base::sys_fail("seek " + where(home_path), errno);
  auto text = read_all(fd);
  if (!text) return base::sys_fail("read " + where(home_path), text.error());
  return std::move(*text);
}

// Writes `dirs` as the whole record (a new file renamed over it), under the old one's lock.
base::Result<void> rewrite(int home, const std::string& home_path, const std::vector<std::string>& dirs) {
  std::string body;
  for (auto& d : dirs) body += boost::json::serialize(boost::json::object{{"dir", d}}) + "\n";
  auto head = [](uint64_t n) { return boost::json::serialize(boost::json::object{{"compacted", n}}) + "\n"; };
  std::string text = head(body.size() + head(body.size()).size()) + body;  // its whole length, give or take a digit
  if (auto r = write_file_atomic_at(home, kBoxDirsFile, text, 0600); !r)
    return base::sys_fail("rewrite " + where(home_path), r.error());
  return {};
}

// How long the record was at its last compaction (its first line), 0 where it does not say.
uint64_t compacted_length(int fd) {
  char head[64];
  ssize_t n = ::pread(fd, head, sizeof head, 0);
  if (n <= 0) return 0;
  std::string_view line(head, static_cast<size_t>(n));
  line = line.substr(0, line.find('\n'));
  boost::system::error_code ec;
  auto v = boost::json::parse(line, ec);
  const boost::json::value* c = !ec && v.is_object() ? v.as_object().if_contains("compacted") : nullptr;
  if (c && c->is_uint64()) return c->as_uint64();
  if (c && c->is_int64() && c->as_int64() > 0) return static_cast<uint64_t>(c->as_int64());
  return 0;
}

base::Result<UniqueFd> open_home(const std::string& home_path) {
  auto home = open_dir(home_path);
  if (!home) return base::sys_fail("open " + home_path, home.error());
  return std::move(*home);
}

}  // namespace

bool holds_box_json(const std::string& dir) {
  struct stat st {};
  return ::lstat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && ::lstat((dir + "/box.json").c_str(), &st) == 0 &&
         S_ISREG(st.st_mode);
}

base::Result<void> record_box_dir(const std::string& state_home, const std::string& dir, uint64_t compact_at) {
  if (auto r = own_private_dir(state_home); !r) return r.error();
  auto home = open_home(state_home);
  if (!home) return home.error();
  auto fd = open_locked(home->get(), state_home, true);
  if (!fd) return fd.error();
  int f = (*fd)->get();
  // On a line of its own where the last one was cut short (a full disk): only that one is lost.
  struct stat st {};
  char last = '\n';
  if (::fstat(f, &st) == 0 && st.st_size > 0 && ::pread(f, &last, 1, st.st_size - 1) != 1) last = '\n';
  std::string line = boost::json::serialize(boost::json::object{{"dir", dir}});
  if (last != '\n') line.insert(0, "\n");
  if (auto w = write_line(f, line); !w) return base::sys_fail("append to " + where(state_home), w.error());
  if (::fstat(f, &st) != 0 || static_cast<uint64_t>(st.st_size) < compact_at ||
      static_cast<uint64_t>(st.st_size) < 2 * compacted_length(f))
    return {};
  auto text = read_record(f, state_home);
  if (!text) return text.error();
  // Rewritten even where nothing is dropped: its new first line puts the next compaction at twice
  // its length, however many of the dirs are still there.
  return rewrite(home->get(), state_home, parse(*text, holds_box_json).dirs);
}

base::Result<std::vector<std::string>> recorded_box_dirs(const std::string& state_home,
                                                         const std::function<bool(const std::string&)>& keep) {
  auto home = open_dir(state_home);
  if (!home && home.error() == std::errc::no_such_file_or_directory) return std::vector<std::string>{};
  if (!home) return base::sys_fail("open " + state_home, home.error());
  auto fd = open_locked(home->get(), state_home, false);
  if (!fd) return fd.error();
  if (!*fd) return std::vector<std::string>{};
  auto text = read_record((*fd)->get(), state_home);
  if (!text) return text.error();
  auto parsed = parse(*text, keep);
  // A rewrite that fails (a full disk) leaves the record as it was: the list is the same.
  if (!parsed.clean) (void)rewrite(home->get(), state_home, parsed.dirs);
  return std::move(parsed.dirs);
}

}  // namespace sbx::os
