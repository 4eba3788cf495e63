// sandboxer up --host H, down URL, ps: boxes on a host, through its shim (shims/).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <stdexcept>

#include "base/encoding.hpp"
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "cli/printer.hpp"
#include "cli/tokens.hpp"
#include "journal/journal.hpp"
#include "os/box-dirs.hpp"
#include "os/cgroup.hpp"
#include "os/files.hpp"
#include "os/pidfd.hpp"
#include "os/sys.hpp"
#include "os/unique-fd.hpp"
#include "profile/agent-env.hpp"
#include "shims/docker/docker.hpp"

namespace sbx::cli {

namespace dk = sbx::shims::docker;

namespace {
const char* kUpUsage =
    "usage: sandboxer up --host docker [--profile P] [--set F=V] [--env K=V] [--image I] [--name N] [-v SRC:DST[:ro]] "
    "[--publish-address IP] [--signing-key F] [--trust-key F]... -- CMD...";

void check_host(const std::string& host) {
  if (host.empty()) throw UsageError("--host is required (docker)");
  if (host != "docker") throw UsageError("--host " + host + ": not supported here (docker)");
}
}  // namespace

int cmd_up(const std::vector<std::string>& args) {
  auto a = parse_args(args, {.usage = kUpUsage,
                             .flags = {"--help"},
                             .options = {"--host", "--profile", "--set", "--env", "--image", "--name", "--volume",
                                         "--publish-address", "--signing-key", "--trust-key"},
                             .aliases = {{"-h", "--help"}, {"-v", "--volume"}},
                             .max_positionals = 0,
                             .command = CommandStart::after_dashdash});
  if (a.has("--help")) {
    std::cout << kUpUsage << "\n";
    return kExitOk;
  }
  dk::UpOptions o;
  o.profile = a.value_or("--profile", o.profile);
  o.overrides = a.values("--set");
  // K alone takes our value of K, as docker does: the container has none of our environment.
  for (auto& e : a.values("--env"))
    if (auto kv = profile::parse_env_assignment(e); !kv.empty()) o.env.push_back(std::move(kv));
  o.image = a.value_or("--image", o.image);
  o.name = a.value_or("--name", o.name);
  o.volumes = a.values("--volume");
  // A dockerd on another machine (DOCKER_HOST tcp:// or ssh://): where its box's API is published.
  o.publish_address = a.value_or("--publish-address", "");
  // The archive keys: the user's own pair unless a key is named. A box on another machine gets
  // its signing key copied there: a key of its own (that the other boxes trust) keeps the user's
  // off that host. A box always trusts its own signing key.
  o.signing_key = a.value_or("--signing-key", "");
  o.trust_keys = a.values("--trust-key");
  if (o.signing_key.empty() && !o.trust_keys.empty())
    a.fail("--trust-key: only with --signing-key (without one the box trusts the user's own key)");
  for (const auto* what : {"--signing-key", "--trust-key"})
    for (auto& f : a.values(what))
      if (::access(f.c_str(), R_OK) != 0) a.fail(std::string(what) + " " + f + ": " + std::strerror(errno));
  o.argv = a.command();
  check_host(a.value_or("--host", ""));
  // The container's command and environment go through docker's API, JSON text: a word that is
  // not UTF-8 would reach the box with U+FFFD for its bytes. `sandboxer run` takes any bytes.
  auto text_only = [](const std::string& what, const std::string& v) {
    if (base::utf8_valid_prefix(v) != v.size())
      throw UsageError(what + " \"" + printable(v) +
                       "\" is not UTF-8: a box's command and environment reach "
                       "docker as text (sandboxer run takes any bytes)");
  };
  for (size_t i = 0; i < o.argv.size(); ++i) text_only("CMD word " + std::to_string(i), o.argv[i]);
  for (auto& kv : o.env) text_only("--env", kv);
  if (o.argv.empty()) throw UsageError(std::string("no command given (expected -- CMD...)\n") + kUpUsage);
  o.box_root = state_home() + "/docker";
  auto box = dk::up(o, std::cerr);
  save_token(box.url, box.token);
  std::cerr << "box " << box.name << ": journal in " << box.state_dir
            << (box.state_dir.starts_with("volume:") ? " on the dockerd's host (sandboxer log URL)"
                                                     : " (sandboxer log DIR or URL)")
            << ", token in " << token_path(box.url) << "\n";
  std::cout << box.url << std::endl;  // the last line of stdout: what scripts read
  return 0;
}

namespace {

// The local boxes running now: the state dirs whose lock a sandboxer-init holds, found through
// its fds (os::dirs_locked_by: any state dir this process can see), and those under the
// default root (boxes started without --state-dir) whose holder's fds it cannot read, with the
// URL in STATE/url when it listens; with --all, the stopped ones too, under the default root and
// where the supervisors' record says (add_recorded). A box under the default root is named by its
// dir's name, any other by its state dir's path.
struct LocalBox {
  dk::BoxRecord rec;
  std::string pid;  // the supervisor's ("" where it is not known)
};
std::string real_or_same(const std::string& path) {
  std::error_code ec;
  auto real = std::filesystem::weakly_canonical(path, ec);
  return ec ? path : real.string();
}
// How a box that does not run ended, from its journal's last event: "exited CODE (REASON)", or
// "ended without box.exited" (its supervisor was killed, or crashed), or "no journal" (none, or
// no event in it).
std::string ended_status(const std::string& state_dir) {
  auto line = journal::Journal::last_line(state_dir + "/journal");
  if (!line) return "no journal";
  boost::json::object last;
  boost::system::error_code jec;
  if (auto v = boost::json::parse(*line, jec); !jec && v.is_object()) last = v.as_object();
  const auto* type = last.if_contains("type");
  if (!type || !type->is_string() || type->as_string() != "box.exited") return "ended without box.exited (killed?)";
  std::string code = last.contains("code") ? boost::json::serialize(last.at("code")) : "?";
  const auto* reason = last.if_contains("reason");
  return "exited " + code + (reason && reason->is_string() ? " (" + std::string(reason->as_string()) + ")" : "");
}

// The boxes that ran outside the default root, from the record their supervisors keep
// (os/box-dirs.hpp): those not listed yet, named by their state dirs.
template <class Add>
void add_recorded(std::vector<LocalBox>& out, std::set<std::string>& seen, const Add& add) {
  auto home = os::state_home();
  auto dirs =
      home ? os::recorded_box_dirs(*home, os::holds_box_json) : base::Result<std::vector<std::string>>(home.error());
  if (!dirs) {
    std::cerr << "sandboxer ps: " << dirs.error().message << " (the stopped boxes outside " << os::default_box_root()
              << " are not listed)\n";
    return;
  }
  for (auto& dir : *dirs) {
    std::string pid;
    if (seen.contains(dir)) continue;
    if (os::dir_lock_held(dir, &pid)) {
      add(dir, pid);  // running where its supervisor's fds are not to be read from here
    } else {
      seen.insert(dir);
      out.push_back({dk::BoxRecord{.name = dir, .state_dir = dir, .image = "-", .status = ended_status(dir)}, ""});
    }
  }
}

std::vector<LocalBox> local_boxes(bool stopped_too = false) {
  std::vector<LocalBox> out;
  std::set<std::string> seen;
  const std::string root = real_or_same(os::default_box_root());
  auto add = [&](const std::string& dir, const std::string& pid) {
    if (!seen.insert(dir).second) return;
    size_t slash = dir.rfind('/');
    dk::BoxRecord b{.name = dir.substr(0, slash) == root ? dir.substr(slash + 1) : dir, .state_dir = dir, .image = "-"};
    if (auto text = os::read_file(dir + "/url")) b.url = text->substr(0, text->find('\n'));
    b.status = "running" + (pid.empty() ? "" : ", pid " + pid);
    out.push_back({std::move(b), pid});
  };
  for (auto& d : os::dirs_locked_by("sandboxer-init")) add(d.path, std::to_string(d.pid));
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(root, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    std::string dir = it->path().string();
    std::string pid;
    if (it->is_symlink(ec) || !it->is_directory(ec)) continue;
    if (os::dir_lock_held(dir, &pid)) {
      add(dir, pid);
    } else if (stopped_too && seen.insert(dir).second) {
      out.push_back(
          {dk::BoxRecord{
               .name = it->path().filename().string(), .state_dir = dir, .image = "-", .status = ended_status(dir)},
           ""});
    }
  }
  if (stopped_too) add_recorded(out, seen, add);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.rec.name < b.rec.name; });
  return out;
}

// `down` of a local box: TERM to its supervisor (the box's shutdown, with the profile's grace
// period), then the wait for its end (its state dir's lock free).
int down_local(const LocalBox& b) {
  const std::string& dir = b.rec.state_dir;
  pid_t pid = 0;
  std::from_chars(b.pid.data(), b.pid.data() + b.pid.size(), pid);
  if (pid <= 0) throw std::runtime_error("box " + b.rec.name + ": its supervisor's pid is not visible here");
  auto fd = os::pidfd_open(pid);
  std::string holder;
  // The pid named again after the open: the same process, not one that took a freed pid.
  if (!fd || !os::dir_lock_held(dir, &holder) || holder != b.pid)
    throw std::runtime_error("box " + b.rec.name + ": its supervisor (pid " + b.pid + ") has gone");
  if (auto r = os::pidfd_signal(fd->get(), SIGTERM); !r)
    throw std::runtime_error("box " + b.rec.name + ": signal its supervisor (pid " + b.pid +
                             "): " + r.error().message());
  for (int i = 0; os::dir_lock_held(dir); ++i) {
    if (i == 1200) throw std::runtime_error("box " + b.rec.name + ": still running 120 s after TERM");
    ::usleep(100 * 1000);
  }
  std::cout << "box " << b.rec.name << " stopped; journal in " << dir << "\n";
  return 0;
}

// The box id in STATE/box.json, "" where there is none or it is not one a supervisor gives ("b-"
// and hex digits): the names of its branches' cgroups start with "sbx-ID-".
std::string box_id_of(const std::string& state_dir) {
  auto text = os::read_file(state_dir + "/box.json");
  if (!text) return "";
  boost::system::error_code ec;
  auto v = boost::json::parse(*text, ec);
  const auto* id = !ec && v.is_object() ? v.as_object().if_contains("id") : nullptr;
  if (!id || !id->is_string()) return "";
  std::string s(id->as_string());
  bool hex = s.size() > 2 && std::all_of(s.begin() + 2, s.end(), [](char c) { return std::isxdigit(uint8_t(c)); });
  return s.starts_with("b-") && hex ? s : "";
}

// The cgroups a killed supervisor left (its branches' groups, sbx-ID-*), wherever in the host's
// hierarchies it made them: removed where empty. One that holds processes is named and left (they
// may be a running box's: one started from a copy of this state dir carries its id, in a cgroup
// elsewhere or in another container), as are all where a box this host lists runs with the id.
// Returns how many of them were left because they hold processes.
size_t release_stopped_cgroups(const std::string& dir) {
  std::string id = box_id_of(dir);
  if (id.empty()) return 0;
  for (auto& b : local_boxes())
    if (box_id_of(b.rec.state_dir) == id) {
      std::cout << "left its cgroups (sbx-" << id << "-*): box " << printable(b.rec.name)
                << ", which runs, has its id\n";
      return 0;
    }
  std::string prefix = "sbx-" + id + "-";
  size_t held = 0;
  for (auto& host : os::hosts_holding(prefix))
    held += os::CgroupDir::release_below(
        host, prefix, false,
        [](const std::string& group, bool) {
          std::cout << "removed cgroup " << group << ", which its supervisor left\n";
        },
        [](const std::string& group, const std::string& why) {
          std::cerr << "sandboxer down: cgroup " << group << ": " << why << "\n";
        });
  return held;
}

// A local state dir no supervisor holds: its box is not running. One killed outright (the host's
// OOM killer) left its branches' mounts in the host's mount namespace, and their cgroups: released
// here, as the next run on the state dir would. Returns how many groups were left because they
// hold processes (named on stderr).
size_t release_stopped(const std::string& dir) {
  auto r = os::release_mounts_under(dir + "/branches", [](const os::MountPoint& m) {
    std::cout << "unmounted " << printable(m.path) << " (" << m.fstype << "), which its supervisor left mounted\n";
  });
  if (!r)
    throw std::runtime_error("box " + dir + " is not running; " + r.error().message + " (its supervisor left it)");
  return release_stopped_cgroups(dir);
}

// `down` of a stopped local box: what it left released; its journal and files stay. Returns what
// release_stopped does.
size_t down_stopped_local(const std::string& dir, const std::string& name) {
  size_t held = release_stopped(dir);
  std::cout << "box " << printable(name) << " was not running; journal in " << printable(dir) << "\n";
  return held;
}

// `down --rm` removes no state dir whose box still has processes (an agent that outlived its
// supervisor and ns-init, as one without namespaces may): their files would go from under them.
void require_no_processes(size_t held, const std::string& name) {
  if (held > 0)
    throw std::runtime_error("box " + printable(name) + ": its cgroups still hold processes (named above): its " +
                             "state dir is not removed; end them and run `sandboxer down --rm` again");
}

// The stopped local box `which` names: a state dir (one holding a box.json, not a symlink), by its
// path or by its name under the default root; "" where there is none.
std::string stopped_state_dir(const std::string& which, const std::string& as_dir) {
  for (const std::string& dir : {as_dir, which.find('/') == std::string::npos && !as_dir.empty()
                                             ? real_or_same(os::default_box_root()) + "/" + which
                                             : std::string()})
    if (!dir.empty() && os::holds_box_json(dir)) return dir;
  return "";
}

// What a supervisor makes in its state dir (and the temporaries of its atomic writes,
// ".NAME.tmp-*"): all `down --rm` removes there.
bool box_made(std::string_view name) {
  static constexpr std::string_view kMade[] = {"box.json", "journal", "branches", "snapshots", "url", "persist.json"};
  for (auto m : kMade)
    if (name == m ||
        (name.starts_with(".") && name.substr(1).starts_with(m) && name.substr(1 + m.size()).starts_with(".tmp-")))
      return true;
  return false;
}

// A supervisor's state dir holds a journal beside box.json: `down --rm` removes no other directory.
void require_journal(const std::string& dir) {
  struct stat st {};
  if (::lstat((dir + "/journal").c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw std::runtime_error(printable(dir) + " holds no journal directory: not a box's state dir, nothing removed");
}

// `down --rm`: the state dir of a box that has stopped (and whose leftovers are released), removed
// under its lock (a supervisor started on it meanwhile is refused), on its own filesystem only:
// where a mount is left under it, nothing is removed.
void remove_stopped(const std::string& dir, const std::string& name) {
  std::string holder;
  auto lock = os::lock_dir(dir, &holder);
  if (!lock)
    throw std::runtime_error("box " + printable(name) + " runs again" +
                             (holder.empty() ? "" : " (pid " + holder + ")") + ": its state dir is not removed");
  if (auto left = os::mounts_under(dir); !left.empty())
    throw std::runtime_error("box " + printable(name) + ": " + printable(left.front().path) +
                             " is mounted in its state dir; nothing removed");
  // What the box made, each entry on its own; anything else there (a state dir given as a
  // directory that held files of its own) stays, and so does the directory.
  os::UniqueFd at(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!at)
    throw std::runtime_error("box " + printable(name) + ": open " + printable(dir) + ": " + std::strerror(errno));
  std::vector<std::string> others;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(dir, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    std::string entry = it->path().filename().string();
    if (!box_made(entry)) {
      others.push_back(entry);
    } else if (auto r = os::remove_tree_at(at.get(), entry, dir + "/" + entry); !r) {
      // Each entry reached from its directory's fd: nothing the agent left (a symlink, one swapped
      // in for a directory meanwhile) is followed, no mount entered.
      throw std::runtime_error("box " + printable(name) +
                               ": its state dir partly removed: " + printable(r.error().message));
    }
  }
  if (ec) throw std::runtime_error("box " + printable(name) + ": list " + printable(dir) + ": " + ec.message());
  if (others.empty() && ::rmdir(dir.c_str()) != 0)
    throw std::runtime_error("box " + printable(name) + ": remove " + printable(dir) + ": " + std::strerror(errno));
  if (others.empty()) {
    std::cout << "removed its state dir " << printable(dir) << " (journal, snapshots, files)\n";
    return;
  }
  std::sort(others.begin(), others.end());
  std::cout << "removed what the box made in " << printable(dir) << " (journal, snapshots, files); left the "
            << "directory and what no box makes: " << printable(others.front())
            << (others.size() > 1 ? " and " + std::to_string(others.size() - 1) + " more" : "") << "\n";
}

}  // namespace

int cmd_down(const std::vector<std::string>& args) {
  auto a = parse_args(args, {.usage = "usage: sandboxer down [--rm] URL|NAME|STATE_DIR", .flags = {"--rm"}});
  a.expect_positionals(1);
  const std::string& which = a.positionals()[0];
  bool rm = a.has("--rm");
  const std::string as_dir = which.find("://") == std::string::npos ? real_or_same(which) : "";
  for (auto& b : local_boxes())
    if (b.rec.name == which || (!b.rec.url.empty() && b.rec.url == which) || b.rec.state_dir == as_dir) {
      if (rm) require_journal(b.rec.state_dir);
      down_local(b);
      if (rm) {
        require_no_processes(release_stopped(b.rec.state_dir), b.rec.name);
        remove_stopped(b.rec.state_dir, b.rec.name);
      }
      return 0;
    }
  // A state dir no supervisor holds (a path, or a name under the default root): a stopped box.
  if (std::string dir = stopped_state_dir(which, as_dir); !dir.empty()) {
    if (rm) require_journal(dir);
    size_t held = down_stopped_local(dir, dir == as_dir ? dir : which);
    if (rm) {
      require_no_processes(held, dir == as_dir ? dir : which);
      remove_stopped(dir, dir == as_dir ? dir : which);
    }
    return 0;
  }
  if (rm)
    throw std::runtime_error("--rm removes a local box's state dir: no local box is named " + printable(which) +
                             " (a docker box's `down` removes its container)");
  // Not a local box: a docker one, or none. A host whose docker cannot be asked said only
  // docker's words ("Cannot connect to the Docker daemon"), which do not say that no local box
  // has that name or URL either.
  dk::BoxRecord box;
  try {
    box = dk::down(which);
  } catch (const std::exception& e) {
    throw std::runtime_error("no local box is " + printable(which) +
                             " (sandboxer ps --all lists them); docker's: " + e.what());
  }
  if (!box.url.empty()) forget_token(box.url);
  std::cout << "box " << box.name << " stopped and removed; journal in " << box.state_dir << "\n";
  return 0;
}

int cmd_ps(const std::vector<std::string>& args) {
  auto a = parse_args(
      args, {.usage = "usage: sandboxer ps [--all] [--json]", .flags = {"--json", "--all"}, .max_positionals = 0});
  bool as_json = a.has("--json");
  std::vector<std::pair<std::string, dk::BoxRecord>> boxes;
  for (auto& b : local_boxes(a.has("--all"))) boxes.emplace_back("local", std::move(b.rec));
  // Docker's boxes where its daemon answers; where it does not, the local ones still list, and
  // why docker's do not is said. A host without docker has none to list, and nothing to say.
  if (dk::docker_installed()) {
    try {
      for (auto& b : dk::ps()) boxes.emplace_back("docker", std::move(b));
    } catch (const std::exception& e) {
      std::cerr << "sandboxer ps: " << e.what() << " (docker's boxes are not listed)\n";
    }
  }
  // What a state dir holds (its url file, its path) may come from a box's agent where it runs
  // without namespaces: shown as a terminal may show it.
  if (as_json) {
    for (auto& [host, b] : boxes)
      std::cout << json_line(boost::json::object{{"name", base::utf8_lossy(b.name)},
                                                 {"url", base::utf8_lossy(b.url)},
                                                 {"host", host},
                                                 {"state_dir", base::utf8_lossy(b.state_dir)},
                                                 {"image", base::utf8_lossy(b.image)},
                                                 {"status", b.status}})
                << "\n";
    return 0;
  }
  std::cout << "URL\tNAME\tHOST\tSTATUS\tIMAGE\n";
  for (auto& [host, b] : boxes)
    std::cout << (b.url.empty() ? "-" : printable(b.url)) << "\t" << printable(b.name) << "\t" << host << "\t"
              << printable(b.status) << "\t" << printable(b.image) << "\n";
  return 0;
}

}  // namespace sbx::cli
