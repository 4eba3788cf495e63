"""The one producer every transport carries.

  producer.py bulk BYTES LINE     BYTES of stdout in lines of LINE bytes, as fast as it can
  producer.py rate N PER_SECOND   N lines, each stamped with the wall clock in ns, at a fixed rate
Then prints END and exits.

  producer.py --gate PATH MODE ...  first creates PATH.ready.<pid> and waits for PATH to exist
                                    (polled every 0.2 ms): a benchmark's clock then starts at a
                                    running producer, not at the interpreter's start-up."""
import os
import sys
import time

argv = sys.argv[1:]
if argv[0] == "--gate":
    gate, argv = argv[1], argv[2:]
    open(f"{gate}.ready.{os.getpid()}", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.0002)
mode = argv[0]
out = sys.stdout.buffer.raw if hasattr(sys.stdout.buffer, "raw") else sys.stdout.buffer
if mode == "bulk":
    total, line = int(argv[1]), int(argv[2])
    chunk = (b"x" * (line - 1) + b"\n") * max(1, (64 * 1024) // line)
    left = total
    while left > 0:
        part = chunk[:left]
        os.write(1, part)
        left -= len(part)
else:
    n, rate = int(argv[1]), float(argv[2])
    t0 = time.monotonic()
    for i in range(n):
        # Sleeps to each line's time rather than spinning: a spinning producer took one of the
        # machine's cores from the server and the client it measures. A line whose time has
        # passed (a sleep overshoots the 100 us between lines at 10k/s) is written at once; its
        # stamp is when it was written, so the latency measured stays true.
        wait = t0 + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        os.write(1, b"T %d\n" % time.time_ns())
os.write(1, b"END\n")
time.sleep(0.5)
