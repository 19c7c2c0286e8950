#!/usr/bin/env python3
"""Partial rollouts on the default model, measured: long generations run while the trainer
publishes new versions (a short rewarded group every few seconds keeps it stepping), once with
`version_policy = "pinned"` and once with `"latest"`, alternating, each policy on a fresh server
with the same workload; and `"latest"` with `version_switch = "keep"`.

Per run it prints, over the long generations: their median wall time and tokens per second, the
version switches and the tokens whose K/V were recomputed (the server's counters), the sample
staleness the trainer will count (the newest version at the generation's end minus its oldest
version) and the token staleness (the same, token by token, against the version that computed
each token). What a switch costs is the latest run's time against the pinned one's; keeping the
K/V costs no recompute, and logs the tokens after a switch as no single version's (inexact).

    python3 scripts/partial_rollout_demo.py [--rounds 2] [--streams 4] [--tokens 512] [--every 4]
"""
import argparse
import json
import pathlib
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from flywheel_server import http, running_config  # noqa: E402

QUESTIONS = ["Tell me a long story about a dragon.", "Explain how the internet works.",
             "Describe a day in the life of a sailor.", "Write a long essay about the sea."]


def metric(base, name):
    text = http("GET", base + "/metrics")[2].decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def status(base):
    return json.loads(http("GET", base + "/v1/train/status")[2])["adapters"]["brief"]


def long_generation(base, i, tokens, out):
    t0 = time.time()
    st, _, body = http("POST", base + "/v1/chat/completions", {
        "model": "brief", "messages": [{"role": "user", "content": QUESTIONS[i % 4]}],
        "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True, "seed": i})
    assert st == 200, body
    r = json.loads(body)
    c = r["choices"][0]
    spans = c.get("adapter_versions") or [{"from_token": 0, "version": r["adapter_version"]}]
    out[i] = {"seconds": time.time() - t0, "tokens": r["usage"]["completion_tokens"],
              "spans": spans, "newest_at_end": status(base)["version"]}


POLICIES = {"pinned": "", "latest": 'version_policy = "latest"\n',
            "keep": 'version_policy = "latest"\nversion_switch = "keep"\n'}


def run(policy, a):
    toml = (
        "[online]\nmax_off_policy_steps = 1000\n[[learn]]\nname = \"brief\"\n"
        "lr = 0.0002\n" + POLICIES[policy])
    with running_config(toml) as base:
        out = {}
        threads = [threading.Thread(target=long_generation, args=(base, i, a.tokens, out))
                   for i in range(a.streams)]
        for t in threads:
            t.start()
        # A short group every `--every` seconds, rewarded at once, while the long generations
        # run: the trainer steps and publishes on that schedule (the same in both runs).
        k = 0
        while any(t.is_alive() for t in threads):
            t_next = time.time() + a.every
            st, _, body = http("POST", base + "/v1/chat/completions", {
                "model": "brief", "messages": [{"role": "user", "content": f"Say {k}."}],
                "n": 4, "max_tokens": 8, "temperature": 1.0})
            assert st == 200, body
            rid = json.loads(body)["id"]
            st, _, body = http("POST", base + "/v1/feedback", [
                {"id": rid, "choice": j, "reward": float(j % 2)} for j in range(4)])
            assert st == 202, body
            k += 1
            while time.time() < t_next and any(t.is_alive() for t in threads):
                time.sleep(0.05)
        for t in threads:
            t.join()
        lags, token_lags, n_tokens = [], 0.0, 0
        for g in out.values():
            newest = g["newest_at_end"]
            spans = g["spans"]
            lags.append(newest - spans[0]["version"])
            ends = [s["from_token"] for s in spans[1:]] + [g["tokens"]]
            for s, end in zip(spans, ends):
                token_lags += (newest - s["version"]) * (end - s["from_token"])
                n_tokens += end - s["from_token"]
        secs = [g["seconds"] for g in out.values()]
        return {
            "policy": policy,
            "steps": status(base)["steps"],
            "median_seconds": round(statistics.median(secs), 2),
            "tokens_per_second": round(n_tokens / max(secs), 1),
            "switches": metric(base, "flywheel_version_switches_total"),
            "recomputed_tokens": metric(base,
                                        "flywheel_version_switch_recomputed_tokens_total"),
            "sample_staleness_mean": round(statistics.mean(lags), 2),
            "token_staleness_mean": round(token_lags / max(n_tokens, 1), 2),
        }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--every", type=float, default=4.0)
    a = ap.parse_args()
    results = {p: [] for p in POLICIES}
    for rnd in range(a.rounds):
        for policy in POLICIES:
            r = run(policy, a)
            results[policy].append(r)
            print(json.dumps({"round": rnd, **r}), flush=True)
    p = statistics.median(r["median_seconds"] for r in results["pinned"])
    print(json.dumps({f"{k}_over_pinned_seconds": round(
        statistics.median(r["median_seconds"] for r in v) / p, 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()
