#pragma once
#include <string>
#include <vector>

namespace sbx::cli {

int cmd_run(const std::vector<std::string>& args);
int cmd_log(const std::vector<std::string>& args);
int cmd_checkpoint(const std::vector<std::string>& args);
int cmd_restore_or_fork(const std::string& cmd, const std::vector<std::string>& args);
int cmd_snapshots(const std::vector<std::string>& args);
int cmd_export(const std::vector<std::string>& args);
int cmd_import(const std::vector<std::string>& args);
int cmd_attach(const std::vector<std::string>& args);
int cmd_exec(const std::vector<std::string>& args);
int cmd_cp(const std::vector<std::string>& args);
int cmd_stats(const std::vector<std::string>& args);
int cmd_doctor(const std::vector<std::string>& args);
int cmd_up(const std::vector<std::string>& args);
int cmd_down(const std::vector<std::string>& args);
int cmd_ps(const std::vector<std::string>& args);
int cmd_image(const std::vector<std::string>& args);
/// `fork URL --snapshot S -n N --host docker`: N new containers, each restoring S (fork-docker.cpp).
int fork_on_docker(const std::string& url, const std::string& token_file, const std::string& snap, int n);

/// sandboxer-init beside this binary, else on PATH.
std::string find_init_binary();

}  // namespace sbx::cli
