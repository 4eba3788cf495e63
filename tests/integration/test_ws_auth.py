"""The token: always required, checked before anything is served."""
import json
import os
import subprocess

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.asyncio.client import connect

from sbxtest import INIT, SUBPROTOCOL, Session, WsBox, make_tls, run, ws_connect


@pytest.fixture
def box(tmp_path):
    with WsBox(tmp_path, ["sleep", "120"]) as b:
        yield b


def test_right_token_in_the_header_is_served(box):
    async def go():
        async with ws_connect(box) as ws:
            s = Session(ws)
            r = await s.request("subscribe", since=0)
            assert r["ok"] is True
            ev = await s.wait_event(lambda e: e["type"] == "box.started")
            assert ev["seq"] == 1
    run(go(), 30)


def test_right_token_in_an_auth_frame_is_served(box):
    async def go():
        async with ws_connect(box, header=False) as ws:
            await ws.send(json.dumps({"id": 1, "op": "auth", "token": box.token}))
            assert json.loads(await ws.recv()) == {"id": 1, "ok": True}
            s = Session(ws)
            assert (await s.request("ping"))["pong"] is True
    run(go(), 30)


def test_wrong_token_in_the_header_gets_401(box):
    async def go():
        with pytest.raises(InvalidStatus) as e:
            async with ws_connect(box, token="not-the-token"):
                pass
        assert e.value.response.status_code == 401
    run(go(), 30)


def test_no_token_then_a_request_is_closed_with_4401_and_nothing_served(box):
    async def go():
        async with ws_connect(box, header=False) as ws:
            await ws.send(json.dumps({"id": 1, "op": "subscribe", "since": 0}))
            got = []
            with pytest.raises(ConnectionClosed) as e:
                while True:
                    got.append(await ws.recv())
            assert got == []
            assert e.value.rcvd.code == 4401
    run(go(), 30)


def test_wrong_token_in_an_auth_frame_is_closed_with_4401(box):
    async def go():
        async with ws_connect(box, header=False) as ws:
            await ws.send(json.dumps({"op": "auth", "token": box.token[:-1] + "x"}))
            with pytest.raises(ConnectionClosed) as e:
                await ws.recv()
            assert e.value.rcvd.code == 4401
            assert "wrong token" in e.value.rcvd.reason
    run(go(), 30)


def test_the_subprotocol_is_required(box):
    async def go():
        with pytest.raises(InvalidStatus) as e:
            async with connect(box.url, additional_headers={"Authorization": f"Bearer {box.token}"}):
                pass
        assert e.value.response.status_code == 400
    run(go(), 30)


def test_listen_without_a_token_refuses_to_start(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--", "true"],
                       capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 125
    assert "token" in r.stderr


def test_a_port_another_process_holds_ends_the_box_saying_so(tmp_path):
    # libwebsockets made its context without the listening socket when the port was taken: the
    # box ran its agent, said `server.listening` on that port, and its clients gave their token to
    # whoever held it. Now the start fails, naming the port and why, and the journal ends so.
    import socket
    from sbxtest import mounts_below, read_journal, unmount_below
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    state = tmp_path / "s"
    try:
        r = subprocess.run([str(INIT), "--state-dir", str(state), "--listen", f"127.0.0.1:{port}",
                            "--set", "resources.disk=16M", "--", "sleep", "60"],
                           capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, SANDBOXER_TOKEN="t" * 24))
        assert r.returncode == 125, r.stderr[-2000:]
        assert f"listen on 127.0.0.1:{port}: Address already in use" in r.stderr, r.stderr[-2000:]
        ev = read_journal(state)
        assert not [e for e in ev if e["type"] == "server.listening"], ev
        assert ev[-1]["type"] == "box.exited" and ev[-1]["reason"] == "failed", ev[-1]
        assert ev[-1]["error"] == f"listen on 127.0.0.1:{port}: Address already in use"
        assert mounts_below(state) == []  # the agent's workspace is not left mounted either
    finally:
        holder.close()
        unmount_below(state)


def test_an_address_this_host_does_not_have_is_named(tmp_path):
    # 192.0.2.1 (TEST-NET-1) is no address of this host: the bind says so (no packet is sent).
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--listen", "192.0.2.1:0", "--", "true"],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, SANDBOXER_TOKEN="t" * 24))
    assert r.returncode == 125, r.stderr[-2000:]
    assert "listen on 192.0.2.1:0: Cannot assign requested address" in r.stderr, r.stderr[-2000:]


def test_a_tls_file_libwebsockets_cannot_read_ends_the_box_saying_so(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0",
                        "--tls-cert", str(bad), "--tls-key", str(bad), "--", "true"],
                       capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, SANDBOXER_TOKEN="t" * 24))
    assert r.returncode == 125, r.stderr[-2000:]
    assert "libwebsockets could not make its server" in r.stderr and "bad.pem" in r.stderr, r.stderr[-2000:]


def test_the_agent_sees_neither_the_token_nor_its_file(tmp_path):
    tf = tmp_path / "tok"
    tf.write_text("sekrit-token-value\n")
    cmd = [str(INIT), "--state-dir", str(tmp_path / "s"), "--events", "-", "--listen", "127.0.0.1:0",
           "--token-file", str(tf), "--", "sh", "-c", f"env; cat {tf}; echo end"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "SANDBOXER_TOKEN": "env-token-value"})
    out = "".join(json.loads(l).get("data", "") for l in r.stdout.splitlines() if '"proc.output"' in l)
    assert "end" in out
    assert "sekrit-token-value" not in out
    assert "env-token-value" not in out and "SANDBOXER_TOKEN" not in out


def test_tls_listener_serves_wss(tmp_path):
    import ssl

    tls = make_tls(tmp_path, ["127.0.0.1"])
    with WsBox(tmp_path, ["sleep", "60"], extra=["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]) as box:
        ctx = ssl.create_default_context(cafile=str(tls.ca))

        async def go():
            async with connect(box.url.replace("ws://", "wss://"), ssl=ctx, subprotocols=[SUBPROTOCOL],
                               additional_headers={"Authorization": f"Bearer {box.token}"}) as ws:
                s = Session(ws)
                assert (await s.request("ping"))["ok"]
        run(go(), 30)
        assert any(e["type"] == "server.listening" and e["tls"] is True for e in box.read_events())


def test_a_token_from_the_environment_is_scrubbed_from_proc_environ(tmp_path):
    # unsetenv alone leaves the bytes in the initial environment block /proc/PID/environ shows;
    # an agent that shares the supervisor's pid namespace (a flat box) could read them there.
    import os
    import time
    env = dict(os.environ, SANDBOXER_TOKEN="tok-scrub-" + "7" * 20)
    p = subprocess.Popen([str(INIT), "--state-dir", str(tmp_path / "s"), "--listen", "127.0.0.1:0",
                          "--set", "isolation.namespaces=false", "--", "sleep", "3"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 10
        environ = b""
        while time.time() < deadline:
            environ = open(f"/proc/{p.pid}/environ", "rb").read()
            if b"SANDBOXER_TOKEN=" in environ and b"tok-scrub" not in environ:
                break
            time.sleep(0.05)
        assert b"SANDBOXER_TOKEN=" in environ  # the search looks in the right place
        assert b"tok-scrub" not in environ
    finally:
        p.wait(timeout=30)
