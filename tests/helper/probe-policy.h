/* Subcommands of sbx-testprobe for resource ceilings and the agent's policy (test_limits.py,
 * test_policy.py). Each misbehaves in one way and prints what happened, one fact per line. */
#pragma once
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_quotactl_fd
#define SYS_quotactl_fd 443
#endif
#ifndef AF_ALG
#define AF_ALG 38
#endif
#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif

static double probe_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void probe_status_line(const char* key) {
  char buf[8192];
  int fd = open("/proc/self/status", O_RDONLY);
  ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
  if (fd >= 0) close(fd);
  if (n <= 0) return;
  buf[n] = 0;
  for (char* line = strtok(buf, "\n"); line; line = strtok(NULL, "\n"))
    if (!strncmp(line, key, strlen(key)) && line[strlen(key)] == ':') printf("%s\n", line);
}

/* Calls each syscall the default seccomp policy refuses, with arguments that fail harmlessly
 * without the filter (EFAULT, EBADF, EINVAL, ...), and prints "name errno" for each. */
static int probe_syscalls(void) {
  struct {
    const char* name;
    long nr;
    long a[6];
  } calls[] = {
      {"kexec_load", SYS_kexec_load, {0, 0, 0, 0xdead0000L}},
      {"kexec_file_load", SYS_kexec_file_load, {-1, -1, 0, 0, 0xdead0000L}},
      {"init_module", SYS_init_module, {0, 0, 0}},
      {"finit_module", SYS_finit_module, {-1, 0, 0}},
      {"delete_module", SYS_delete_module, {0, 0}},
      {"bpf", SYS_bpf, {5, 0, 0}},
      {"perf_event_open", SYS_perf_event_open, {0, 0, -1, -1, 0}},
      {"userfaultfd", SYS_userfaultfd, {~0L}},
      {"add_key", SYS_add_key, {1, 1, 0, 0, 0}},
      {"request_key", SYS_request_key, {1, 1, 0, 0}},
      {"keyctl", SYS_keyctl, {-1, 0, 0, 0, 0}},
      {"ptrace", SYS_ptrace, {PTRACE_PEEKUSER, 0x7ffffff0L, 0, 0}},
      {"process_vm_readv", SYS_process_vm_readv, {0x7ffffff0L, 0, 0, 0, 0, 0}},
      {"process_vm_writev", SYS_process_vm_writev, {0x7ffffff0L, 0, 0, 0, 0, 0}},
      {"mount", SYS_mount, {0, 0, 0, 0, 0}},
      {"umount2", SYS_umount2, {0, 0}},
      {"pivot_root", SYS_pivot_root, {0, 0}},
      {"fsopen", SYS_fsopen, {0, 0}},
      {"fsconfig", SYS_fsconfig, {-1, 0, 0, 0, 0}},
      {"fsmount", SYS_fsmount, {-1, 0, 0}},
      {"fspick", SYS_fspick, {-1, 0, 0}},
      {"move_mount", SYS_move_mount, {-1, 0, -1, 0, 0}},
      {"open_tree", SYS_open_tree, {-1, 0, 0}},
      {"mount_setattr", SYS_mount_setattr, {-1, 0, 0, 0, 0}},
      {"unshare", SYS_unshare, {CLONE_NEWUTS}},
      {"setns", SYS_setns, {-1, 0}},
      /* CLONE_THREAD without CLONE_SIGHAND: EINVAL without the filter, nothing is created. */
      {"clone_newns", SYS_clone, {CLONE_NEWNS | CLONE_THREAD, 0, 0, 0, 0}},
      {"clone_newuser", SYS_clone, {CLONE_NEWUSER | CLONE_THREAD, 0, 0, 0, 0}},
      {"clone_newpid", SYS_clone, {CLONE_NEWPID | CLONE_THREAD, 0, 0, 0, 0}},
      {"clone_newnet", SYS_clone, {CLONE_NEWNET | CLONE_THREAD, 0, 0, 0, 0}},
      {"clone_newuts", SYS_clone, {CLONE_NEWUTS | CLONE_THREAD, 0, 0, 0, 0}},
      {"clone_newipc", SYS_clone, {CLONE_NEWIPC | CLONE_THREAD, 0, 0, 0, 0}},
      {"clone_newcgroup", SYS_clone, {CLONE_NEWCGROUP | CLONE_THREAD, 0, 0, 0, 0}},
      {"io_uring_setup", SYS_io_uring_setup, {0, 0}},
      {"io_uring_enter", SYS_io_uring_enter, {-1, 0, 0, 0, 0, 0}},
      {"io_uring_register", SYS_io_uring_register, {-1, 0, 0, 0}},
      {"swapon", SYS_swapon, {0, 0}},
      {"swapoff", SYS_swapoff, {0}},
      {"reboot", SYS_reboot, {0, 0, 0, 0}},
      {"acct", SYS_acct, {1}},
      {"quotactl", SYS_quotactl, {0, 0, 0, 0}},
      {"quotactl_fd", SYS_quotactl_fd, {-1, 0, 0, 0}},
      {"open_by_handle_at", SYS_open_by_handle_at, {-1, 0, 0}},
      {"clone3", SYS_clone3, {0, 0}},
  };
  for (unsigned i = 0; i < sizeof calls / sizeof calls[0]; i++) {
    errno = 0;
    long rc =
        syscall(calls[i].nr, calls[i].a[0], calls[i].a[1], calls[i].a[2], calls[i].a[3], calls[i].a[4], calls[i].a[5]);
    if (rc == 0 && calls[i].nr == SYS_clone) _exit(0); /* cannot happen: CLONE_THREAD without SIGHAND */
    printf("%s %d\n", calls[i].name, rc < 0 ? errno : 0);
    if (rc > 2) close((int)rc);
  }
  int fams[] = {AF_PACKET, AF_ALG, AF_VSOCK};
  const char* names[] = {"socket_af_packet", "socket_af_alg", "socket_af_vsock"};
  for (int i = 0; i < 3; i++) {
    errno = 0;
    int types[] = {SOCK_RAW, SOCK_SEQPACKET, SOCK_STREAM};
    int fd = socket(fams[i], types[i], 0);
    printf("%s %d\n", names[i], fd < 0 ? errno : 0);
    if (fd >= 0) close(fd);
  }
  /* An allowed control inside the filter: a plain fork still works. */
  pid_t c = fork();
  if (c == 0) _exit(0);
  if (c > 0) waitpid(c, NULL, 0);
  printf("fork %d\n", c < 0 ? errno : 0);
  probe_status_line("Seccomp");
  probe_status_line("NoNewPrivs");
  return 0;
}

static int probe_main_memhog(long limit_mb, long hold) {
  /* Touches 1 MiB at a time; limit 0: until the kernel stops it. */
  long mb = 0;
  for (;;) {
    if (limit_mb && mb >= limit_mb) break;
    char* p = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      printf("mmap failed after %ld MiB: %d\n", mb, errno);
      fflush(stdout);
      break;
    }
    memset(p, 0x5a, 1 << 20);
    mb++;
    if (mb % 16 == 0) {
      printf("allocated %ld MiB\n", mb);
      fflush(stdout);
    }
  }
  printf("held %ld MiB\n", mb);
  fflush(stdout);
  if (hold)
    for (;;) pause();
  return 0;
}

int policy_probe(int argc, char** argv) {
  const char* cmd = argv[1];
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!strcmp(cmd, "syscalls")) return probe_syscalls();
  if (!strcmp(cmd, "memhog"))
    return probe_main_memhog(argc > 2 ? atol(argv[2]) : 0, argc > 3 && !strcmp(argv[3], "hold"));
  if (!strcmp(cmd, "forkbomb")) {
    /* Forks up to MAX sleeping children, retrying while fork fails (EAGAIN at a pids ceiling):
     * a storm that never stops on its own. Without a ceiling it reaches MAX and cleans up. */
    long max = argc > 2 ? atol(argv[2]) : 1000000;
    long made = 0, failed = 0;
    pid_t first = 0;
    while (made < max) {
      pid_t c = fork();
      if (c == 0) {
        for (;;) pause();
      }
      if (c < 0) {
        if (failed++ == 0) printf("fork failed after %ld: %s\n", made, strerror(errno));
        usleep(2000);
        continue;
      }
      if (!first) first = c;
      made++;
    }
    printf("forked %ld\n", made);
    /* The children share our process group and die of TERM; we ignore it. */
    signal(SIGTERM, SIG_IGN);
    killpg(0, SIGTERM);
    while (wait(NULL) > 0) {
    }
    (void)first;
    return 0;
  }
  if (!strcmp(cmd, "cpuhog")) {
    /* N spinning children for S seconds; prints the CPU time they used over the wall time. */
    double secs = argc > 2 ? atof(argv[2]) : 5;
    int n = argc > 3 ? atoi(argv[3]) : 2;
    double t0 = probe_now();
    for (int i = 0; i < n; i++)
      if (fork() == 0) {
        volatile unsigned long x = 0;
        while (probe_now() - t0 < secs) x++;
        _exit(0);
      }
    while (wait(NULL) > 0) {
    }
    double wall = probe_now() - t0;
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    double cpu =
        (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    printf("cpu=%.3f wall=%.3f cores=%.3f\n", cpu, wall, cpu / wall);
    return 0;
  }
  if (!strcmp(cmd, "fill-disk")) {
    /* Writes PATH in 1 MiB chunks until an error or MAX bytes. */
    const char* path = argv[2];
    long long max = argc > 3 ? atoll(argv[3]) : (1LL << 40);
    static char buf[1 << 20];
    memset(buf, 'x', sizeof buf);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
      printf("open errno=%d\n", errno);
      return 1;
    }
    long long total = 0;
    int err = 0;
    while (total < max) {
      ssize_t w = write(fd, buf, sizeof buf);
      if (w < 0) {
        err = errno;
        break;
      }
      total += w;
    }
    printf("wrote=%lld errno=%d\n", total, err);
    close(fd);
    return 0;
  }
  if (!strcmp(cmd, "read-secrets")) {
    /* read-secrets PID PATH...: the supervisor's environ, then each path; then ptrace and kill. */
    pid_t pid = (pid_t)atoi(argv[2]);
    char envp[64];
    snprintf(envp, sizeof envp, "/proc/%d/environ", pid);
    for (int i = 2; i < argc; i++) {
      const char* path = i == 2 ? envp : argv[i];
      char buf[256];
      int fd = open(path, O_RDONLY);
      ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf) : -1;
      int e = errno;
      if (fd >= 0) close(fd);
      printf("read %s %s\n", path, n > 0 ? "ok" : n == 0 ? "empty" : strerror(e));
    }
    errno = 0;
    long r = ptrace(PTRACE_SEIZE, pid, 0, 0);
    printf("ptrace %s\n", r == 0 ? "ok" : strerror(errno));
    errno = 0;
    r = kill(pid, 0);
    printf("kill %s\n", r == 0 ? "ok" : strerror(errno));
    return 0;
  }
  if (!strcmp(cmd, "setuid-check")) {
    uid_t r, e, s;
    getresuid(&r, &e, &s);
    printf("ruid=%d euid=%d\n", (int)r, (int)e);
    return 0;
  }
  if (!strcmp(cmd, "write")) {
    /* write PATH: creates PATH; prints ok or the error. */
    int fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC, 0644);
    printf("write %s %s\n", argv[2], fd >= 0 ? "ok" : strerror(errno));
    if (fd >= 0) close(fd);
    return 0;
  }
  return -1;
}
