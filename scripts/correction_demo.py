#!/usr/bin/env python3
"""Off-policy corrections on the default model, measured: answers sampled under a JSON schema
(structured outputs: a grammar masks the distribution, so they are not draws from the policy)
rewarded 1 when the fruit named is "apple". Two learning adapters in one server: `plain` (no
correction: every constrained sample is dropped, nothing trains) and `tis` (`correction =
"tis"`: they train, weighted by min(π_old/μ, 2) with μ the masked distribution they were drawn
from). Prints each round's mean reward and steps for both.

    python3 scripts/correction_demo.py [--rounds 12] [--lr 0.0005]
"""
import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from flywheel_server import http, running_config  # noqa: E402

QUESTION = "Name one fruit. Answer as JSON."
SCHEMA = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12}},
          "required": ["fruit"], "additionalProperties": False}
N = 8


def status(base, name):
    return json.loads(http("GET", base + "/v1/train/status")[2])["adapters"][name]


def round_of(base, name):
    st, _, body = http("POST", base + "/v1/chat/completions", {
        "model": name, "messages": [{"role": "user", "content": QUESTION}], "n": N,
        "max_tokens": 24, "temperature": 1.0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "fruit", "schema": SCHEMA}}})
    assert st == 200, body
    r = json.loads(body)
    rewards = []
    for c in r["choices"]:
        try:
            fruit = json.loads(c["message"]["content"])["fruit"]
        except (ValueError, KeyError, TypeError):
            fruit = ""
        rewards.append(1.0 if fruit.strip().lower() == "apple" else 0.0)
    items = [{"id": r["id"], "choice": i, "reward": x} for i, x in enumerate(rewards)]
    st, _, body = http("POST", base + "/v1/feedback", items)
    assert st == 202, body
    return sum(rewards) / len(rewards), len(set(rewards)) > 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--lr", type=float, default=0.0005)
    a = ap.parse_args()
    toml = (
        f"[[learn]]\nname = \"plain\"\nlr = {a.lr}\n"
        f"[[learn]]\nname = \"tis\"\nlr = {a.lr}\ncorrection = \"tis\"\n")
    with running_config(toml) as base:
        t0 = time.time()
        for rnd in range(1, a.rounds + 1):
            row = {"round": rnd}
            for name in ("plain", "tis"):
                before = status(base, name)
                mean, signal = round_of(base, name)
                deadline = time.time() + 300
                while signal:
                    s = status(base, name)
                    if s["steps"] > before["steps"] or s["dropped"] != before["dropped"]:
                        break
                    assert time.time() < deadline, s
                    time.sleep(0.1)
                s = status(base, name)
                row[name] = {"mean_reward": mean, "steps": s["steps"],
                             "dropped": s["dropped"]}
            row["seconds"] = round(time.time() - t0, 1)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
