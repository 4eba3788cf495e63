"""profiles/: the shipped profiles follow profiles/schema.json, and the schema and the
supervisor's parser agree on what they refuse."""
import json
import subprocess

import jsonschema
import pytest

from sbxtest import INIT, PROBE, ROOT

PROFILES = ROOT / "profiles"
SCHEMA = json.loads((PROFILES / "schema.json").read_text())
SHIPPED = ["default", "untrusted", "claude-agent", "explorer"]

pytestmark = pytest.mark.timeout(60)


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_follows_the_schema(name):
    doc = json.loads((PROFILES / f"{name}.json").read_text())
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert doc["name"] == name


def test_claude_agent_profile_has_4_gib():
    doc = json.loads((PROFILES / "claude-agent.json").read_text())
    assert doc["resources"]["memory"] == "4G"


BAD = [
    {"resources": {"memory": "lots"}},
    {"resources": {"mem": "1G"}},
    {"resources": {"pids": 1}},
    {"resources": {"cpus": -1}},
    {"resources": {"copies": -1}},
    {"resources": {"snapshots": "many"}},
    {"resources": {"ksm": "maybe"}},
    {"isolation": {"namespaces": "yes"}},
    {"isolation": {"level": "vm"}},
    {"isolation": {"user": "alice"}},
    {"isolation": {"landlock": {"rw": ["relative"]}}},
    {"isolation": {"seccomp": "strictest"}},
    {"isolation": {"masks": ["etc/hostname"]}},
    {"isolation": {"masks": "/etc/hostname"}},
    {"network": "wifi"},
    {"persistence": "forever"},
    {"checkpoint": {"probe_timeout": "soon"}},
    {"colour": "red"},
]


@pytest.mark.parametrize("patch", BAD, ids=[json.dumps(b) for b in BAD])
def test_schema_and_supervisor_both_refuse(tmp_path, patch):
    doc = {"name": "bad", "version": 1, **patch}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(INIT), "--state-dir", str(tmp_path / "s"),
                        "--profile", str(f), "--", str(PROBE), "exit", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 125, r.stderr
    field = next(iter(patch))
    assert field in r.stderr, r.stderr


@pytest.mark.parametrize("value", ["0s", "500ms", "11m"])
def test_a_probe_timeout_out_of_its_range_is_refused_naming_it(tmp_path, value):
    # Durations the schema's pattern takes, outside what the parser allows (1s to 10m).
    r = subprocess.run([str(INIT), "--state-dir", str(tmp_path / "s"), "--set", f"checkpoint.probe_timeout={value}",
                        "--", str(PROBE), "exit", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 125, r.stderr
    assert "checkpoint.probe_timeout: between 1s and 10m" in r.stderr, r.stderr
