/* sbx-testprobe: one static program with a subcommand per misbehaviour the tests need.
 * Static, so it runs in any root the supervisor builds. Each subcommand is small on purpose. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "probe-policy.h"

static void say(const char* s) { (void)!write(1, s, strlen(s)); }

static void msleep(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static int record_fd = -1;
static const char* sig_name(int s) {
  switch (s) {
    case SIGHUP:
      return "HUP\n";
    case SIGINT:
      return "INT\n";
    case SIGQUIT:
      return "QUIT\n";
    case SIGUSR1:
      return "USR1\n";
    case SIGUSR2:
      return "USR2\n";
    case SIGWINCH:
      return "WINCH\n";
    case SIGTERM:
      return "TERM\n";
    default:
      return "OTHER\n";
  }
}
static volatile sig_atomic_t got_term;
static void on_sig(int s) {
  const char* n = sig_name(s);
  (void)!write(record_fd, n, strlen(n));
  if (s == SIGTERM) got_term = 1;
}

/* Counts zombies among the processes this process can see in /proc. */
static int count_zombies(void) {
  DIR* d = opendir("/proc");
  int z = 0;
  struct dirent* e;
  while (d && (e = readdir(d))) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    char p[300], buf[512];
    snprintf(p, sizeof p, "/proc/%s/stat", e->d_name);
    int fd = open(p, O_RDONLY);
    if (fd < 0) continue;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) continue;
    buf[n] = 0;
    char* rp = strrchr(buf, ')');
    if (rp && rp[1] == ' ' && rp[2] == 'Z') z++;
  }
  if (d) closedir(d);
  return z;
}

/* deny NR ERRNO PROGRAM ARGS...: runs PROGRAM with syscall NR refused with ERRNO (a seccomp
 * filter, no_new_privs), as a host whose policy refuses it would. x86_64 only. */
static int deny_and_exec(int nr, int err, char** argv) {
  struct sock_filter f[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)nr, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ((unsigned)err & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {sizeof f / sizeof f[0], f};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
    perror("sbx-testprobe deny: seccomp");
    return 2;
  }
  execv(argv[0], argv);
  perror("sbx-testprobe deny: exec");
  return 127;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr,
            "usage: sbx-testprobe exit N | catch FILE | wait | ignore-term | orphans N MS | "
            "spew BYTES | badutf8 | leave-tree N | zombies | deny NR ERRNO PROGRAM ARGS...\n");
    return 2;
  }
  const char* cmd = argv[1];
  if (!strcmp(cmd, "exit")) return atoi(argv[2]);
  if (!strcmp(cmd, "deny") && argc > 4) return deny_and_exec(atoi(argv[2]), atoi(argv[3]), argv + 4);
  if (!strcmp(cmd, "catch")) {
    /* Records every forwardable signal it receives in FILE; exits 0 after TERM. */
    record_fd = open(argv[2], O_WRONLY | O_CREAT | O_APPEND, 0644);
    struct sigaction sa = {0};
    sa.sa_handler = on_sig;
    int sigs[] = {SIGHUP, SIGINT, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH, SIGTERM};
    for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; i++) sigaction(sigs[i], &sa, NULL);
    say("ready\n");
    while (!got_term) pause();
    return 0;
  }
  if (!strcmp(cmd, "wait")) {
    say("ready\n");
    for (;;) pause();
  }
  if (!strcmp(cmd, "ignore-term")) {
    signal(SIGTERM, SIG_IGN);
    say("ready\n");
    for (;;) pause();
  }
  if (!strcmp(cmd, "orphans")) {
    /* A child leaves N grandchildren that live MS ms, and exits at once: they are orphans. Then
     * this process keeps running and reports how many zombies it can see. */
    int n = atoi(argv[2]);
    long ms = atol(argv[3]);
    pid_t c = fork();
    if (c == 0) {
      for (int i = 0; i < n; i++)
        if (fork() == 0) {
          msleep(ms);
          _exit(0);
        }
      _exit(0);
    }
    waitpid(c, NULL, 0);
    msleep(ms + 1500);
    char buf[64];
    snprintf(buf, sizeof buf, "zombies=%d\n", count_zombies());
    say(buf);
    return 0;
  }
  if (!strcmp(cmd, "zombies")) {
    char buf[64];
    snprintf(buf, sizeof buf, "zombies=%d\n", count_zombies());
    say(buf);
    return 0;
  }
  if (!strcmp(cmd, "spew")) {
    /* BYTES of lines "%010ld" + a fixed tail, 64 bytes each; the tests regenerate them. */
    long total = atol(argv[2]);
    static char buf[1 << 16];
    long line = 0, left = total;
    while (left > 0) {
      size_t len = 0;
      while (len + 64 <= sizeof buf && (long)len < left) {
        char one[96];
        snprintf(one, sizeof one, "%010ld abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n",
                 line++ % 10000000000L);
        memcpy(buf + len, one, 64);
        len += 64;
      }
      if ((long)len > left) len = (size_t)left;
      size_t off = 0;
      while (off < len) {
        ssize_t w = write(1, buf + off, len - off);
        if (w < 0) {
          if (errno == EINTR) continue;
          return 1;
        }
        off += (size_t)w;
      }
      left -= (long)len;
    }
    return 0;
  }
  if (!strcmp(cmd, "badutf8")) {
    /* Invalid bytes, then a valid 4-byte character split across two writes. The pauses let
     * the supervisor read each write apart even on a loaded machine under ASan (50 ms did not:
     * two writes read as one chunk travel as one event, base64 if any byte of it is invalid). */
    const char a[] = "ok \xff\xfe mid \xc3\x28 end\n";
    (void)!write(1, a, sizeof a - 1);
    msleep(250);
    (void)!write(1, "split \xf0\x9f", 8);
    msleep(250);
    (void)!write(1, "\x98\x80 done\n", 8);
    msleep(250);
    (void)!write(1, "\xe2\x82", 2); /* truncated at EOF */
    return 0;
  }
  if (!strcmp(cmd, "leave-tree")) {
    /* Leaves N processes behind in their own sessions (as daemons do), then exits. Each one
     * ignores TERM before it says it is ready, so that only KILL can end it. */
    int n = atoi(argv[2]);
    int ready[2];
    if (pipe(ready) != 0) return 1;
    for (int i = 0; i < n; i++)
      if (fork() == 0) {
        setsid();
        signal(SIGTERM, SIG_IGN);
        (void)!write(ready[1], "r", 1);
        for (;;) pause();
      }
    char c;
    for (int i = 0; i < n; i++) (void)!read(ready[0], &c, 1);
    say("left\n");
    return 0;
  }
  {
    int rc = policy_probe(argc, argv);
    if (rc >= 0) return rc;
  }
  fprintf(stderr, "sbx-testprobe: unknown subcommand %s\n", cmd);
  return 2;
}
