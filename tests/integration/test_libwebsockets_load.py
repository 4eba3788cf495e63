"""libwebsockets is loaded when a box first listens (`--listen`), not at every start (issue 18:
the supervisor's start-up and memory). A host where it cannot be loaded still runs boxes that do
not listen; one that is asked to listen there ends at once, naming the library and the loader's
reason."""
import ctypes.util
import subprocess

from sbxtest import INIT, WsBox, refused_without_library, wait_event


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
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    # It ends rather than running its agent without the API it was asked for; a box that does not
    # listen runs on the same host.
    refused_without_library(tmp_path, soname, ["--listen", "127.0.0.1:0", "--token-file", str(token)],
                            [f"load libwebsockets ({soname})", "for --listen"])
