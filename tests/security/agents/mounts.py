"""Attacks on the agent's mounts and devices, run by the agent (tests/security/test_mounts.py).

Each subcommand prints one line per attempt, "<what> <path> <result>", the result being "ok"
(with the bytes read, for reads) or the errno's name."""
import errno
import os
import shutil
import stat
import sys


def err(e):
    return errno.errorcode.get(e.errno, str(e.errno))


def open_write(paths):
    # Opening for writing is the attack; nothing is written.
    for p in paths:
        try:
            os.close(os.open(p, os.O_WRONLY))
            print("write", p, "ok")
        except OSError as e:
            print("write", p, err(e))


def read(paths):
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                n = len(os.read(fd, 4096))
            finally:
                os.close(fd)
            print("read", p, "ok", n)
        except OSError as e:
            print("read", p, err(e))


def listdir(paths):
    for p in paths:
        try:
            print("list", p, "ok", len(os.listdir(p)))
        except OSError as e:
            print("list", p, err(e))


def mkdir(paths):
    for p in paths:
        try:
            os.mkdir(p)
            print("mkdir", p, "ok")
            os.rmdir(p)
        except OSError as e:
            print("mkdir", p, err(e))


def mknod(path, kind, major, minor):
    """Makes a device node and opens it (read-only)."""
    mode = (stat.S_IFBLK if kind == "b" else stat.S_IFCHR) | 0o600
    try:
        os.mknod(path, mode, os.makedev(int(major), int(minor)))
        print("mknod", path, "ok")
    except OSError as e:
        print("mknod", path, err(e))
        return
    read([path])


def setuid_copy(src, dst):
    shutil.copy(src, dst)
    os.chown(dst, 0, 0)
    os.chmod(dst, 0o4755)
    print("setuid-copy", dst, "ok")


def mounts():
    """The mount table as the agent sees it: '<mount point> <fstype> <options>' per line."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, post = line.split(" - ")
            pre, post = pre.split(), post.split()
            print("mount", pre[4], post[0], pre[5])


CMDS = {"write": open_write, "read": read, "list": listdir, "mkdir": mkdir}

if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd in CMDS:
        CMDS[cmd](args)
    elif cmd == "mknod":
        mknod(*args)
    elif cmd == "setuid-copy":
        setuid_copy(*args)
    elif cmd == "mounts":
        mounts()
    else:
        sys.exit("unknown command " + cmd)
    sys.stdout.flush()
