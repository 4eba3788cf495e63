"""`cmake --install` lays out a prefix the binaries find their shipped files in, and a binary
copied on its own still has the shipped profiles (compiled in)."""
import json
import shutil
import subprocess

import pytest

from sbxtest import BUILD, INIT, ROOT, read_journal

pytestmark = pytest.mark.timeout(120)


def started(state_dir):
    return next(e for e in read_journal(state_dir) if e["type"] == "box.started")


def test_install_puts_binaries_profiles_and_image_sources_under_the_prefix(tmp_path):
    prefix = tmp_path / "prefix"
    subprocess.run(["cmake", "--install", str(BUILD), "--prefix", str(prefix)], check=True, capture_output=True,
                   timeout=60)
    # images/ runs ../scripts/*: every script it names is there.
    for script in ["bundle", "debian-mirror"]:
        for tree in ("images/docker-image", "images/build"):
            if f"scripts/{script}" in (prefix / "share/sandboxer" / tree).read_text():
                assert (prefix / "share/sandboxer/scripts" / script).exists(), (tree, script)
    for rel in ["bin/sandboxer-init", "bin/sandboxer-ns-init", "bin/sandboxer", "share/sandboxer/profiles/default.json",
                "share/sandboxer/profiles/explorer.json", "share/sandboxer/images/docker-image",
                "share/sandboxer/scripts/bundle", "share/sandboxer/scripts/debian-mirror"]:
        assert (prefix / rel).exists(), rel
    # The installed binary reads the profiles under the prefix: one only there is found by name.
    doc = json.loads((prefix / "share/sandboxer/profiles/explorer.json").read_text())
    doc["name"] = "only-installed"
    (prefix / "share/sandboxer/profiles/only-installed.json").write_text(json.dumps(doc))
    state = tmp_path / "s"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(prefix / "bin/sandboxer-init"),
                        "--state-dir", str(state), "--profile", "only-installed", "--", "/bin/true"],
                       capture_output=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert started(state)["profile"] == "only-installed"


def test_a_binary_alone_falls_back_to_the_built_in_profiles(tmp_path):
    lone = tmp_path / "bin" / "sandboxer-init"
    lone.parent.mkdir()
    shutil.copy2(INIT, lone)
    state = tmp_path / "s"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(lone), "--state-dir", str(state),
                        "--profile", "untrusted", "--", "/bin/true"], capture_output=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert started(state)["profile"] == "untrusted"
    # A name that is neither on disk nor built in is refused, saying where it looked.
    r = subprocess.run([str(lone), "--state-dir", str(tmp_path / "s2"), "--profile", "nosuch", "--", "/bin/true"],
                       capture_output=True, timeout=60, cwd="/")
    assert r.returncode == 125
    assert b'profile "nosuch": not found' in r.stderr and b"built-in profiles" in r.stderr


def test_the_built_in_profiles_are_the_shipped_ones():
    # The compiled-in copy is generated from profiles/*.json at build time: the same text.
    gen = (BUILD / "profile" / "builtin-profiles.cpp").read_text()
    for f in sorted((ROOT / "profiles").glob("*.json")):
        if f.name == "schema.json":
            continue
        assert f'{{"{f.stem}", R"sbxprofile({f.read_text()})sbxprofile"}}' in gen, f.name
