"""The archive keys are read when first needed (issue 18): a box whose signing key does not parse
starts and runs its agent, and its first checkpoint is refused with an error naming the file;
the box and its agent go on. A key file that is missing still stops the box at start. Controls:
the same box with a real key checkpoints, and a real --trust-key lets an import through the step
where a broken one is refused.

The user's own key pair, which a box signs with when given none, is made at the first checkpoint
too, not when the user's first box starts (a container started without the CLI, its home empty,
made one at every start, and loaded OpenSSL for it)."""
import os
import stat
import subprocess

from sbxtest import CLI, INIT, WsBox, maps_while_sleeping


def cli(box, *args, timeout=120):
    return subprocess.run([str(CLI), *args, "--token-file", str(box.token_file)], capture_output=True, text=True,
                          timeout=timeout)


def real_key(path):
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(path)], check=True,
                   capture_output=True)
    path.chmod(0o600)
    return path


def not_a_key(path):
    path.write_text("this is not a PEM key\n")
    path.chmod(0o600)
    return path


def keyed_box(tmp_path, name, *extra):
    d = tmp_path / name
    d.mkdir()
    return WsBox(d, ["sleep", "600"], extra=[*extra, "--set", "resources.grace=1s"],
                 env=dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg")))


def test_a_key_that_does_not_parse_is_reported_at_the_first_checkpoint(tmp_path):
    bad = not_a_key(tmp_path / "bad.pem")
    with keyed_box(tmp_path, "bad", "--signing-key", str(bad)) as box:
        box.wait_event(lambda e: e["type"] == "proc.started")
        r = cli(box, "checkpoint", box.url)
        assert r.returncode != 0
        assert str(bad) in r.stderr and "not a PEM private key" in r.stderr, r.stderr
        # Nothing is lost: the box and its agent go on, and say the same again.
        assert box.alive()
        assert not [e for e in box.read_events() if e["type"] == "proc.exited"]
        again = cli(box, "checkpoint", box.url)
        assert again.returncode != 0 and str(bad) in again.stderr
    # The control: the same box with a real key checkpoints.
    good = real_key(tmp_path / "good.pem")
    with keyed_box(tmp_path, "good", "--signing-key", str(good)) as box:
        box.wait_event(lambda e: e["type"] == "proc.started")
        r = cli(box, "checkpoint", box.url)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1].startswith("s-")


def test_a_trust_key_that_does_not_parse_is_reported_at_the_first_import(tmp_path):
    archive = tmp_path / "x.tar.zst"
    archive.write_bytes(b"\x28\xb5\x2f\xfd not really an archive")
    bad = not_a_key(tmp_path / "bad.pub")
    with keyed_box(tmp_path, "bad", "--trust-key", str(bad)) as box:
        r = cli(box, "import", box.url, str(archive))
        assert r.returncode != 0
        assert "--trust-key " + str(bad) in r.stderr and "not a PEM public or private key" in r.stderr, r.stderr
        assert box.alive()
    # The control: with a real trusted key the same upload gets past the keys, to the archive.
    good = real_key(tmp_path / "good.pem")
    with keyed_box(tmp_path, "good", "--trust-key", str(good)) as box:
        r = cli(box, "import", box.url, str(archive))
        assert r.returncode != 0 and "--trust-key" not in r.stderr, r.stderr


def test_a_missing_key_file_still_stops_the_box_at_start(tmp_path):
    missing = tmp_path / "nowhere.pem"
    for opt in ("--signing-key", "--trust-key"):
        r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), opt, str(missing), "--", "true"],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg")))
        assert r.returncode == 125, r.stderr
        assert f"{opt} {missing}" in r.stderr and "No such file" in r.stderr, r.stderr


def test_the_users_key_is_made_at_the_first_checkpoint_not_at_start(tmp_path):
    keys = tmp_path / "xdg" / "sandboxer" / "keys"
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg"))
    maps = maps_while_sleeping(tmp_path, "first", [], env=env)
    assert "libcrypto" not in maps and "libssl" not in maps
    # The store is there (the agent is kept out of it from the first box on), the key is not yet.
    st = os.lstat(keys)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert not (keys / "signing.pem").exists()
    # Its first use makes it, 0600, with the public half beside it; the next checkpoint keeps it.
    with keyed_box(tmp_path, "signs") as box:
        box.wait_event(lambda e: e["type"] == "proc.started")
        r = cli(box, "checkpoint", box.url)
        assert r.returncode == 0, r.stderr
        st = os.lstat(keys / "signing.pem")
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert (keys / "signing.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
        made = (keys / "signing.pem").read_bytes()
        r = cli(box, "checkpoint", box.url)
        assert r.returncode == 0, r.stderr
        assert (keys / "signing.pem").read_bytes() == made


def test_a_users_key_that_is_not_the_users_alone_is_refused_at_start(tmp_path):
    """The file checks of the user's key stay at start, though it is parsed (or made) later: a key
    others may read is not signed with; the box says so and signs with a key of its own."""
    keys = tmp_path / "xdg" / "sandboxer" / "keys"
    keys.mkdir(parents=True, mode=0o700)
    (tmp_path / "xdg" / "sandboxer").chmod(0o700)
    key = real_key(keys / "signing.pem")
    key.chmod(0o644)
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path / "xdg"))
    refused = "signing.pem: not a regular file of this user's alone (mode 0600); this box signs with a key of its own"
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--", "true"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0 and refused in r.stderr, r.stderr
    # The control: the same key, 0600, is taken.
    key.chmod(0o600)
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "t"), "--", "true"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0 and "signing.pem" not in r.stderr, r.stderr
