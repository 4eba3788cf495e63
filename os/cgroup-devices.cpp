// The devices a branch may use: cgroup v1's devices controller, or on v2 a device program
// assembled here by hand (BPF_PROG_TYPE_CGROUP_DEVICE through bpf(2), as runc and crun do:
// libbpf is not needed for a dozen instructions).
#include <fcntl.h>
#include <linux/bpf.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "os/cgroup.hpp"
#include "os/sys.hpp"

namespace sbx::os {

namespace {

Result<void> write_rule(const std::string& path, const std::string& v) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) return last_error();
  if (::write(fd.get(), v.data(), v.size()) < 0) return last_error();
  return {};
}

std::string rule_text(const DeviceRule& r) {
  auto num = [](int n) { return n < 0 ? std::string("*") : std::to_string(n); };
  return std::string(1, r.type) + " " + num(r.major) + ":" + num(r.minor) + " " + r.access;
}

Result<void> set_devices_v1(const std::string& dir, const std::vector<DeviceRule>& allow) {
  if (auto r = write_rule(dir + "/devices.deny", "a"); !r) return r;
  // One open for every rule, but one write per rule: the kernel applies only the first rule of
  // a write and ignores the lines after it without an error.
  UniqueFd fd(::open((dir + "/devices.allow").c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) return last_error();
  for (auto& rule : allow) {
    std::string v = rule_text(rule);
    if (::write(fd.get(), v.data(), v.size()) != static_cast<ssize_t>(v.size())) return last_error();
  }
  return {};
}

// The program sees struct bpf_cgroup_dev_ctx {u32 access_type (access << 16 | type); u32 major;
// u32 minor;} in r1 and returns 1 to allow, 0 to refuse (EPERM).
struct Asm {
  std::vector<struct bpf_insn> code;
  void emit(uint8_t op, uint8_t dst, uint8_t src, int16_t off, int32_t imm) {
    struct bpf_insn i {};
    i.code = op;
    i.dst_reg = dst & 0xf;
    i.src_reg = src & 0xf;
    i.off = off;
    i.imm = imm;
    code.push_back(i);
  }
};

std::vector<struct bpf_insn> device_program(const std::vector<DeviceRule>& allow) {
  Asm a;
  // r2 = type, r3 = access, r4 = major, r5 = minor.
  a.emit(BPF_LDX | BPF_MEM | BPF_W, 2, 1, 0, 0);
  a.emit(BPF_ALU | BPF_AND | BPF_K, 2, 0, 0, 0xffff);
  a.emit(BPF_LDX | BPF_MEM | BPF_W, 3, 1, 0, 0);
  a.emit(BPF_ALU | BPF_RSH | BPF_K, 3, 0, 0, 16);
  a.emit(BPF_LDX | BPF_MEM | BPF_W, 4, 1, 4, 0);
  a.emit(BPF_LDX | BPF_MEM | BPF_W, 5, 1, 8, 0);
  for (auto& rule : allow) {
    int32_t access = 0;
    for (const char* c = rule.access; *c; ++c)
      access |= *c == 'r' ? BPF_DEVCG_ACC_READ : *c == 'w' ? BPF_DEVCG_ACC_WRITE : *c == 'm' ? BPF_DEVCG_ACC_MKNOD : 0;
    // Each check jumps past the rule's block when it does not match; offsets are patched below.
    std::vector<size_t> jumps;
    int32_t type = rule.type == 'b' ? BPF_DEVCG_DEV_BLOCK : BPF_DEVCG_DEV_CHAR;
    jumps.push_back(a.code.size());
    a.emit(BPF_JMP | BPF_JNE | BPF_K, 2, 0, 0, type);
    // Any access bit outside the rule's: r1 = access & ~allowed, non-zero -> next rule.
    a.emit(BPF_ALU64 | BPF_MOV | BPF_X, 1, 3, 0, 0);
    a.emit(BPF_ALU | BPF_AND | BPF_K, 1, 0, 0, ~access & 0x7);
    jumps.push_back(a.code.size());
    a.emit(BPF_JMP | BPF_JNE | BPF_K, 1, 0, 0, 0);
    if (rule.major >= 0) {
      jumps.push_back(a.code.size());
      a.emit(BPF_JMP | BPF_JNE | BPF_K, 4, 0, 0, rule.major);
    }
    if (rule.minor >= 0) {
      jumps.push_back(a.code.size());
      a.emit(BPF_JMP | BPF_JNE | BPF_K, 5, 0, 0, rule.minor);
    }
    a.emit(BPF_ALU64 | BPF_MOV | BPF_K, 0, 0, 0, 1);
    a.emit(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);
    size_t end = a.code.size();
    for (size_t j : jumps) a.code[j].off = static_cast<int16_t>(end - j - 1);
  }
  a.emit(BPF_ALU64 | BPF_MOV | BPF_K, 0, 0, 0, 0);
  a.emit(BPF_JMP | BPF_EXIT, 0, 0, 0, 0);
  return a.code;
}

Result<void> set_devices_v2(const std::string& dir, const std::vector<DeviceRule>& allow) {
  auto prog = device_program(allow);
  static const char license[] = "Apache-2.0";
  union bpf_attr load {};
  load.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
  load.insns = reinterpret_cast<uint64_t>(prog.data());
  load.insn_cnt = static_cast<uint32_t>(prog.size());
  load.license = reinterpret_cast<uint64_t>(license);
  UniqueFd pfd(static_cast<int>(::syscall(SYS_bpf, BPF_PROG_LOAD, &load, sizeof load)));
  if (!pfd) return last_error();
  UniqueFd cg(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!cg) return last_error();
  union bpf_attr attach {};
  attach.target_fd = static_cast<uint32_t>(cg.get());
  attach.attach_bpf_fd = static_cast<uint32_t>(pfd.get());
  attach.attach_type = BPF_CGROUP_DEVICE;
  attach.attach_flags = BPF_F_ALLOW_MULTI;
  // The group holds the program from here on; our fd may close.
  if (::syscall(SYS_bpf, BPF_PROG_ATTACH, &attach, sizeof attach) != 0) return last_error();
  return {};
}

}  // namespace

const std::vector<DeviceRule>& default_device_rules() {
  static const std::vector<DeviceRule> r = {
      {'c', 1, 3, "rwm"},     // null
      {'c', 1, 5, "rwm"},     // zero
      {'c', 1, 7, "rwm"},     // full
      {'c', 1, 8, "rwm"},     // random
      {'c', 1, 9, "rwm"},     // urandom
      {'c', 5, 0, "rwm"},     // tty
      {'c', 5, 2, "rwm"},     // ptmx
      {'c', 136, -1, "rwm"},  // the ptys of /dev/pts
  };
  return r;
}

std::string describe_device_rules(const std::vector<DeviceRule>& rules) {
  std::string out;
  for (auto& r : rules) out += (out.empty() ? "" : ", ") + rule_text(r);
  return out;
}

Result<void> CgroupDir::set_devices(const std::vector<DeviceRule>& allow) {
  if (dirs_.empty()) return sys_error(ENOENT);
  if (v2_) return set_devices_v2(dirs_.front(), allow);
  if (!has("devices")) return sys_error(ENOTSUP);
  return set_devices_v1(dir_of("devices"), allow);
}

}  // namespace sbx::os
