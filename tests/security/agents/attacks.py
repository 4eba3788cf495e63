#!/usr/bin/env python3
"""The general attacks of issue #13, as a hostile agent runs them (root inside its box, or the user
its profile gives it). One JSON line per attack on stdout (a proc.message in the box's journal):

    {"attack": NAME, "area": AREA, "ok": did the attack succeed, "errno": n, "detail": "..."}

`ok` is true only when the attack did what an attacker wants (a read secret, a created namespace,
a loaded BPF map, ...). Every attack that could change something outside a throw-away box is
made harmless: a write is an open for writing only (nothing written), the hostname is set to the
name it already has, a namespace is made by a forked child that exits at once, a traced process is
let go by the tracer's exit, a mount is undone.

Targets are discovered as an attacker would: pid 1 (ns-init in a namespaced box, the supervisor in
a flat one) and every process whose comm is sandboxer-init; well-known token paths; and whatever
the caller adds (--pid; --only-pid N to attack that process alone; --state, --token,
--env-marker: what the test knows about the box).

    attacks.py [all|NAME,...] [--pid N]... [--only-pid N]... [--state DIR] [--token PATH]... [--env-marker NAME]
    attacks.py forkbomb [MAX]        # forks until the pids ceiling refuses; holds the children
    attacks.py membomb [MIB]         # allocates and touches memory until killed (or MIB reached)

Areas: "escape" is this suite's own list (tests/security/test_escape.py); the others name the
branch that closes them (mounts, env), so the tests can say who owns a hole that is still open.
"""
import ctypes
import errno as E
import json
import os
import socket
import stat
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

# x86_64 syscall numbers.
NR = dict(clone=56, ptrace=101, sethostname=170, mount=165, umount2=166, finit_module=313, keyctl=250,
          unshare=272, perf_event_open=298, setns=308, process_vm_readv=310, bpf=321, userfaultfd=323,
          io_uring_setup=425, fsopen=430)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000
WELL_KNOWN_TOKENS = ["/etc/sandboxer/secret/token", "/run/sandboxer/token", "/etc/sandboxer/tokens"]
WELL_KNOWN_STATE = ["/var/lib/sandboxer/box", "/var/lib/sandboxer"]


def arg(v):
    if isinstance(v, int):
        return ctypes.c_long(v)
    if isinstance(v, str):
        return ctypes.c_char_p(v.encode())
    return v


def sys_call(name, *args):
    """(return value, errno): errno 0 on success."""
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(NR[name]), *[arg(a) for a in args])
    return r, (ctypes.get_errno() if r < 0 else 0)


def in_child(fn):
    """Runs fn() -> (ok, errno, detail) in a forked child, so a namespace, a keyring or a tracee
    it acquires ends with the child."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        try:
            res = fn()
        except OSError as ex:
            res = (False, ex.errno or 0, f"{type(ex).__name__}: {ex}")
        except BaseException as ex:  # noqa: BLE001 (the child must always report and exit)
            res = (False, 0, f"{type(ex).__name__}: {ex}")
        os.write(wr, json.dumps(res).encode())
        os._exit(0)
    os.close(wr)
    data = b""
    while chunk := os.read(rd, 65536):
        data += chunk
    os.close(rd)
    os.waitpid(pid, 0)
    if not data:
        return False, 0, "the child died before it reported"
    return tuple(json.loads(data))


def syscall_attack(name, *args, close=True):
    r, e = sys_call(name, *args)
    if r >= 0 and close and name not in ("unshare", "setns", "sethostname", "mount", "umount2", "ptrace", "keyctl"):
        os.close(r)
    return r >= 0, e, f"{name}: " + ("ok" if r >= 0 else os.strerror(e))


# ---- the supervisor as a process -------------------------------------------------------------

def supervisor_pids(extra, only):
    if only:
        return [p for p in only if os.path.exists(f"/proc/{p}")]
    pids = []
    if os.getpid() != 1 and os.path.exists("/proc/1"):
        pids.append(1)
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) in pids or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/comm") as f:
                if f.read().strip() in ("sandboxer-init", "ns-init"):
                    pids.append(int(p))
        except OSError:
            pass
    for p in extra:
        if p not in pids and os.path.exists(f"/proc/{p}"):
            pids.append(p)
    return pids


def on_targets(pids, one):
    """one(pid) -> (ok, errno, detail); the attack succeeds if it does on any target."""
    if not pids:
        return False, E.ESRCH, "no supervisor process visible in this pid namespace"
    res = [(p, *one(p)) for p in pids]
    ok = any(r[1] for r in res)
    first = next((r for r in res if r[1]), res[0])
    return ok, first[2], "; ".join(f"pid {p}: {d}" for p, _, _, d in res)


def ptrace_one(pid):
    # PTRACE_SEIZE stops nothing; the tracee is let go when this child exits.
    return in_child(lambda: syscall_attack("ptrace", 0x4206, pid, 0, 0))


def environ_one(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError as ex:
        return False, ex.errno, f"open environ: {ex.strerror}"
    names = [v.split(b"=", 1)[0].decode(errors="replace") for v in data.split(b"\0") if v]
    return True, 0, f"read {len(data)} bytes: {','.join(names[:20])}"


def mem_one(pid):
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError as ex:
        return False, ex.errno, f"open mem: {ex.strerror}"
    detail = "opened"
    try:
        with open(f"/proc/{pid}/maps") as f:
            first = next(line for line in f if " r" in line)
        addr = int(first.split("-")[0], 16)
        detail += f", read {len(os.pread(fd, 16, addr))} bytes at {addr:#x}"
    except (OSError, StopIteration, ValueError) as ex:
        detail += f", no read: {ex}"
    finally:
        os.close(fd)
    return True, 0, detail


def vm_readv_one(pid):
    buf = ctypes.create_string_buffer(16)
    local = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 16)
    remote = (ctypes.c_void_p * 2)(0x400000, 16)
    r, e = sys_call("process_vm_readv", pid, local, 1, remote, 1, 0)
    # EFAULT: access was granted, only the address is not mapped.
    ok = r >= 0 or e == E.EFAULT
    return ok, e, "process_vm_readv: " + ("access granted" if ok else os.strerror(e))


# ---- the supervisor's files ------------------------------------------------------------------

def read_any(paths):
    """Reads every regular file under paths; (ok, errno, detail), ok if one gave a byte."""
    tried, ok, err = [], False, 0
    for path in paths:
        files = [path]
        try:
            if os.path.isdir(path):
                files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs][:20] or [path]
        except OSError:
            pass
        for f in files:
            try:
                with open(f, "rb") as fh:
                    n = len(fh.read(4096))
                tried.append(f"{f}: {n} bytes" + (" (masked)" if n == 0 else ""))
                ok |= n > 0
            except OSError as ex:
                err = err or ex.errno
                tried.append(f"{f}: {ex.strerror}")
    if not tried:
        return False, E.ENOENT, "nothing to read"
    return ok, 0 if ok else err, "; ".join(tried)


def list_state(state):
    if not state:
        return False, E.ENOENT, "no state dir known"
    try:
        names = os.listdir(state)
    except OSError as ex:
        return False, ex.errno, f"{state}: {ex.strerror}"
    return bool(names), 0, f"{state}: {sorted(names)[:10] or 'empty (masked)'}"


def journal_files(state):
    j = os.path.join(state or "", "journal")
    try:
        return [os.path.join(j, f) for f in sorted(os.listdir(j))]
    except OSError:
        return []


def read_journal(state):
    if not state:
        return False, E.ENOENT, "no state dir known"
    files = journal_files(state)
    if not files:
        try:
            os.listdir(os.path.join(state, "journal"))
        except OSError as ex:
            return False, ex.errno, f"{state}/journal: {ex.strerror}"
        return False, E.ENOENT, f"{state}/journal: empty (masked)"
    return read_any(files[:1])


def write_journal(state):
    files = journal_files(state)
    if not files:
        return False, E.ENOENT, f"{state}/journal: not visible"
    try:
        # Opened for writing only: nothing is written.
        os.close(os.open(files[0], os.O_WRONLY | os.O_APPEND))
    except OSError as ex:
        return False, ex.errno, f"open {files[0]} for writing: {ex.strerror}"
    return True, 0, f"{files[0]} is writable"


# ---- namespaces and mounts -------------------------------------------------------------------

def unshare(flag):
    return in_child(lambda: syscall_attack("unshare", flag))


def clone_newuser():
    def child():
        r, e = sys_call("clone", CLONE_NEWUSER | 17, 0, 0, 0, 0)  # 17: SIGCHLD
        if r == 0:
            os._exit(0)
        if r > 0:
            os.waitpid(r, 0)
        return r > 0, e, "clone(CLONE_NEWUSER): " + ("ok" if r > 0 else os.strerror(e))
    return in_child(child)


def setns():
    def child():
        for path in ("/proc/1/ns/mnt", "/proc/self/ns/mnt"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as ex:
                last = (False, ex.errno, f"open {path}: {ex.strerror}")
                continue
            ok, e, d = syscall_attack("setns", fd, 0)
            return ok, e, f"{path}: {d}"
        return last
    return in_child(child)


def mount_tmpfs():
    def child():
        d = f"/tmp/sbx-attack-mnt-{os.getpid()}"
        os.makedirs(d, exist_ok=True)
        try:
            ok, e, detail = syscall_attack("mount", "tmpfs", d, "tmpfs", 0, None)
            if ok:
                sys_call("umount2", d, 2)
            return ok, e, detail
        finally:
            os.rmdir(d)
    return in_child(child)


def umount_mask(state, tokens):
    # The state dir is tried even where it cannot be seen: the call is refused before the path is looked up.
    targets = [state] if state else [p for p in [*tokens, *WELL_KNOWN_TOKENS] if p and os.path.exists(p)]
    if not targets:
        return False, E.ENOENT, "no masked path visible"
    return in_child(lambda: (lambda r: (r[0], r[1], f"{targets[0]}: {r[2]}"))(syscall_attack("umount2", targets[0], 2)))


# ---- kernel interfaces -----------------------------------------------------------------------

def bpf_map():
    attr = ctypes.create_string_buffer(72)
    ctypes.memmove(attr, (ctypes.c_uint32 * 4)(2, 4, 4, 1), 16)  # ARRAY, key 4, value 4, 1 entry
    return syscall_attack("bpf", 0, attr, 72)


def perf_self():
    attr = ctypes.create_string_buffer(128)
    ctypes.memmove(attr, (ctypes.c_uint32 * 2)(1, 128), 8)         # PERF_TYPE_SOFTWARE, size
    ctypes.memmove(ctypes.byref(attr, 40), (ctypes.c_uint64 * 1)(1 | 1 << 5 | 1 << 6), 8)  # disabled, no kernel/hv
    return syscall_attack("perf_event_open", attr, 0, -1, -1, 0)


def io_uring():
    params = ctypes.create_string_buffer(120)
    return syscall_attack("io_uring_setup", 4, params)


def module_load():
    # /dev/null is no module: a kernel that lets the call through fails it with another errno.
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        r, e = sys_call("finit_module", fd, "", 0)
    finally:
        os.close(fd)
    passed = r >= 0 or e not in (E.EPERM, E.EACCES)
    return r >= 0, e, "finit_module: " + os.strerror(e) + (" (past the permission check)" if passed else "")


def sethostname():
    name = os.uname().nodename
    ok, e, d = syscall_attack("sethostname", name, len(name))
    return ok, e, f"{d} (set to its own name {name!r})"


# ---- others' areas (their branches close them) -----------------------------------------------

def open_for_write(paths):
    for p in paths:
        if not os.path.exists(p):
            continue
        try:
            os.close(os.open(p, os.O_WRONLY))  # nothing written
        except OSError as ex:
            return False, ex.errno, f"open {p} for writing: {ex.strerror}"
        return True, 0, f"{p} is open for writing"
    return False, E.ENOENT, "none of " + ", ".join(paths) + " exists"


def mknod_block():
    p = f"/workspace/sbx-attack-loop0-{os.getpid()}"
    try:
        os.mknod(p, stat.S_IFBLK | 0o600, os.makedev(7, 0))
    except OSError as ex:
        return False, ex.errno, f"mknod b 7 0: {ex.strerror}"
    try:
        try:
            os.close(os.open(p, os.O_RDONLY))
            how = "and opened"
        except OSError as ex:
            how = f"not opened: {ex.strerror}"
        return True, 0, f"mknod b 7 0 in /workspace: made, {how}"
    finally:
        os.unlink(p)


def raw_socket():
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
    except OSError as ex:
        return False, ex.errno, f"socket(AF_INET, SOCK_RAW): {ex.strerror}"
    return True, 0, "raw AF_INET socket made"


def env_marker(name):
    if not name:
        return False, 0, "no marker name given"
    return name in os.environ, 0, f"{name} {'is' if name in os.environ else 'is not'} in the environment"


# ---- the list --------------------------------------------------------------------------------

def attacks(o):
    pids = supervisor_pids(o["pids"], o["only_pids"])
    tokens = o["tokens"] + WELL_KNOWN_TOKENS + [os.environ.get("SANDBOXER_TOKEN_FILE", "")]
    state = o["state"] or next((s for s in WELL_KNOWN_STATE if os.path.exists(s)), "")
    return [
        ("ptrace_supervisor", "escape", lambda: on_targets(pids, ptrace_one)),
        ("proc_environ_supervisor", "escape", lambda: on_targets(pids, environ_one)),
        ("proc_mem_supervisor", "escape", lambda: on_targets(pids, mem_one)),
        ("process_vm_readv_supervisor", "escape", lambda: on_targets(pids, vm_readv_one)),
        ("read_token", "escape", lambda: read_any([t for t in tokens if t and os.path.exists(t)])),
        ("read_state_dir", "escape", lambda: list_state(state)),
        ("read_journal", "escape", lambda: read_journal(state)),
        ("write_journal", "escape", lambda: write_journal(state)),
        ("unshare_user", "escape", lambda: unshare(CLONE_NEWUSER)),
        ("unshare_mount", "escape", lambda: unshare(CLONE_NEWNS)),
        ("unshare_net", "escape", lambda: unshare(CLONE_NEWNET)),
        ("clone_newuser", "escape", clone_newuser),
        ("setns", "escape", setns),
        ("mount", "escape", mount_tmpfs),
        ("fsopen", "escape", lambda: syscall_attack("fsopen", "tmpfs", 1)),
        ("umount_mask", "escape", lambda: umount_mask(state, o["tokens"])),
        ("keyctl", "escape", lambda: in_child(lambda: syscall_attack("keyctl", 1, None))),
        ("userfaultfd", "escape", lambda: syscall_attack("userfaultfd", os.O_CLOEXEC | os.O_NONBLOCK)),
        ("io_uring", "escape", io_uring),
        ("bpf", "escape", bpf_map),
        ("perf_event_open", "escape", perf_self),
        ("module_load", "escape", module_load),
        ("sethostname", "escape", sethostname),
        ("core_pattern", "mounts", lambda: open_for_write(["/proc/sys/kernel/core_pattern"])),
        ("sysrq_trigger", "mounts", lambda: open_for_write(["/proc/sysrq-trigger"])),
        ("sys_write", "mounts", lambda: open_for_write(["/sys/kernel/mm/transparent_hugepage/enabled",
                                                        "/sys/kernel/profiling", "/sys/power/state"])),
        ("mknod_block", "mounts", mknod_block),
        ("raw_socket", "env", raw_socket),
        ("operator_env", "env", lambda: env_marker(o["env_marker"])),
    ]


def whoami():
    """What the agent holds: to compare a box with a plain container (a line, not an attack)."""
    st = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "Uid"):
                st[k] = v.split()[0]
    return {"whoami": st, "pid": os.getpid(), "hostname": os.uname().nodename}


def forkbomb(limit):
    # Children exec sleep (small), so the bomb costs pids, not memory; the parent keeps trying
    # at the ceiling until the supervisor ends the tree.
    made, failed_at = 0, None
    while made < limit:
        try:
            pid = os.fork()
        except OSError as ex:
            if failed_at is None:
                failed_at = made
                print(json.dumps({"forkbomb": "refused", "after": made, "errno": ex.errno}), flush=True)
            time.sleep(0.001)
            continue
        if pid == 0:
            try:
                os.execv("/bin/sleep", ["sleep", "600"])
            finally:
                os._exit(0)
        made += 1
    print(json.dumps({"forkbomb": "done", "made": made}), flush=True)
    time.sleep(600)


def membomb(limit_mib):
    held, step = [], 16
    while len(held) * step < limit_mib:
        held.append(bytearray(b"\xa5") * (step << 20))  # touched, so it is charged
        if len(held) % 16 == 0:
            print(json.dumps({"membomb": "held", "mib": len(held) * step}), flush=True)
    print(json.dumps({"membomb": "done", "mib": len(held) * step}), flush=True)


def main(argv):
    o = {"pids": [], "only_pids": [], "state": "", "tokens": [], "env_marker": ""}
    what, rest = (argv[0] if argv else "all"), argv[1:]
    if what == "forkbomb":
        return forkbomb(int(rest[0]) if rest else 1 << 30)
    if what == "membomb":
        return membomb(int(rest[0]) if rest else 1 << 30)
    it = iter(rest)
    for a in it:
        if a == "--pid":
            o["pids"].append(int(next(it)))
        elif a == "--only-pid":
            o["only_pids"].append(int(next(it)))
        elif a == "--state":
            o["state"] = next(it)
        elif a == "--token":
            o["tokens"].append(next(it))
        elif a == "--env-marker":
            o["env_marker"] = next(it)
        else:
            sys.exit(f"attacks.py: unknown argument {a!r}")
    want = None if what == "all" else set(what.split(","))
    if want is None:
        print(json.dumps(whoami()), flush=True)
    for name, area, fn in attacks(o):
        if want is not None and name not in want:
            continue
        try:
            ok, err, detail = fn()
        except OSError as ex:
            ok, err, detail = False, ex.errno or 0, f"{type(ex).__name__}: {ex}"
        print(json.dumps({"attack": name, "area": area, "ok": bool(ok), "errno": err or 0,
                          "errname": E.errorcode.get(err or 0, ""), "detail": detail[:1000]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
