"""A bounded fuzz run: schemathesis (pinned, installed by scripts/test) generates requests from
openapi/openapi.yaml against a server on the default model and fails on any 5xx
(`not_a_server_error`) or response that breaks the contract (`response_schema_conformance`).
Hooks in fuzz_hooks.py keep generation short and streams off (stream chunks are validated by the
contract test, see fuzz_hooks.py). Admin routes are exercised without their key (the server
has one): the fuzzer must not create, export or delete adapters on this machine."""

import os
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import KEY, MODEL, ROOT, running  # noqa: E402

MAX_EXAMPLES = int(os.environ.get("FLYWHEEL_FUZZ_EXAMPLES", "25"))
MAX_SECONDS = int(os.environ.get("FLYWHEEL_FUZZ_SECONDS", "150"))


def test_fuzzing_the_contract_finds_no_server_error_and_no_nonconforming_response():
    with running(["--api-key", KEY, "--admin-key", "fuzz-admin-not-given"]) as base:
        env = dict(os.environ, SCHEMATHESIS_HOOKS="fuzz_hooks", FLYWHEEL_FUZZ_MODEL=MODEL.stem,
                   PYTHONPATH=str(pathlib.Path(__file__).parent))
        r = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", str(ROOT / "openapi" / "openapi.yaml"),
             "--url", base, "-H", f"Authorization: Bearer {KEY}",
             "--checks", "not_a_server_error,response_schema_conformance",
             "--max-examples", str(MAX_EXAMPLES), "--max-time", str(MAX_SECONDS),
             "--seed", "1", "--request-timeout", "60", "--workers", "1",
             "--suppress-health-check", "all"],
            env=env, capture_output=True, text=True, timeout=MAX_SECONDS + 120)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    m = re.search(r"(\d+) generated, (\d+) passed", r.stdout)
    assert m and int(m.group(1)) >= 200 and m.group(1) == m.group(2), tail
    print(tail[-1500:])
