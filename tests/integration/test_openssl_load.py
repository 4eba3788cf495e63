"""OpenSSL (libssl, libcrypto) is loaded when a box first needs it: the broker's TLS to a
credential's upstream, an archive's hash or signature. Not at every start (issue 18: linked, the
two were ~0.7 ms of every exec of the supervisor and ~1.6 MiB of its memory). A host where it
cannot be loaded still runs boxes that need none; a box whose broker needs TLS there ends at once,
naming the library and the loader's reason."""
import json
import os

from sbxtest import maps_while_sleeping, refused_without_library

SSL = "libssl.so.3"


def proxy_profile(path):
    """network "proxy" with one credential: the broker makes its TLS context at start."""
    path.write_text(json.dumps({
        "name": "tls-test",
        "network": {"mode": "proxy", "allow": ["api.example.test"]},
        "credentials": [{"name": "api", "source": {"env": "SBX_TEST_SECRET"},
                         "bind": {"scheme": "https", "host": "api.example.test", "port": 443},
                         "inject": {"header": "x-api-key", "format": "{}"}}]}))
    return path


def test_a_box_without_tls_never_maps_openssl(tmp_path):
    maps = maps_while_sleeping(tmp_path, "plain", [])
    assert "libssl" not in maps and "libcrypto" not in maps
    # Control: a box whose broker holds a credential has both mapped.
    env = dict(os.environ, SBX_TEST_SECRET="sk-test-secret")
    maps = maps_while_sleeping(tmp_path, "proxy", ["--profile", str(proxy_profile(tmp_path / "p.json"))], env)
    assert "libssl.so" in maps and "libcrypto.so" in maps


def test_a_host_where_libssl_does_not_load_refuses_the_broker_naming_why(tmp_path):
    # It ends rather than running its agent without the broker; a box that needs no TLS runs on
    # the same host.
    env = dict(os.environ, SBX_TEST_SECRET="sk-test-secret")
    refused_without_library(tmp_path, SSL, ["--profile", str(proxy_profile(tmp_path / "p.json"))],
                            [f"load OpenSSL ({SSL})", "for the credentials"], env)
