"""The `verifiers` RL library's train client as prime-rl runs it: it renders chats itself with a
Hugging Face tokenizer (here the model's own, written by `flywheel export-tokenizer`, no hub)
and calls `POST /inference/v1/generate` with token ids. It needs openai<3, so it runs in its own
virtual environment, `$FLYWHEEL_VERIFIERS_VENV` (scripts/test makes it, by default in
`~/.cache/flywheel/verifiers-0.4.0-venv`: outside the checkout, so that a fresh checkout does not
install it again); skipped without it.

Checked: a two-turn rollout completes; the client's rendering of each chat is the server's own
(`/tokenize` of the messages); the completion log-probs it got back are the ones the server
scores for those tokens, to the bit."""

import json
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import BIN, MODEL, ROOT, http, running, venv_python  # noqa: E402

VENV_PY = venv_python("FLYWHEEL_VERIFIERS_VENV", "verifiers-0.4.0-venv",
                      "the verifiers library pins openai<3")


@pytest.fixture(scope="module")
def server():
    with running() as url:
        yield url


def test_train_client_rollout_tokens_are_the_servers(server, tmp_path):
    tok = tmp_path / "tokenizer"
    subprocess.run([str(BIN), "export-tokenizer", "--model", str(MODEL), str(tok)], check=True,
                   capture_output=True, timeout=60)
    out = subprocess.run(
        [str(VENV_PY), str(ROOT / "tests/python/clients/verifiers_rollout.py"), server, str(tok),
         MODEL.stem], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    turns = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [t["turn"] for t in turns] == [0, 1]
    for t in turns:
        ids, lps = t["completion_ids"], t["completion_logprobs"]
        assert 0 < len(ids) <= 24 and len(lps) == len(ids)
        assert t["finish_reason"] in ("stop", "length")
        # The client's own rendering is the server's.
        st, _, body = http("POST", server + "/tokenize", {
            "model": MODEL.stem, "messages": t["messages"], "add_generation_prompt": True})
        assert st == 200 and json.loads(body)["tokens"] == t["prompt_ids"]
        # The log-probs it got back are the policy's for those tokens (temperature 1).
        st, _, body = http("POST", server + "/v1/completions", {
            "model": MODEL.stem, "prompt": t["prompt_ids"] + ids, "max_tokens": 0,
            "echo": True, "logprobs": 1})
        assert st == 200, body
        scored = json.loads(body)["choices"][0]["logprobs"]["token_logprobs"]
        assert scored[len(t["prompt_ids"]):] == lps
