// The seccomp program the supervisor builds for ns-init, and its cache in the user's state dir
// (sandbox::cached_seccomp): what is read back, and every file that is not.
#include <doctest/doctest.h>
#include <linux/seccomp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "base/encoding.hpp"
#include "sandbox/policy.hpp"
#include "temp-dir.hpp"

namespace fs = std::filesystem;
using namespace sbx::sandbox;

namespace {

const boost::json::object kDefault{{"policy", "default"}};

bool same(const std::vector<struct sock_filter>& a, const std::vector<struct sock_filter>& b) {
  return seccomp_program_bytes(a) == seccomp_program_bytes(b);
}

// The one cache file in `dir` (there is one per description and host).
fs::path cache_file(const fs::path& dir) {
  fs::path found;
  int n = 0;
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().starts_with("seccomp-")) {
      found = e.path();
      ++n;
    }
  REQUIRE(n == 1);
  return found;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

void put(const fs::path& p, const std::string& text, mode_t mode = 0600) {
  fs::remove(p);
  std::ofstream(p, std::ios::binary) << text;
  REQUIRE(::chmod(p.c_str(), mode) == 0);
}

}  // namespace

TEST_CASE("seccomp cache: built once, then read back the same") {
  sbx::test::TempDir d("seccomp-cache");
  auto first = cached_seccomp(kDefault, d.path);
  CHECK_FALSE(first.from_cache);
  CHECK(first.cache_error.empty());
  CHECK(same(first.program, build_seccomp(kDefault)));
  auto file = cache_file(d.path);
  struct stat st {};
  REQUIRE(::stat(file.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);

  auto again = cached_seccomp(kDefault, d.path);
  CHECK(again.from_cache);
  CHECK(same(again.program, first.program));

  // Another description is another file, built from its own rules.
  boost::json::object file_policy{{"policy", "file"}, {"base", "none"}, {"deny", boost::json::array{"chroot"}}};
  auto other = cached_seccomp(file_policy, d.path);
  CHECK_FALSE(other.from_cache);
  CHECK_FALSE(same(other.program, first.program));
  CHECK(cached_seccomp(file_policy, d.path).from_cache);
}

TEST_CASE("seccomp cache: none is no program and no file; no dir builds and says why") {
  sbx::test::TempDir d("seccomp-cache");
  CHECK(cached_seccomp({{"policy", "none"}}, d.path).program.empty());
  CHECK(fs::is_empty(d.path));
  auto no_dir = cached_seccomp(kDefault, "");
  CHECK(same(no_dir.program, build_seccomp(kDefault)));
  CHECK_FALSE(no_dir.cache_error.empty());
  auto gone = cached_seccomp(kDefault, (d.path / "missing").string());
  CHECK(same(gone.program, build_seccomp(kDefault)));
  CHECK(gone.cache_error.find("missing") != std::string::npos);
}

TEST_CASE("seccomp cache: a file that names other inputs, is cut short, or others may write is not used") {
  sbx::test::TempDir d("seccomp-cache");
  auto built = cached_seccomp(kDefault, d.path).program;
  auto file = cache_file(d.path);
  std::string good = slurp(file);
  size_t nl = good.find('\n');
  REQUIRE(nl != std::string::npos);
  std::string key = good.substr(0, nl), prog = good.substr(nl + 1);
  // The control: the file as written is used.
  CHECK(cached_seccomp(kDefault, d.path).from_cache);

  // A program that lets everything through (one instruction: RET ALLOW) under another key.
  struct sock_filter allow = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
  std::string allow_bytes(reinterpret_cast<const char*>(&allow), sizeof allow);
  std::string other_key = key;
  other_key.replace(other_key.find("\"policy\""), 8, "\"Policy\"");
  put(file, other_key + "\n" + allow_bytes);
  auto r = cached_seccomp(kDefault, d.path);
  CHECK_FALSE(r.from_cache);
  CHECK(same(r.program, built));
  CHECK(slurp(file) == good);  // written again

  put(file, key + "\n" + prog.substr(0, prog.size() - 3));  // not whole instructions
  CHECK_FALSE(cached_seccomp(kDefault, d.path).from_cache);

  put(file, key + "\n" + allow_bytes, 0620);  // the right key, but the group may write it
  r = cached_seccomp(kDefault, d.path);
  CHECK_FALSE(r.from_cache);
  CHECK(same(r.program, built));

  put(file, key + "\n");  // no program at all
  CHECK_FALSE(cached_seccomp(kDefault, d.path).from_cache);
}

TEST_CASE("seccomp cache: a symlink at the file's name is neither followed nor written through") {
  sbx::test::TempDir d("seccomp-cache");
  sbx::test::TempDir elsewhere("seccomp-target");
  auto built = cached_seccomp(kDefault, d.path).program;
  auto file = cache_file(d.path);
  std::string good = slurp(file);
  fs::path target = elsewhere.path / "target";
  put(target, good);  // a valid cache file, but reached through a link
  fs::remove(file);
  fs::create_symlink(target, file);
  auto r = cached_seccomp(kDefault, d.path);
  CHECK_FALSE(r.from_cache);
  CHECK(same(r.program, built));
  CHECK_FALSE(fs::is_symlink(file));  // replaced by the file written
  CHECK(slurp(target) == good);       // and nothing written where it pointed
}

TEST_CASE("seccomp cache: a build removes the programs of another kernel, and nothing else") {
  sbx::test::TempDir d("seccomp-cache");
  (void)cached_seccomp(kDefault, d.path);
  auto file = cache_file(d.path);
  std::string good = slurp(file);
  std::string key = good.substr(0, good.find('\n')), prog = good.substr(good.find('\n') + 1);
  auto host_replaced = [&](const std::string& field, const std::string& value) {
    auto k = boost::json::parse(key).as_object();
    k[field] = value;
    return boost::json::serialize(k);
  };
  fs::path old_kernel = d.path / "seccomp-00000000000000a1.bpf", old_lib = d.path / "seccomp-00000000000000a2.bpf";
  fs::path not_ours = d.path / "seccomp-00000000000000a3.bpf", not_a_key = d.path / "seccomp-00000000000000a4.bpf";
  fs::path other_name = d.path / "notes-00000000000000a5.bpf";
  put(old_kernel, host_replaced("kernel", "5.10.0-1 #1 SMP") + "\n" + prog);
  put(old_lib, host_replaced("libseccomp", "2.4.0") + "\n" + prog);
  put(not_ours, host_replaced("kernel", "5.10.0-1 #1 SMP") + "\n" + prog, 0620);  // others may write it
  put(not_a_key, "not a key\n" + prog);
  put(other_name, host_replaced("kernel", "5.10.0-1 #1 SMP") + "\n" + prog);

  // A start that finds its program looks at nothing else: the control, every file still there.
  CHECK(cached_seccomp(kDefault, d.path).from_cache);
  CHECK(fs::exists(old_kernel));
  CHECK(fs::exists(old_lib));

  // A build (another policy) removes the two of another host that are ours; the rest stays.
  boost::json::object file_policy{{"policy", "file"}, {"base", "none"}, {"deny", boost::json::array{"chroot"}}};
  CHECK_FALSE(cached_seccomp(file_policy, d.path).from_cache);
  CHECK_FALSE(fs::exists(old_kernel));
  CHECK_FALSE(fs::exists(old_lib));
  CHECK(fs::exists(not_ours));
  CHECK(fs::exists(not_a_key));
  CHECK(fs::exists(other_name));
  CHECK(slurp(file) == good);  // this host's program of another policy: kept, and still used
  CHECK(cached_seccomp(kDefault, d.path).from_cache);
  CHECK(cached_seccomp(file_policy, d.path).from_cache);
}

TEST_CASE("seccomp: ns-init takes the supervisor's program, whole, and never a description") {
  auto prog = build_seccomp(kDefault);
  std::string bytes(seccomp_program_bytes(prog));
  auto p = prepare_policy({{"seccomp_bpf", sbx::base::base64_encode(bytes)}});
  CHECK(same(p.seccomp, prog));
  CHECK(prepare_policy({}).seccomp.empty());
  CHECK_THROWS_WITH(prepare_policy({{"seccomp_bpf", sbx::base::base64_encode(bytes.substr(1))}}),
                    doctest::Contains("not a whole BPF program"));
  CHECK_THROWS_WITH(prepare_policy({{"seccomp_bpf", "%%%"}}), doctest::Contains("not a whole BPF program"));
  CHECK_THROWS_WITH(prepare_policy({{"seccomp_bpf", ""}}), doctest::Contains("not a whole BPF program"));
  CHECK_THROWS_WITH(prepare_policy({{"seccomp", kDefault}}), doctest::Contains("a policy description"));

  CHECK(seccomp_program_from(std::string(8, '\0')).has_value());
  CHECK_FALSE(seccomp_program_from("").has_value());
  CHECK_FALSE(seccomp_program_from(std::string(7, '\0')).has_value());
  CHECK(seccomp_program_from(std::string(kMaxSeccompInstructions * 8, '\0')).has_value());
  CHECK_FALSE(seccomp_program_from(std::string((kMaxSeccompInstructions + 1) * 8, '\0')).has_value());

  // The config carries the program the supervisor passes, and nothing for none.
  sbx::profile::Profile none;
  none.isolation.seccomp = "none";
  CHECK_FALSE(policy_to_json(none, 0, false, {}).contains("seccomp_bpf"));
  CHECK_FALSE(policy_to_json(none, 0, false, {}).contains("seccomp"));
  auto o = policy_to_json(sbx::profile::Profile{}, 0, false, prog);
  CHECK(same(prepare_policy(o).seccomp, prog));
}
