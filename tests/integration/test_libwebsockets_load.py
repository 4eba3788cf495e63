"""libwebsockets is loaded when a box first listens (`--listen`), not at every start (issue 18:
the supervisor's start-up and memory). A host where it cannot be loaded still runs boxes that do
not listen; one that is asked to listen there ends at once, naming the library and the loader's
reason."""
import ctypes.util
import os
import subprocess

from sbxtest import INIT, WsBox, wait_event


def lws_soname():
    soname = ctypes.util.find_library("websockets")
    assert soname and soname.startswith("libwebsockets.so."), soname
    return soname


def test_a_box_that_does_not_listen_never_maps_libwebsockets(tmp_path):
    events = tmp_path / "events.jsonl"
    p = subprocess.Popen([str(INIT), "--state-dir", str(tmp_path / "s"), "--events", str(events),
                          "--", "sleep", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_event(events, lambda e: e["type"] == "proc.started", timeout=20)
        maps = open(f"/proc/{p.pid}/maps").read()
        assert "libwebsockets" not in maps
        assert "sandboxer-init" in maps  # the right process's maps
    finally:
        p.kill()
        p.wait()
    # Control: a box that listens has it mapped.
    (tmp_path / "ws").mkdir()
    with WsBox(tmp_path / "ws", ["sleep", "5"]) as box:
        assert "libwebsockets" in open(f"/proc/{box.proc.pid}/maps").read()


def test_a_host_where_libwebsockets_does_not_load_refuses_to_listen_naming_why(tmp_path):
    soname = lws_soname()
    # The loader finds this one first (LD_LIBRARY_PATH): it is no library.
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / soname).write_text("not a shared object\n")
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib))
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    # It ends (the timeout is well under the agent's 120 s), rather than running its agent
    # without the API it was asked for.
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0",
                        "--token-file", str(token), "--", "sleep", "120"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0, r.stderr
    assert f"load libwebsockets ({soname})" in r.stderr and "for --listen" in r.stderr, r.stderr
    # The same host runs a box that does not listen.
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s2"), "--", "sh", "-c", "echo ran"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
