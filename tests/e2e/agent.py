# A small agent for checkpoint tests: holds a TCP listener and a bound UDP socket (criu < 4.2
# could not dump those on Linux 6.18) and counts in /tmp/agent.count, so a restored copy can be
# seen running.
import socket
import time

tcp = socket.socket()
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind(("127.0.0.1", 47123))
tcp.listen()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 47124))
n = 0
while True:
    n += 1
    with open("/tmp/agent.count", "w") as f:
        f.write(str(n))
    time.sleep(0.1)
