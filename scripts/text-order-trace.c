// Runs a program under ptrace with a breakpoint (int3) at each address of ADDRS (hex, one per
// line: link-time addresses of the program's functions) and prints each address, in hex, the
// first time any of its threads or forked children reaches it; then the breakpoint is removed.
// It stops when the program ends or SECONDS pass. A child that execs is let go, for it no longer
// runs the program's code. scripts/text-order builds it and reads what it prints.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

struct bp {
  uint64_t addr;  // link-time address
  uint8_t orig;   // the byte the int3 replaced
  int hit;
};

static struct bp* bps;
static size_t nbps;
static volatile sig_atomic_t timed_out;

static void on_alarm(int sig) {
  (void)sig;
  timed_out = 1;
}

static int by_addr(const void* a, const void* b) {
  uint64_t x = ((const struct bp*)a)->addr, y = ((const struct bp*)b)->addr;
  return x < y ? -1 : x > y;
}

static struct bp* find(uint64_t addr) {
  struct bp key = {.addr = addr};
  return bsearch(&key, bps, nbps, sizeof *bps, by_addr);
}

// The address the program's file is mapped at (its mapping of offset 0).
static uint64_t load_base(pid_t pid) {
  char path[64], exe[4096], line[8192];
  snprintf(path, sizeof path, "/proc/%d/exe", pid);
  ssize_t n = readlink(path, exe, sizeof exe - 1);
  if (n <= 0) return 0;
  exe[n] = 0;
  snprintf(path, sizeof path, "/proc/%d/maps", pid);
  FILE* f = fopen(path, "r");
  uint64_t base = 0;
  while (f && fgets(line, sizeof line, f)) {
    unsigned long a, off;
    char file[4096] = "";
    if (sscanf(line, "%lx-%*x %*s %lx %*s %*s %4095s", &a, &off, file) == 3 && off == 0 && strcmp(file, exe) == 0) {
      base = a;
      break;
    }
  }
  if (f) fclose(f);
  return base;
}

static int mem_fd(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/mem", pid);
  return open(path, O_RDWR);
}

static int plant(pid_t pid, uint64_t base) {
  int fd = mem_fd(pid);
  if (fd < 0) return -1;
  size_t planted = 0;
  for (size_t i = 0; i < nbps; i++) {
    uint8_t int3 = 0xcc;
    if (pread(fd, &bps[i].orig, 1, (off_t)(base + bps[i].addr)) == 1 &&
        pwrite(fd, &int3, 1, (off_t)(base + bps[i].addr)) == 1)
      planted++;
    else
      bps[i].hit = 1;  // not in the mapped text: never reported
  }
  close(fd);
  fprintf(stderr, "trace: %zu breakpoints\n", planted);
  return 0;
}

// A SIGTRAP at one of ours: report it the first time, put the byte back in this task's memory
// (threads share it; a forked child has its own copy) and run the instruction.
static int on_trap(pid_t pid, uint64_t base) {
  struct user_regs_struct regs;
  if (ptrace(PTRACE_GETREGS, pid, 0, &regs) != 0) return 0;
  struct bp* b = find(regs.rip - 1 - base);
  if (!b) return 0;
  if (!b->hit) {
    b->hit = 1;
    printf("%lx\n", (unsigned long)b->addr);
  }
  int fd = mem_fd(pid);
  uint8_t now = 0;
  if (fd >= 0 && pread(fd, &now, 1, (off_t)(base + b->addr)) == 1 && now == 0xcc)
    (void)!pwrite(fd, &b->orig, 1, (off_t)(base + b->addr));
  if (fd >= 0) close(fd);
  regs.rip -= 1;
  ptrace(PTRACE_SETREGS, pid, 0, &regs);
  return 1;
}

static int read_addrs(const char* path) {
  FILE* f = fopen(path, "r");
  if (!f) return -1;
  size_t cap = 1024;
  bps = calloc(cap, sizeof *bps);
  unsigned long a;
  while (bps && fscanf(f, "%lx", &a) == 1) {
    if (nbps == cap) bps = realloc(bps, (cap *= 2) * sizeof *bps);
    if (bps) bps[nbps++] = (struct bp){.addr = a};
  }
  fclose(f);
  if (!bps) return -1;
  qsort(bps, nbps, sizeof *bps, by_addr);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 5 || strcmp(argv[3], "--") != 0) {
    fprintf(stderr, "usage: %s ADDRS SECONDS -- PROGRAM [ARG...]\n", argv[0]);
    return 2;
  }
  if (read_addrs(argv[1]) != 0) {
    perror(argv[1]);
    return 1;
  }
  pid_t main_pid = fork();
  if (main_pid < 0) {
    perror("trace: fork");
    return 1;
  }
  if (main_pid == 0) {
    int null = open("/dev/null", O_RDWR);  // what the program writes is not ours to print
    if (null >= 0) {
      dup2(null, 1);
      dup2(null, 2);
    }
    ptrace(PTRACE_TRACEME, 0, 0, 0);
    execvp(argv[4], argv + 4);
    _exit(127);
  }
  int st;
  if (waitpid(main_pid, &st, 0) != main_pid || !WIFSTOPPED(st)) {  // stopped at its exec
    fprintf(stderr, "trace: %s did not start\n", argv[4]);
    return 1;
  }
  ptrace(PTRACE_SETOPTIONS, main_pid, 0,
         PTRACE_O_EXITKILL | PTRACE_O_TRACECLONE | PTRACE_O_TRACEFORK | PTRACE_O_TRACEVFORK | PTRACE_O_TRACEEXEC);
  uint64_t base = load_base(main_pid);
  if (!base || plant(main_pid, base) != 0) {
    fprintf(stderr, "trace: cannot find or write the program's text\n");
    return 1;
  }
  struct sigaction sa = {.sa_handler = on_alarm};  // no SA_RESTART: waitpid returns EINTR
  sigaction(SIGALRM, &sa, NULL);
  alarm((unsigned)atoi(argv[2]));
  ptrace(PTRACE_CONT, main_pid, 0, 0);
  while (!timed_out) {
    pid_t pid = waitpid(-1, &st, __WALL);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;  // no tracee left
    }
    if (WIFEXITED(st) || WIFSIGNALED(st)) {
      if (pid == main_pid) break;
      continue;
    }
    int sig = WSTOPSIG(st), event = st >> 16;
    if (event == PTRACE_EVENT_EXEC && pid != main_pid) {
      ptrace(PTRACE_DETACH, pid, 0, 0);  // another program now
      continue;
    }
    if (event != 0 || sig == SIGSTOP) sig = 0;  // a clone, fork or exec reported; a new task's first stop
    if (sig == SIGTRAP && on_trap(pid, base)) sig = 0;
    ptrace(PTRACE_CONT, pid, 0, sig);
  }
  kill(main_pid, SIGKILL);
  fflush(stdout);
  return 0;
}
