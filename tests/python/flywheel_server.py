"""Start `flywheel serve` on the default model (127.0.0.1, port 0) and talk HTTP to it: shared by
the contract and fuzz tests."""

import atexit
import contextlib
import json
import pathlib
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "flywheel"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY = "test-key"


def venv_python(env, default, why):
    """The Python of a client library's own virtual environment (`$env`, else
    ~/.cache/flywheel/`default`, made by scripts/test because the library pins `why`); the
    calling test module is skipped without it."""
    import os
    import pytest

    venv = os.environ.get(env) or os.path.expanduser(f"~/.cache/flywheel/{default}")
    python = pathlib.Path(venv) / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no {python} (scripts/test makes it: {why})", allow_module_level=True)
    return python


@contextlib.contextmanager
def running(args=(), timeout=60):
    """A server for the length of a `with` block (a module fixture's body): its base URL."""
    proc, base = start_server(list(args), timeout)
    try:
        yield base
    finally:
        stop(proc)


@contextlib.contextmanager
def running_config(toml, args=(), timeout=300):
    """`running` with `toml` as its `--config` (a temporary file): the demos' servers."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = pathlib.Path(tmp) / "serve.toml"
        cfg.write_text(toml)
        with running(["--config", str(cfg), *args], timeout) as base:
            yield base


def stop(proc):
    """Stop a server: SIGTERM (a server exits 0 on it), killed if still there after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_server(args, timeout=60):
    if "--data-dir" not in args:
        # Each server its own data directory (removed at exit): what a server keeps there
        # (rollout log, Tinker sessions and runs) must not reach another test's server.
        data = tempfile.mkdtemp(prefix="flywheel-test-")
        atexit.register(shutil.rmtree, data, True)
        args = [*args, "--data-dir", data]
    proc = subprocess.Popen(
        [str(BIN), "serve", "--model", str(MODEL), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.time() + timeout
    addr = None
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("listening on "):
            addr = line.split()[-1]
            break
    if addr is None:
        proc.kill()
        raise RuntimeError("server did not start")
    base = f"http://{addr}"
    while time.time() < deadline:
        try:
            if http("GET", base + "/health")[0] == 200:
                return proc, base
        except OSError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server not healthy")



def http(method, url, body=None, key=KEY, raw=None, content_type="application/json"):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", content_type)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
