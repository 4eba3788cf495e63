#!/bin/bash
# Runs inside a container of the runtime image (tests/e2e/image-criu starts it with the caps of
# docs/architecture.md, "Hosts"). The agent (agent.py) runs as PID 1 of its own pid, mount and network
# namespaces, on a root set up with pivot_root, its own /tmp tmpfs, setsid, stdio from inside the
# new root. It is dumped, then restored twice, each copy on a root of its own, and both copies
# must be running afterwards.
#
# The agent's root is a bind mount of the container's root. An overlay whose lower layer is the
# container's root (itself an overlay) does not work: criu 4.2.1 fails the dump with
# "Can't lookup mount=N for fd=-3 path=/usr/bin/python3.13", because on Linux 6.18 the mapping's
# mnt_id is the hidden mount the outer overlay keeps for its lower layer.
set -u
fail=0
check() { if "$@"; then :; else echo "FAIL: $*"; fail=1; fi; }
ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

echo "criu --version: $(criu --version | head -n1)"
criu --version | grep -q 'Version: 4\.[2-9]' || { echo 'FAIL: criu < 4.2'; fail=1; }
echo "criu check: $(criu check 2>&1 | tr '\n' ' ')"

cp /e2e/agent.py /opt/agent.py
new_root() { mkdir -p "/run/$1/root" && mount --bind / "/run/$1/root"; }
new_root b0
unshare --pid --mount --net --fork --propagation private /bin/bash -c '
  cd /run/b0/root && mkdir -p oldroot && pivot_root . oldroot && cd / &&
  ip link set lo up && mount -t proc proc /proc && mount -t tmpfs tmpfs /tmp && umount -l /oldroot &&
  exec setsid python3 /opt/agent.py </dev/null >/dev/null 2>&1' &
disown # criu kills the dumped tree; bash need not report it.
for _ in $(seq 50); do pid=$(pgrep -f '^python3 /opt/agent.py') && break; sleep 0.1; done
sleep 0.5
echo "agent: $(grep NSpid "/proc/$pid/status" | tr '\t' ' ')"

mkdir -p /run/img
t=$(date +%s%N)
criu dump -t "$pid" -D /run/img -o dump.log --external 'mnt[]' --manage-cgroups=ignore
rc=$?
echo "dump: rc=$rc in $(ms_since "$t") ms, $(du -sh /run/img | cut -f1) of images"
if [ "$rc" != 0 ]; then grep Error /run/img/dump.log; kill -9 "$pid"; echo "0 passed, 1 failed"; exit 1; fi

for b in b1 b2; do
  new_root "$b"
  mkdir -p "/run/w$b"
  t=$(date +%s%N)
  criu restore -D /run/img -W "/run/w$b" -o "/run/w$b/restore.log" --root "/run/$b/root" \
    --restore-detached --external 'mnt[]' --manage-cgroups=ignore 2>/dev/null
  rc=$?
  echo "restore $b: rc=$rc in $(ms_since "$t") ms"
  [ "$rc" = 0 ] || { grep Error "/run/w$b/restore.log"; fail=1; }
done
sleep 0.5
pids=$(pgrep -f '^python3 /opt/agent.py' | tr '\n' ' ')
echo "running copies: $pids"
check [ "$(echo $pids | wc -w)" = 2 ]
for p in $pids; do
  c1=$(cat "/proc/$p/root/tmp/agent.count"); sleep 0.5; c2=$(cat "/proc/$p/root/tmp/agent.count")
  echo "copy $p: count $c1 -> $c2, sockets: $(nsenter -t "$p" -n ss -Htlun | awk '{ print $1, $5 }' | tr '\n' ' ')"
  check [ "$c2" -gt "$c1" ]
done
[ "$fail" = 0 ] && echo "1 passed, 0 failed" || echo "0 passed, 1 failed"
exit "$fail"
