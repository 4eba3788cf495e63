"""The one producer every transport carries.

  producer.py bulk BYTES LINE     BYTES of stdout in lines of LINE bytes, as fast as it can
  producer.py rate N PER_SECOND   N lines, each stamped with the wall clock in ns, at a fixed rate
Then prints END and exits."""
import os
import sys
import time

mode = sys.argv[1]
out = sys.stdout.buffer.raw if hasattr(sys.stdout.buffer, "raw") else sys.stdout.buffer
if mode == "bulk":
    total, line = int(sys.argv[2]), int(sys.argv[3])
    chunk = (b"x" * (line - 1) + b"\n") * max(1, (64 * 1024) // line)
    left = total
    while left > 0:
        part = chunk[:left]
        os.write(1, part)
        left -= len(part)
else:
    n, rate = int(sys.argv[2]), float(sys.argv[3])
    t0 = time.monotonic()
    for i in range(n):
        target = t0 + i / rate
        while time.monotonic() < target:
            pass
        os.write(1, b"T %d\n" % time.time_ns())
os.write(1, b"END\n")
time.sleep(0.5)
