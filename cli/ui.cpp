// sandboxer ui URL|STATE_DIR [--port P] [--open] [--token-file F]
// A live view of one box in the browser (ui/server.hpp): prints the page's address, serves it on
// 127.0.0.1 until SIGINT or SIGTERM. For a URL the box's token stays in this process.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <iostream>
#include <stdexcept>
#include <thread>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "cli/tokens.hpp"
#include "ui/server.hpp"

extern char** environ;

namespace sbx::cli {

namespace {

bool on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  size_t at = 0;
  while (at <= dirs.size()) {
    size_t end = dirs.find(':', at);
    if (end == std::string::npos) end = dirs.size();
    std::string candidate = dirs.substr(at, end - at) + "/" + name;
    if (end > at && ::access(candidate.c_str(), X_OK) == 0) return true;
    at = end + 1;
  }
  return false;
}

// The browser is the user's: a failure to start one is said and the page is served anyway.
void open_in_browser(const std::string& address) {
  if (!on_path("xdg-open")) {
    std::cerr << "sandboxer ui: --open: no xdg-open on PATH; open the address above\n";
    return;
  }
  std::string prog = "xdg-open";
  char* argv[] = {prog.data(), const_cast<char*>(address.c_str()), nullptr};
  pid_t pid = 0;
  if (int err = ::posix_spawnp(&pid, "xdg-open", nullptr, nullptr, argv, environ); err != 0) {
    std::cerr << "sandboxer ui: --open: start xdg-open: " << std::strerror(err) << "\n";
    return;
  }
  std::thread([pid] { ::waitpid(pid, nullptr, 0); }).detach();
}

std::string journal_dir_of(const std::string& dir) {
  std::string jdir = dir + "/journal";
  if (::access(jdir.c_str(), F_OK) == 0) return jdir;
  if (::access(dir.c_str(), F_OK) != 0) throw std::runtime_error(dir + ": no such directory");
  return dir;  // given the journal directory itself
}

}  // namespace

int cmd_ui(const std::vector<std::string>& args) {
  auto a = parse_args(args, {.usage = "usage: sandboxer ui URL|STATE_DIR [--port P] [--open] [--token-file F]",
                             .flags = {"--open"},
                             .options = {"--port", "--token-file"},
                             .max_positionals = 1});
  a.expect_positionals(1);
  const std::string& target = a.positionals()[0];
  ui::ServerOptions opts{.port = a.number<uint16_t>("--port", 0)};
  // The events the page sees are spooled in this user's state dir, not held in memory (where there
  // is none to use, they are).
  try {
    opts.spool_dir = state_home();
  } catch (const std::exception& e) {
    std::cerr << "sandboxer ui: " << e.what() << "; the events are kept in memory\n";
  }
  if (target.rfind("ws://", 0) == 0 || target.rfind("wss://", 0) == 0) {
    opts.box_url = target;
    opts.box_token = find_token(target, a.value_or("--token-file", ""));
    opts.insecure = std::getenv("SANDBOXER_INSECURE") != nullptr;
  } else {
    opts.journal_dir = journal_dir_of(target);
  }
  auto server = ui::Server::start(std::move(opts));
  if (!server) {
    std::cerr << "sandboxer ui: " << server.error().message << " (" << server.error().code << ")\n";
    return kExitFailed;
  }
  std::string address = (*server)->address();
  std::cout << address << std::endl;
  if (a.has("--open")) open_in_browser(address);
  (*server)->run();
  return kExitOk;
}

}  // namespace sbx::cli
