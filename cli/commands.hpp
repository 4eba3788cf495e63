#pragma once
// The subcommands of `sandboxer`, one file each (main.cpp dispatches), and the exit codes they
// share. Each parses its arguments with args.hpp; those that talk to a box do it through
// session.hpp.
#include <string>
#include <vector>

#include <boost/json/fwd.hpp>
#include <sandboxer/client.hpp>

namespace sbx::cli {

/// Exit codes. exec exits with the remote command's own status instead (126, 127, 128 + signal
/// and 255 for its own failures); run with the agent's.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;  ///< the box refused, or the connection or a local file failed
inline constexpr int kExitUsage = 2;   ///< a bad command line, or nothing to start with (main's catch)

int cmd_run(const std::vector<std::string>& args);
int cmd_log(const std::vector<std::string>& args);
int cmd_checkpoint(const std::vector<std::string>& args);
int cmd_restore(const std::vector<std::string>& args);
int cmd_fork(const std::vector<std::string>& args);
int cmd_snapshots(const std::vector<std::string>& args);
int cmd_export(const std::vector<std::string>& args);
int cmd_import(const std::vector<std::string>& args);
int cmd_send(const std::vector<std::string>& args);
int cmd_attach(const std::vector<std::string>& args);
int cmd_exec(const std::vector<std::string>& args);
int cmd_cp(const std::vector<std::string>& args);
int cmd_ls(const std::vector<std::string>& args);
int cmd_rm(const std::vector<std::string>& args);
int cmd_mkdir(const std::vector<std::string>& args);
int cmd_mv(const std::vector<std::string>& args);
int cmd_stats(const std::vector<std::string>& args);
int cmd_doctor(const std::vector<std::string>& args);
int cmd_up(const std::vector<std::string>& args);
int cmd_down(const std::vector<std::string>& args);
int cmd_ps(const std::vector<std::string>& args);
int cmd_image(const std::vector<std::string>& args);
int cmd_ui(const std::vector<std::string>& args);
/// New containers of fork and migrate: where a remote dockerd publishes their APIs, and the public
/// keys they trust besides the user's own (the source's signing key, where it has one of its own).
struct DockerTarget {
  std::string publish_address;
  std::vector<std::string> trust_keys;
};
/// `fork URL --snapshot S -n N --host docker`: N new containers, each restoring S (fork-docker.cpp).
int fork_on_docker(const std::string& url, const std::string& token_file, const std::string& snap, int n,
                   const DockerTarget& to);
/// `migrate URL --to docker`: the box's agent moved into one new container (fork-docker.cpp).
int migrate_on_docker(const std::string& url, const std::string& token_file, const DockerTarget& to);
/// `fork URL --snapshot S --to URL...`: S restored as copy i in the i-th idle box named (fork-docker.cpp).
int fork_into_boxes(const std::string& url, const std::string& token_file, const std::string& snap,
                    const std::vector<sdk::Endpoint>& boxes);
/// `migrate URL --to URL2`: the box's agent moved into the idle box at URL2 (fork-docker.cpp).
int migrate_into_box(const std::string& url, const std::string& token_file, const sdk::Endpoint& box);
int cmd_migrate(const std::vector<std::string>& args);
/// restore's and fork's request (`op` restore or fork) sent to the box at `url`, and its reply
/// reported: each copy on a line `<branch> <proc>`, or the reply as JSON (restore.cpp).
int restore_in_box(const std::string& cmd, const std::string& url, const std::string& token_file,
                   boost::json::object req, bool as_json);

/// sandboxer-init beside this binary, else on PATH.
std::string find_init_binary();

}  // namespace sbx::cli
