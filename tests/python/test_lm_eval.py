"""lm-evaluation-harness as its users run it against a server, offline: `local-completions` with
`--batch_size 4` (token-id prompts in batches of 4) and `tokenizer_backend=remote` (the server's
`/tokenizer_info` and `/tokenize`, no hub download), on tasks whose data is a local JSON file.
Skipped when `lm_eval` is not installed (`pip install lm_eval`)."""

import json
import math
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import MODEL, http, running  # noqa: E402

# Offline: no hub look-up for data, tokenizer or metrics.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Two plus two equals", ["five", "four", "three", "six"], 1),
    ("The opposite of hot is", ["warm", "loud", "cold", "big"], 2),
    ("Water freezes at zero degrees", ["Fahrenheit", "Kelvin", "Rankine", "Celsius"], 3),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("A week has seven", ["months", "days", "years", "hours"], 1),
]

MC_TASK = """task: flywheel_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""

GEN_TASK = """task: flywheel_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}?\\nA:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def server():
    with running() as url:
        yield url


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    data = d / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (d / "mc.yaml").write_text(MC_TASK.format(data=data))
    (d / "gen.yaml").write_text(GEN_TASK.format(data=data))
    return TaskManager(include_path=str(d))


def evaluate(server, tasks, names):
    args = (f"model={MODEL.stem},base_url={server}/v1/completions,num_concurrent=1,"
            "max_retries=1,tokenizer_backend=remote,tokenized_requests=True")
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=names,
                                   task_manager=tasks, batch_size=4, log_samples=True)


def served_logprob(server, context, continuation):
    """The continuation's log-likelihood scored by the server alone, one request, text in."""
    ctx = http("POST", server + "/tokenize", {"model": MODEL.stem, "prompt": context})
    full = http("POST", server + "/tokenize", {"model": MODEL.stem,
                                                "prompt": context + continuation})
    assert ctx[0] == 200 and full[0] == 200
    ctx_ids, ids = json.loads(ctx[2])["tokens"], json.loads(full[2])["tokens"]
    assert ids[:len(ctx_ids)] == ctx_ids, "continuation re-tokenizes the context"
    st, _, body = http("POST", server + "/v1/completions", {
        "model": MODEL.stem, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert st == 200, body
    lps = json.loads(body)["choices"][0]["logprobs"]["token_logprobs"][len(ctx_ids):]
    return sum(lps)  # summed in order, as lm-eval sums


def test_multiple_choice_loglikelihoods_equal_the_servers_own(server, tasks):
    out = evaluate(server, tasks, ["flywheel_mc"])
    samples = out["samples"]["flywheel_mc"]
    assert len(samples) == len(QUESTIONS)
    acc = out["results"]["flywheel_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    checked = 0
    for s in samples:
        for args, resp in zip(s["arguments"], s["resps"]):
            context, continuation = args[0], args[1]
            lp = resp[0][0]
            assert math.isfinite(lp) and lp < 0
            # lm-eval sums the per-token logprobs of a batched token-id request (batch of 4, one
            # more token generated); the server's own single request gives the same sum to the
            # bit (batch invariance: the per-token values are identical).
            assert lp == served_logprob(server, context, continuation)
            checked += 1
    assert checked == sum(len(c) for _, c, _ in QUESTIONS)


def test_generate_until_runs_in_batches(server, tasks):
    out = evaluate(server, tasks, ["flywheel_gen"])
    samples = out["samples"]["flywheel_gen"]
    assert len(samples) == len(QUESTIONS)
    for s in samples:
        text = s["resps"][0][0]
        assert isinstance(text, str) and "\n" not in text
    assert 0.0 <= out["results"]["flywheel_gen"]["exact_match,none"] <= 1.0
