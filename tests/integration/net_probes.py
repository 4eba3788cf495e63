"""What the test agents (live_agent.py, identity_agent.py) check about their network after a fork."""
import socket

_held = []  # the listeners bindable() made stay open while the agent lives


def tcp_state(conn_c, conn_s):
    """"open" when bytes still pass over a connection made before the fork, else "closed"."""
    try:
        conn_c.settimeout(2)
        conn_c.sendall(b"live")
        conn_s.settimeout(2)
        return "open" if conn_s.recv(4) == b"live" else "closed"
    except OSError:
        return "closed"


def bindable(port):
    """True when a listener can take 127.0.0.1:port here, else the error: the same fresh port is
    free in every copy only when each has a network namespace of its own. The listener stays open,
    so copies sharing a network would find the port taken."""
    fresh = socket.socket()
    try:
        fresh.bind(("127.0.0.1", port))
        fresh.listen()
        _held.append(fresh)
        return True
    except OSError as e:
        return str(e)
