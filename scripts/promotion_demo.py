#!/usr/bin/env python3
"""Promotion policies on the default model, measured (`flywheel serve --learn brief`, the client
rewarding brevity: 1 − words / max_tokens, with a 0.01 tie-breaker).

--policy gated: an evaluation set of 4 prompts scored by a length window (an answer of at most
`--eval-tokens` tokens scores 1), the gate's margin 0.25 (one item), the reward guard off (it
would catch the flip first: `scripts/guard_demo.py`). `--good` brevity steps, then
the reward flips to rewarding rambling (words / max_tokens): prints the versions promoted and held
before and after the flip, the steps after the flip until the first hold, the seconds from the
first flipped reward to that hold, each evaluation's seconds, and the version serving after.

--policy canary: canary_fraction 0.5, canary_window 8, groups_per_step 16. `--good` brevity
canaries (each step's version against the one serving, the client's brevity rewards judging both
arms), then a bad push (the learning rate 250 times too high for one step) while users' rewards
stay brevity: prints the canary's verdicts, and for the bad candidate the verdict, its evidence,
and the seconds from its canary's start to the verdict.

    python3 scripts/promotion_demo.py --policy gated|canary [--good 6] [--max-bad 10]
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
EVAL_PROMPTS = ["Answer in one word: what color is the sky?",
                "Answer in one word: what color is grass?",
                "Answer in one word: what is the opposite of hot?",
                "Answer in one word: what animal says moo?"]
MAX_TOKENS = 24
rng = random.Random(7)


def brevity(words):
    return max(0.0, 1.0 - words / MAX_TOKENS) + rng.uniform(0.0, 0.01)


def rambling(words):
    return min(1.0, words / MAX_TOKENS) + rng.uniform(0.0, 0.01)


def status(base):
    return json.loads(http("GET", base + "/v1/train/status")[2])["adapters"]["brief"]


def sample(base):
    st, _, body = http("POST", base + "/v1/chat/completions", {
        "model": "brief", "n": 4, "max_tokens": MAX_TOKENS, "temperature": 1.0,
        "messages": [{"role": "user", "content": PROMPT}]})
    assert st == 200, body
    return json.loads(body)


def reward(base, r, fn):
    items = [{"id": r["id"], "choice": c["index"],
              "reward": fn(len(c["message"]["content"].split()))} for c in r["choices"]]
    st, _, body = http("POST", base + "/v1/feedback", items)
    assert st == 202, body
    return time.time()


def wait(base, pred, secs=300):
    deadline = time.time() + secs
    while True:
        s = status(base)
        if pred(s):
            return s
        assert time.time() < deadline, s
        time.sleep(0.05)


def decisions(base):
    h = json.loads(http("GET", base + "/v1/train/brief/history")[2])
    return h["decisions"]


def gated(base, a):
    eval_set = [{"messages": [{"role": "user", "content": p}], "scorer": "length",
                 "max_tokens": a.eval_tokens} for p in EVAL_PROMPTS]
    st, _, body = http("POST", base + "/v1/adapters/brief/train", {
        "promotion": "gated", "promotion_margin": 0.25, "eval": eval_set,
        "eval_max_tokens": MAX_TOKENS, "guard_window": 0})
    assert st == 200, body

    def step(fn):
        before = status(base)
        t = reward(base, sample(base), fn)
        s = wait(base, lambda s: s["last_decision"] != before["last_decision"]
                 or s["steps"] != before["steps"] or s["dropped"] != before["dropped"])
        return s, t

    phases = {"brevity": [], "rambling": []}
    for _ in range(a.good):
        s, _ = step(brevity)
        phases["brevity"].append((s["last_decision"] or {}).get("decision"))
    first = None
    caught = None
    for k in range(a.max_bad):
        s, t = step(rambling)
        first = first or t
        d = s["last_decision"] or {}
        phases["rambling"].append(d.get("decision"))
        if d.get("decision") == "hold":
            caught = (k + 1, time.time() - first, json.loads(d["evidence"]))
            break
    secs = [v for v in json.loads(http("GET", base + "/v1/adapters/brief/versions")[2])["data"]]
    served = sample(base)["adapter_version"]
    print(json.dumps({
        "policy": "gated", "decisions": phases,
        "rambling_steps_until_held": caught and caught[0],
        "seconds_from_first_flipped_reward_to_hold": caught and round(caught[1], 2),
        "hold_evidence": caught and {k: caught[2][k] for k in
                                     ("candidate_score", "incumbent_score", "line")},
        "eval_scores_by_version": {v["version"]: v.get("eval_score") for v in secs},
        "serving_version_after": served, "status_version": s["version"],
    }))


def canary(base, a):
    cfg = {"promotion": "canary", "canary_fraction": 0.5, "canary_window": 8,
           "groups_per_step": 16}
    st, _, body = http("POST", base + "/v1/adapters/brief/train", cfg)
    assert st == 200, body

    def verdict(cv):
        for d in decisions(base):
            if d["from_version"] == cv and d["decision"] != "canary":
                return d
        return None

    seen = {}

    def until_verdicts(n):
        """Sample and reward brevity until `n` canaries have ended and another runs: the
        verdicts, and the candidate running."""
        deadline = time.time() + 900
        while True:
            s = status(base)
            cv = s["canary_version"]
            for v in [v for v in seen if seen[v] is None]:
                d = verdict(v)
                seen[v] = d and d["decision"]
            if cv is not None:
                seen.setdefault(cv, None)
            done = [v for v in seen if seen[v] is not None]
            if len(done) >= n and cv is not None and seen[cv] is None:
                return [seen[v] for v in sorted(done)], cv
            assert time.time() < deadline, s
            reward(base, sample(base), brevity)

    verdicts, running_cv = until_verdicts(a.good)
    # A bad push: the learning rate 250 times too high, for one step.
    st, _, body = http("POST", base + "/v1/adapters/brief/train", {**cfg, "lr": 0.05})
    assert st == 200, body
    verdicts2, bad = until_verdicts(len(verdicts) + 1)
    t_bad = time.time()
    st, _, body = http("POST", base + "/v1/adapters/brief/train", cfg)
    assert st == 200, body
    deadline = time.time() + 900
    while verdict(bad) is None:
        assert time.time() < deadline, status(base)
        reward(base, sample(base), brevity)
    d = verdict(bad)
    print(json.dumps({
        "policy": "canary", "brevity_verdicts": verdicts2,
        "bad_candidate": bad, "verdict": d["decision"], "reason": d["reason"],
        "evidence": json.loads(d["evidence"]),
        "seconds_from_the_bad_candidates_canary_to_verdict": round(d["created"] - t_bad, 2),
        "serving_version_after": status(base)["version"],
    }))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", choices=["gated", "canary"], default="gated")
    ap.add_argument("--good", type=int, default=6)
    ap.add_argument("--max-bad", type=int, default=16)
    ap.add_argument("--eval-tokens", type=int, default=6)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, \
            running(["--api-key", KEY, "--learn", "brief", "--data-dir", d]) as base:
        (gated if a.policy == "gated" else canary)(base, a)


if __name__ == "__main__":
    main()
