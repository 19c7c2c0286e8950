#!/usr/bin/env python3
"""The reward guard on the default model, measured: `flywheel serve --learn brief` with the
default guards (window 4), a client rewarding brevity (1 − tokens / max_tokens) for `--good`
steps (with a 0.01 tie-breaker), then a broken reward service (uniform noise in [0, 0.2], as a scale bug would send) until
the guard rolls back (bounded by `--max-bad` steps). Prints one JSON line: the steps before the
break, how many bad steps until the rollback, the seconds from the first bad reward to the
rollback (and from the step that triggered it), the version rolled back to and from, and whether
serving then names the version rolled back to.

    python3 scripts/guard_demo.py [--good 8] [--max-bad 12]
"""
import argparse
import json
import pathlib
import random
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from flywheel_server import KEY, http, running  # noqa: E402

PROMPT = "Answer in one word: what color is the sea?"
MAX_TOKENS = 24


def status(base):
    return json.loads(http("GET", base + "/v1/train/status")[2])["adapters"]["brief"]


def one_step(base, reward):
    """Sample a group of 4, reward it with `reward(tokens)`, wait for its step or a decision."""
    before = status(base)
    st, _, body = http("POST", base + "/v1/chat/completions", {
        "model": "brief", "n": 4, "max_tokens": MAX_TOKENS, "temperature": 1.0,
        "messages": [{"role": "user", "content": PROMPT}]})
    assert st == 200, body
    r = json.loads(body)
    items = [{"id": r["id"], "choice": c["index"],
              "reward": reward(len(c["message"]["content"].split()))} for c in r["choices"]]
    t0 = time.time()
    st, _, body = http("POST", base + "/v1/feedback", items)
    assert st == 202, body
    deadline = time.time() + 300
    while True:
        s = status(base)
        if s["steps"] != before["steps"] or s["last_decision"] != before["last_decision"]:
            return s, t0
        if s["dropped"] != before["dropped"]:
            return one_step(base, reward)
        assert time.time() < deadline, s
        time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--good", type=int, default=8)
    ap.add_argument("--max-bad", type=int, default=12)
    a = ap.parse_args()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as d, \
            running(["--api-key", KEY, "--learn", "brief", "--data-dir", d]) as base:
        good = []
        for _ in range(a.good):
            # Brevity, with a tie-breaker (a group of equal rewards carries no signal).
            s, _ = one_step(base, lambda words: max(0.0, 1.0 - words / MAX_TOKENS)
                            + rng.uniform(0.0, 0.01))
            good.append(s["last"]["reward_mean"])
        first_bad = None
        bad = 0
        while bad < a.max_bad:
            s, t_reward = one_step(base, lambda words: rng.uniform(0.0, 0.2))
            first_bad = first_bad or t_reward
            bad += 1
            if s["last_decision"]:
                break
        t_caught = time.time()
        d = s["last_decision"]
        served = None
        if d:
            st, _, body = http("POST", base + "/v1/chat/completions", {
                "model": "brief", "max_tokens": 2,
                "messages": [{"role": "user", "content": PROMPT}]})
            served = json.loads(body)["adapter_version"]
        print(json.dumps({
            "good_steps": a.good, "good_reward_means": [round(x, 3) for x in good],
            "bad_steps_until_rollback": bad if d else None,
            "seconds_from_first_bad_reward_to_rollback": round(t_caught - first_bad, 2),
            "seconds_from_the_last_reward_to_rollback": round(t_caught - t_reward, 2),
            "decision": d, "state": s["state"], "serving_version_after": served,
        }))


if __name__ == "__main__":
    main()
