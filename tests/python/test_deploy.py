"""deploy/kubernetes.yaml: it parses; every `flywheel serve` command line in it uses only flags
`flywheel serve --help` lists, and only the environment variables it names (its own and the
object store's); its ConfigMap's
serve.toml passes the server's own configuration checks (the run then stops at the model file,
which only exists in the cluster)."""

import pathlib
import re
import subprocess
import sys

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import BIN, ROOT  # noqa: E402

DOCS = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes.yaml").read_text()))


def containers():
    for d in DOCS:
        if d["kind"] == "Deployment":
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]["containers"]


def test_the_manifest_has_one_trainer_and_replicas_behind_a_service():
    kinds = [d["kind"] for d in DOCS]
    assert {"ConfigMap", "Deployment", "Service"} <= set(kinds)
    roles = {}
    for name, cs in containers():
        args = cs[0]["args"]
        roles[args[args.index("--role") + 1]] = next(
            d for d in DOCS if d["metadata"]["name"] == name)["spec"]["replicas"]
        assert cs[0]["readinessProbe"]["httpGet"]["path"] == "/health"
    assert roles["train"] == 1 and roles["serve"] >= 2, roles
    svc = next(d for d in DOCS if d["kind"] == "Service")
    assert svc["spec"]["selector"]["role"] == "serve"


def test_every_command_line_is_one_flywheel_serve_accepts():
    help_text = subprocess.run([str(BIN), "serve", "--help"], capture_output=True, text=True,
                               check=True).stdout
    flags = set(re.findall(r"--[a-z][a-z-]*", help_text))
    envs = set(re.findall(r"env: (FLYWHEEL_[A-Z_]+)", help_text))
    envs |= set(re.findall(r"\b(AWS_[A-Z_]+)", help_text))
    assert "FLYWHEEL_ADAPTER_STORE" in envs and "AWS_SECRET_ACCESS_KEY" in envs, envs
    checked = 0
    for _, cs in containers():
        for c in cs:
            assert c["command"][:2] == ["flywheel", "serve"]
            for a in c["args"]:
                if a.startswith("--"):
                    assert a.split("=")[0] in flags, f"{a} is not a flag of flywheel serve"
                    checked += 1
            for e in c.get("env", []):
                assert e["name"] in envs, f"{e['name']} is not read by flywheel serve"
    assert checked >= 4


def test_the_config_map_passes_the_servers_checks(tmp_path):
    cm = next(d for d in DOCS if d["kind"] == "ConfigMap")
    cfg = tmp_path / "serve.toml"
    toml = cm["data"]["serve.toml"]
    assert 'adapter_store = "s3://' in toml
    cfg.write_text(toml.replace("/var/lib/flywheel", str(tmp_path / "data")))
    for role in ("train", "serve"):
        out = subprocess.run(
            [str(BIN), "serve", "--config", str(cfg), "--role", role, "--port", "0",
             "--rollout-store", "postgres://u@127.0.0.1:1/db"],
            capture_output=True, text=True, timeout=60)
        assert out.returncode != 0
        # Past the configuration's checks: stopped at the cluster's model path.
        assert "/models/SmolLM2-135M-Instruct.Q4_1.gguf does not exist" in out.stderr, \
            out.stderr[-2000:]
