"""libidn2 is loaded when a host name that is not ASCII first needs its A-label, and libm is not
loaded at all (issue 18: each shared library is mapped and relocated at every start of the
supervisor). A host where libidn2 cannot be loaded still runs boxes whose names are ASCII; a box
whose profile names a host in another script ends at once, naming the library and the loader's
reason."""
import json

from sbxtest import maps_while_sleeping, refused_without_library

IDN2 = "libidn2.so.0"


def profile(path, host):
    """network "proxy" allowing one host: the profile's parser canonicalizes it at start."""
    path.write_text(json.dumps({"name": "idn-test", "network": {"mode": "proxy", "allow": [host]}}))
    return path


def test_a_box_with_ascii_names_maps_neither_libidn2_nor_libm(tmp_path):
    maps = maps_while_sleeping(tmp_path, "ascii", ["--profile", str(profile(tmp_path / "a.json", "api.example.test"))])
    for lib in ("libidn2", "libunistring", "libm.so"):
        assert lib not in maps, lib
    # Control: a name in another script loads libidn2 (and its libunistring) for its A-label.
    maps = maps_while_sleeping(tmp_path, "idn", ["--profile", str(profile(tmp_path / "u.json", "bücher.example"))])
    assert "libidn2.so" in maps and "libunistring.so" in maps


def test_a_host_where_libidn2_does_not_load_refuses_a_name_that_needs_it(tmp_path):
    refused_without_library(tmp_path, IDN2, ["--profile", str(profile(tmp_path / "u.json", "bücher.example"))],
                            [f"load libidn2 ({IDN2})", "no A-label for a name that is not ASCII"])
