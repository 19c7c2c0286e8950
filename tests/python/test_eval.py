"""Evaluation sets on the default model, end to end: a learning adapter's judge item (a rubric
answered by the base model) and a contains item are scored on each version; the scores equal what
a client computes itself over HTTP from the same greedy requests (the version's answer, then the
base model's verdict on the filled rubric: its first number over judge_max)."""

import json
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import KEY, http, running  # noqa: E402

QUESTION = "What color is the sky on a clear day?"
RUBRIC = ("Rate the answer from 0 to 9 (9: correct and short).\nQuestion: {prompt}\n"
          "Answer: {answer}\nRating (one digit):")
EVAL_TOKENS = 24


def chat(base, model, content, max_tokens):
    st, _, body = http("POST", base + "/v1/chat/completions", {
        "model": model, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}]})
    assert st == 200, body
    r = json.loads(body)
    return r["choices"][0]["message"]["content"], r


def one_step(base, reward):
    """Four samples of "Describe the sea." rewarded by `reward(choice)`; the status once the
    first step is taken."""
    st, _, body = http("POST", base + "/v1/chat/completions", {
        "model": "brief", "n": 4, "max_tokens": 12, "temperature": 1.0,
        "messages": [{"role": "user", "content": "Describe the sea."}]})
    assert st == 200, body
    r = json.loads(body)
    items = [{"id": r["id"], "choice": c["index"], "reward": reward(c)} for c in r["choices"]]
    assert http("POST", base + "/v1/feedback", items)[0] == 202
    deadline = time.time() + 120
    while True:
        s = json.loads(http("GET", base + "/v1/train/status")[2])["adapters"]["brief"]
        if s["steps"] >= 1:
            return s
        assert time.time() < deadline, s
        time.sleep(0.2)


def mark(verdict, top):
    m = re.search(r"\d+(\.\d+)?", verdict)
    return min(1.0, float(m.group(0)) / top) if m else 0.0


def test_judge_and_contains_scores_are_what_a_client_computes(tmp_path):
    with running(["--api-key", KEY, "--learn", "brief", "--data-dir", str(tmp_path)]) as base:
        st, _, body = http("POST", base + "/v1/adapters/brief/train", {
            "eval": [
                {"messages": [{"role": "user", "content": QUESTION}], "scorer": "judge",
                 "rubric": RUBRIC, "judge_max": 9},
                {"messages": [{"role": "user", "content": QUESTION}], "scorer": "contains",
                 "reference": "blue", "ignore_case": True},
            ],
            "eval_max_tokens": EVAL_TOKENS})
        assert st == 200, body
        # What version 1 (the identity) answers, and the base's verdict on it.
        answer, r = chat(base, "brief", QUESTION, EVAL_TOKENS)
        assert r["adapter_version"] == 1
        model = json.loads(http("GET", base + "/v1/models")[2])["data"][0]["id"]
        verdict, _ = chat(base, model, RUBRIC.replace("{prompt}", QUESTION)
                          .replace("{answer}", answer), 16)
        expected = [mark(verdict, 9), 1.0 if "blue" in answer.lower() else 0.0]
        print("answer:", repr(answer), "verdict:", repr(verdict), "expected:", expected)
        # One step: the incumbent (version 1) and the candidate are evaluated.
        s = one_step(base, lambda c: 1.0 / (1 + len(c["message"]["content"])))
        assert s["eval_scores"]["1"] == sum(expected) / 2, (s["eval_scores"], expected)
        # The candidate's items, reproduced the same way on the version now serving.
        v = s["version"]
        answer, r = chat(base, "brief", QUESTION, EVAL_TOKENS)
        assert r["adapter_version"] == v
        verdict, _ = chat(base, model, RUBRIC.replace("{prompt}", QUESTION)
                          .replace("{answer}", answer), 16)
        assert s["last"]["eval"]["items"] == [mark(verdict, 9),
                                              1.0 if "blue" in answer.lower() else 0.0], s["last"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}


def test_a_tool_call_item_scores_what_the_openai_sdk_gets(tmp_path):
    """A tool_call item with the tool schema people write (and tool_choice "required"): its score
    on a version is 1 exactly when the official openai SDK, asking the same thing greedily of that
    version, gets a call of get_weather with city Paris; the call is there (a score of 0 from no
    call at all would test nothing)."""
    import openai
    question = "What is the weather in Paris right now? Use the tool."
    with running(["--api-key", KEY, "--learn", "brief", "--data-dir", str(tmp_path)]) as base:
        st, _, body = http("POST", base + "/v1/adapters/brief/train", {
            "eval": [{"messages": [{"role": "user", "content": question}], "tools": [WEATHER],
                      "tool_choice": "required", "scorer": "tool_call", "name": "get_weather",
                      "arguments": {"city": "Paris"}}],
            "eval_max_tokens": 64})
        assert st == 200, body
        c = openai.OpenAI(base_url=base + "/v1", api_key=KEY)
        r = c.chat.completions.create(
            model="brief", temperature=0, max_tokens=64, tools=[WEATHER],
            tool_choice="required", messages=[{"role": "user", "content": question}])
        calls = r.choices[0].message.tool_calls or []
        assert calls, r
        want = 1.0 if any(t.function.name == "get_weather"
                          and json.loads(t.function.arguments).get("city") == "Paris"
                          for t in calls) else 0.0
        print("calls:", [(t.function.name, t.function.arguments) for t in calls], "want:", want)
        s = one_step(base, lambda c: float(c["index"] % 2))
        # Version 1 (the identity) was scored as the incumbent of the first step.
        assert s["eval_scores"]["1"] == want, (s["eval_scores"], want)
