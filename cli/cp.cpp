// sandboxer cp [-r] SRC DST: a file, or with -r a directory, into or out of a box; one side is
// URL:PATH (ws://127.0.0.1:7000:/workspace/file), the other a local path. fs.read and fs.write
// move each file in binary frames (session.hpp); -r walks the tree with fs.list on the box's side
// and the local directory on the other, then moves its files 64 to a connection. As cp and cp -r:
// a DST that is a directory (or, for a file out of the box, ends with "/") receives SRC by its
// name, else DST becomes the copy. Files keep their
// permission bits (no set-id bits), directories theirs; a symlink is copied as a symlink with the
// same text (fs.symlink), never followed, SRC itself included (without -r, as cp, SRC's file is
// copied through it). A FIFO, a socket or a device is not copied: each is named on stderr, and
// the exit status is 1 once the rest is. "-" is standard input or output (one file, not with -r).
// Into a box, each file is written atomic (fs.write): a new file beside it, renamed over it once
// whole, so the agent never reads a part and a failed copy leaves what was there, as rsync does.
#include <fcntl.h>
#include <poll.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>

#include "base/encoding.hpp"
#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/session.hpp"
#include "os/unique-fd.hpp"

namespace sbx::cli {

namespace json = boost::json;
namespace fs = std::filesystem;

namespace {

constexpr int kMaxDepth = 256;
constexpr size_t kBatch = 64;  // files a connection moves (each upload's file is open meanwhile)

// A tree's copy: walk() makes its directories and lists its files, copy() moves the files in
// batches on one connection each, then sets the modes a walk out of the box found.
class TreeCopy {
 public:
  explicit TreeCopy(Session& s) : s_(s) {}

  // The box's `dir` into the new local directory `to`.
  bool walk_out(const std::string& dir, const std::string& to, unsigned mode, int depth);
  // The local directory `from` into the box's `to` (made with `mode` if it is not there).
  bool walk_in(const fs::path& from, const std::string& to, unsigned mode, int depth);
  bool copy();
  bool skipped() const { return skipped_; }
  // A symlink of the box's (an entry of fs.list, or SRC's fs.stat not followed) made at `local`;
  // a local one made in the box at `path`. Never followed: cp -r copies a link as a link, SRC too.
  bool symlink_out(const json::object& e, const std::string& path, const std::string& local);
  bool symlink_in(const fs::path& from, const std::string& path);

 private:
  void skip(const std::string& what, const std::string& why) {
    s_.report("skipped " + printable(what) + ": " + why);
    skipped_ = true;
  }
  bool failed(const base::Error& e, const std::string& what) {
    s_.fail(e, what);
    return false;
  }

  struct File {
    std::string remote, local;
    unsigned mode;
  };
  Session& s_;
  bool upload_ = false;
  std::vector<File> files_;
  // Directories made, and the modes they get once filled: every local one; a box's one where its
  // mode lacks a bit of 0700, which it was made with meanwhile.
  std::vector<std::pair<std::string, unsigned>> dirs_;
  bool skipped_ = false;
};

std::string join(const std::string& dir, const std::string& name) {
  return dir.ends_with('/') ? dir + name : dir + "/" + name;
}

unsigned mode_of(const json::object& o, unsigned fallback) {
  auto* v = o.if_contains("mode");
  return v && v->is_number() ? static_cast<unsigned>(v->to_number<uint64_t>() & 0777) : fallback;
}

bool TreeCopy::walk_out(const std::string& dir, const std::string& to, unsigned mode, int depth) {
  if (depth > kMaxDepth) return failed({dir + ": directory tree too deep", "too_deep"}, "download");
  // Made anew (never into what is there) and private while it fills.
  if (::mkdir(to.c_str(), 0700) != 0) return failed({to + ": " + std::strerror(errno), "local"}, "download");
  dirs_.emplace_back(to, mode);
  auto r = s_.list(dir);
  if (r && !reply_ok(*r)) r = reply_error(*r);
  if (!r) return failed(r.error(), "list " + dir);
  std::set<std::string> seen;
  for (auto& v : sorted_entries(r->at("entries").as_array())) {
    if (!v.is_object()) continue;
    const auto& e = v.as_object();
    // A name that is not UTF-8 is its bytes (name_b64), and so are the requests that name it
    // (name_by_bytes).
    std::string name = entry_name(e), type = text_field(e, "type");
    std::string path = join(dir, name);
    // A listing read while the agent renames may name an entry twice: the first one is copied.
    if (!seen.insert(name).second) {
      skip(path, "listed twice (it changed while it was listed)");
      continue;
    }
    // A name is one entry of `to`: the box's word is not taken for it.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      skip(path, "not a name of one entry");
      continue;
    }
    if (type == "dir") {
      if (!walk_out(path, join(to, name), mode_of(e, 0755), depth + 1)) return false;
    } else if (type == "file") {
      files_.push_back({path, join(to, name), mode_of(e, 0644)});
    } else if (type == "symlink") {
      if (!symlink_out(e, path, join(to, name))) return false;
    } else {
      skip(path, "not a file, a directory or a symlink (a FIFO, a socket or a device)");
    }
  }
  return true;
}

// A symlink of the box made here with the same text (its bytes from target_b64 where they are
// not UTF-8), in a directory this copy made.
bool TreeCopy::symlink_out(const json::object& e, const std::string& path, const std::string& local) {
  std::string target = text_field(e, "target");
  if (auto* b = e.if_contains("target_b64"); b && b->is_string()) {
    std::string raw;
    if (base::base64_decode(std::string(b->as_string()), raw)) target = raw;
  }
  if (target.empty() || target.find('\0') != std::string::npos) {
    skip(path, "a symlink whose text the box did not give");
    return true;
  }
  if (::symlink(target.c_str(), local.c_str()) != 0)
    return failed({local + ": " + std::strerror(errno), "local"}, "download");
  return true;
}

// A local symlink made in the box with the same text (its bytes, UTF-8 or not: name_by_bytes).
bool TreeCopy::symlink_in(const fs::path& from, const std::string& path) {
  std::error_code ec;
  auto target = fs::read_symlink(from, ec);
  if (ec) return failed({from.string() + ": " + ec.message(), "local"}, "upload");
  auto r = s_.call({{"op", "fs.symlink"}, {"path", path}, {"target", target.string()}});
  return r ? true : failed(r.error(), "symlink " + path);
}

bool TreeCopy::walk_in(const fs::path& from, const std::string& to, unsigned mode, int depth) {
  upload_ = true;
  if (depth > kMaxDepth) return failed({from.string() + ": directory tree too deep", "too_deep"}, "upload");
  std::error_code ec;
  // Made with its own mode where the copy can fill it so; else with 0700 added until it is filled.
  auto r = s_.call({{"op", "fs.mkdir"}, {"path", to}, {"mode", mode | 0700}});
  if (!r) return failed(r.error(), "mkdir " + to);
  if ((mode & 0700) != 0700) dirs_.emplace_back(to, mode);
  std::vector<fs::directory_entry> entries;
  for (fs::directory_iterator it(from, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(*it);
  if (ec) return failed({from.string() + ": " + ec.message(), "local"}, "upload");
  std::sort(entries.begin(), entries.end());
  for (auto& e : entries) {
    auto est = e.symlink_status(ec);
    std::string name = e.path().filename().string();
    std::string path = join(to, name);  // its bytes, UTF-8 or not (name_by_bytes)
    unsigned perms = static_cast<unsigned>(est.permissions()) & 0777;
    if (est.type() == fs::file_type::directory) {
      if (!walk_in(e.path(), path, perms, depth + 1)) return false;
    } else if (est.type() == fs::file_type::regular) {
      files_.push_back({path, e.path().string(), perms});
    } else if (est.type() == fs::file_type::symlink) {
      if (!symlink_in(e.path(), path)) return false;
    } else {
      skip(e.path().string(), "not a file, a directory or a symlink");
    }
  }
  return true;
}

bool TreeCopy::copy() {
  for (size_t at = 0; at < files_.size(); at += kBatch) {
    std::vector<Session::LocalTransfer> batch;
    for (size_t i = at; i < std::min(files_.size(), at + kBatch); ++i) {
      const auto& f = files_[i];
      json::object req{{"op", upload_ ? "fs.write" : "fs.read"}, {"path", f.remote}};
      if (upload_) {
        req["mode"] = f.mode;
        req["atomic"] = true;
      }
      batch.push_back({std::move(req), f.local, upload_, !upload_});
    }
    auto results = s_.transfer_batch(std::move(batch));
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& f = files_[at + i];
      if (!results[i]) return failed(results[i].error(), (upload_ ? "upload to " : "download ") + f.remote);
      if (!upload_) ::chmod(f.local.c_str(), f.mode);
    }
  }
  // Deepest first: a directory without write permission is set once nothing more goes into it.
  for (auto it = dirs_.rbegin(); it != dirs_.rend(); ++it) {
    if (!upload_) {
      ::chmod(it->first.c_str(), it->second);
      continue;
    }
    auto r = s_.call({{"op", "fs.chmod"}, {"path", it->first}, {"mode", it->second}});
    if (!r) return failed(r.error(), "chmod " + it->first);
  }
  return true;
}

// Where a copy of `src_name` goes when the destination is `dst`: inside it when it is a directory.
std::string inside_if_dir(const std::string& dst, bool is_dir, const std::string& src_name) {
  return is_dir ? join(dst, src_name) : dst;
}

std::string base_name(std::string p) {
  while (p.size() > 1 && p.ends_with('/')) p.pop_back();
  auto slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

// Where one file out of the box at `src_path` goes: into `to` by its name where `to` is a
// directory (through a symlink, as cp follows the DST it is given) or ends with "/", else `to`.
std::string download_target(const std::string& to, const std::string& src_path) {
  std::error_code ec;
  return inside_if_dir(to, to.ends_with('/') || fs::is_directory(to, ec), base_name(src_path));
}

// Where the local file `from` goes in the box: into `dst_path` by its name where that is a
// directory there (fs.stat, following a symlink, as cp does its DST), else `dst_path`.
base::Result<std::string> upload_target(Session& s, const std::string& dst_path, const std::string& from) {
  auto st = s.request({{"op", "fs.stat"}, {"path", dst_path}});
  if (!st) return st.error();
  bool dir = reply_ok(*st) && text_field(*st, "type") == "dir";
  if (dst_path.ends_with('/') && !dir)
    return base::fail((reply_ok(*st) ? dst_path + ": not a directory" : reply_error(*st).message) +
                          " (a DST ending in / names a directory)",
                      reply_ok(*st) ? "not_a_directory" : reply_error(*st).code);
  return inside_if_dir(dst_path, dir, base_name(fs::absolute(from).lexically_normal().string()));
}

// One file either way, as `cp SRC DST`.
int copy_file(Session& s, const std::optional<RemotePath>& src, const std::optional<RemotePath>& dst,
              const std::string& from, const std::string& to) {
  if (src) {
    auto d = s.download({{"op", "fs.read"}, {"path", src->path}}, download_target(to, src->path));
    return d ? kExitOk : s.fail(d.error(), "download " + from);
  }
  auto path = upload_target(s, dst->path, from);
  if (!path) return s.fail(path.error(), "upload to " + to);
  auto u = s.upload({{"op", "fs.write"}, {"path", *path}, {"atomic", true}}, from);
  return u ? kExitOk : s.fail(u.error(), "upload to " + to);
}

int copy_tree(Session& s, const std::optional<RemotePath>& src, const std::optional<RemotePath>& dst,
              const std::string& from, const std::string& to) {
  TreeCopy t(s);
  bool ok;
  if (src) {
    auto st = s.call({{"op", "fs.stat"}, {"path", src->path}, {"follow", false}});
    if (!st) return s.fail(st.error(), "download " + from);
    if (text_field(*st, "type") == "symlink") {
      std::error_code ec;
      ok = t.symlink_out(*st, src->path, inside_if_dir(to, fs::is_directory(to, ec), base_name(src->path)));
      return ok && !t.skipped() ? kExitOk : kExitFailed;
    }
    if (text_field(*st, "type") != "dir") return copy_file(s, src, dst, from, to);
    std::error_code ec;
    std::string target = inside_if_dir(to, fs::is_directory(to, ec), base_name(src->path));
    ok = t.walk_out(src->path, target, mode_of(*st, 0755), 0) && t.copy();
  } else {
    std::error_code ec;
    auto local = fs::symlink_status(from, ec);
    if (local.type() != fs::file_type::directory && local.type() != fs::file_type::symlink)
      return copy_file(s, src, dst, from, to);
    auto st = s.request({{"op", "fs.stat"}, {"path", dst->path}});
    if (!st) return s.fail(st.error(), "upload to " + to);
    bool there = reply_ok(*st);
    if (local.type() == fs::file_type::symlink) {
      std::string name = base_name(fs::absolute(from).lexically_normal().string());
      ok = t.symlink_in(from, inside_if_dir(dst->path, there && text_field(*st, "type") == "dir", name));
      return ok && !t.skipped() ? kExitOk : kExitFailed;
    }
    if (there && text_field(*st, "type") != "dir")
      return s.fail({dst->path + ": exists and is not a directory", "exists"}, "upload to " + to);
    unsigned mode = static_cast<unsigned>(fs::status(from, ec).permissions()) & 0777;
    ok = t.walk_in(from, inside_if_dir(dst->path, there, base_name(fs::absolute(from).lexically_normal().string())),
                   mode, 0) &&
         t.copy();
  }
  return ok && !t.skipped() ? kExitOk : kExitFailed;
}

// "-": standard input or output. A download is written at its frames' offsets and an upload
// names its size first, so each goes through an unnamed file in $TMPDIR (O_TMPFILE: nothing is
// left there, however the command ends): standard input is read to its end, then uploaded; a
// download is written to standard output once it is whole, so a failed one writes nothing.
base::Result<os::UniqueFd> spool_file() {
  const char* env = std::getenv("TMPDIR");
  std::string dir = env && *env ? env : "/tmp";
  os::UniqueFd fd(::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  if (!fd) return base::sys_fail("make an unnamed file in " + dir + " ($TMPDIR) for \"-\"", errno, "local");
  return fd;
}

// Copies `in` (from its offset) to `out` until `in` ends; waits where `out` or `in` is
// non-blocking and not ready.
base::Result<void> pump(int in, int out, const char* in_name, const char* out_name) {
  // A call that would block waits until its fd is ready; one a signal cut short is made again.
  auto again = [](ssize_t r, int fd, short events) {
    if (r >= 0 || (errno != EAGAIN && errno != EINTR)) return false;
    pollfd p{fd, events, 0};
    if (errno == EAGAIN) ::poll(&p, 1, -1);
    return true;
  };
  std::vector<char> buf(1 << 20);
  for (;;) {
    ssize_t n = ::read(in, buf.data(), buf.size());
    if (again(n, in, POLLIN)) continue;
    if (n < 0) return base::sys_fail(std::string("read ") + in_name, errno, "local");
    if (n == 0) return {};
    for (ssize_t off = 0; off < n;) {
      ssize_t w = ::write(out, buf.data() + off, static_cast<size_t>(n - off));
      if (again(w, out, POLLOUT)) continue;
      if (w < 0) return base::sys_fail(std::string("write ") + out_name, errno, "local");
      off += w;
    }
  }
}

int copy_stdio(Session& s, const std::optional<RemotePath>& src, const std::optional<RemotePath>& dst,
               const std::string& from, const std::string& to) {
  std::string what = src ? "download " + from : "upload to " + to;
  auto spool = spool_file();
  if (!spool) return s.fail(spool.error(), what);
  int fd = spool->get();
  if (dst) {
    if (auto r = pump(STDIN_FILENO, fd, "standard input", "the spool file"); !r) return s.fail(r.error(), what);
    auto r = s.transfer_batch({{.req = {{"op", "fs.write"}, {"path", dst->path}, {"atomic", true}},
                                .local_path = "standard input",
                                .upload = true,
                                .fd = fd}});
    return r.front() ? kExitOk : s.fail(r.front().error(), what);
  }
  auto r =
      s.transfer_batch({{.req = {{"op", "fs.read"}, {"path", src->path}}, .local_path = "standard output", .fd = fd}});
  if (!r.front()) return s.fail(r.front().error(), what);
  if (::lseek(fd, 0, SEEK_SET) != 0) return s.fail(base::sys_fail("rewind the spool file", errno, "local"), what);
  if (auto w = pump(fd, STDOUT_FILENO, "the spool file", "standard output"); !w) return s.fail(w.error(), what);
  return kExitOk;
}

}  // namespace

int cmd_cp(const std::vector<std::string>& args) {
  auto a =
      parse_args(args, remote_spec({.usage = "usage: sandboxer cp [-r] SRC DST (one side URL:PATH)", .flags = {"-r"}}));
  a.expect_positionals(2);
  const auto& from = a.positionals()[0];
  const auto& to = a.positionals()[1];
  // "-" is standard input or output, as to docker cp and tar (./- names a file called -).
  bool stdio = from == "-" || to == "-";
  if (stdio && a.has("-r"))
    throw UsageError("-r with \"-\": a tree does not go through standard input or output (name a directory)");
  auto src = split_remote(from), dst = split_remote(to);
  if (src.has_value() == dst.has_value()) throw UsageError("one of SRC and DST is URL:PATH, the other a local path");
  Session s("cp", src ? src->url : dst->url, a);
  if (stdio) return copy_stdio(s, src, dst, from, to);
  if (a.has("-r")) return copy_tree(s, src, dst, from, to);
  return copy_file(s, src, dst, from, to);
}

}  // namespace sbx::cli
