"""sdk/python over wss:// against sandboxer-init serving TLS (--tls-cert, --tls-key)."""
import ssl

import pytest

from sandboxer import Box, ConnectionLost
from sbxtest import PROBE, WsBox, make_tls, run


@pytest.fixture
def tls_server(tmp_path):
    tls = make_tls(tmp_path, ["127.0.0.1"])
    s = WsBox(tmp_path, [str(PROBE), "wait"], extra=["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)],
              as_pid1=True, metrics=None)
    s.url = f"wss://127.0.0.1:{s.port}"
    yield s, tls.ca
    s.stop()


def test_wss_with_the_servers_certificate_runs_exec_and_events(tls_server):
    srv, cert = tls_server
    ctx = ssl.create_default_context(cafile=str(cert))

    async def go():
        async with await Box.connect(srv.url, srv.token, ssl=ctx) as box:
            p = await box.exec(["echo", "over-tls"])
            await p.wait(10)
            return p.stdout
    assert run(go(), 30) == b"over-tls\n"


def test_wss_refuses_a_certificate_it_cannot_verify(tls_server):
    srv, _ = tls_server
    with pytest.raises(ConnectionLost, match="certificate"):
        run(Box.connect(srv.url, srv.token), 30)  # the system's CAs do not know this one


def test_a_url_that_is_not_websocket_is_refused_by_name():
    with pytest.raises(ValueError, match="http://127.0.0.1:1"):
        run(Box.connect("http://127.0.0.1:1", "t"), 10)
