"""Repeat detection on the default model, as users meet loops: greedy SmolLM2-135M asked for a
short poem about the sea falls into one ("A world where the sea is a place, a place where the sea
is a place," over and over) and runs to max_tokens; with `stop_on_repetition` it ends as
`repetition` after the same text, long before; a normal answer and a short list are untouched."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import http, running  # noqa: E402


@pytest.fixture(scope="module")
def base():
    # Exact (f32) products: the loop above is what they give. The default's BF16 products (on
    # CPUs with AVX512_BF16) answer with stanzas that vary a word each time ("endless love",
    # "endless pain", ...): not a verbatim loop, and rightly not cut.
    with running(["--precision", "exact"]) as url:
        yield url


def answer(base, question, rule):
    model = json.loads(http("GET", base + "/v1/models")[2])["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": 300, "temperature": 0}
    if rule is not None:
        body["stop_on_repetition"] = rule
    st, _, raw = http("POST", base + "/v1/chat/completions", body)
    assert st == 200, raw
    r = json.loads(raw)
    c = r["choices"][0]
    return c["finish_reason"], r["usage"]["completion_tokens"], c["message"]["content"]


def test_a_loop_in_the_wild_ends_early_and_normal_answers_do_not(base):
    reason, n, looping = answer(base, "Write a short poem about the sea.", None)
    assert (reason, n) == ("length", 300)
    assert looping.count("a place where the sea is a place") > 5, looping
    reason, n, cut = answer(base, "Write a short poem about the sea.", True)
    print("loop ended after", n, "tokens instead of 300")
    assert reason == "repetition" and n < 150, (reason, n)
    assert looping.startswith(cut), (cut, looping)
    for q in ["What is the capital of France?", "List three colors."]:
        plain = answer(base, q, None)
        assert plain[0] == "stop", plain
        assert answer(base, q, True) == plain
