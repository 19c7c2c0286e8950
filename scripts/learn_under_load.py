"""Learning under serving load, per share policy, on the default model: 16 client streams chat
through a learning adapter (n=4, up to 48 tokens, temperature 1) and post a brevity reward for
every completion, for --secs each run; the trainer learns meanwhile. Each policy runs on a fresh
server, alternating, --rounds times. Prints per run and as medians: completions rewarded, trained
and dropped as stale, steps, the share the policy ended on, serving's output tokens/s and its
inter-token latency (mean and p99 from the server's histogram). Completions neither trained nor
dropped are still waiting when the run ends.

    cargo build --release -p flywheel
    python3 scripts/learn_under_load.py [--secs 120] [--rounds 1] \
        [--policy fixed=] [--policy 'budget=train_itl_budget = 1.5']
"""

import argparse
import json
import pathlib
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from flywheel_server import start_server  # noqa: E402

PROMPTS = ["Describe the sea.", "What is a cat?", "Tell me about Paris.", "Why is the sky blue?",
           "Name a fruit.", "How do birds fly?", "What is rain?", "Explain gravity."]


def call(base, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        return r.read().decode()


def itl(text):
    """Mean and p99 (interpolated in the histogram's buckets) of the inter-token latency."""
    buckets, total, count = [], 0.0, 0.0
    for line in text.splitlines():
        if line.startswith("flywheel_inter_token_latency_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
        elif line.startswith("flywheel_inter_token_latency_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("flywheel_inter_token_latency_seconds_count"):
            count = float(line.split()[-1])
    if count == 0:
        return 0.0, 0.0
    want, lo, below = 0.99 * count, 0.0, 0.0
    for le, n in buckets:
        if n >= want:
            return total / count, lo + (le - lo) * (want - below) / max(n - below, 1e-9)
        lo, below = le, n
    return total / count, lo


def stream(base, stop, out, k):
    i = k
    while not stop.is_set():
        r = call(base, "POST", "/v1/chat/completions", {
            "model": "busy", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "n": 4, "max_tokens": 48, "temperature": 1.0})
        i += 1
        rewards = [{"id": r["id"], "choice": c["index"],
                    "reward": 1.0 if 3 <= len(c["message"]["content"].split()) <= 15 else 0.0}
                   for c in r["choices"]]
        call(base, "POST", "/v1/feedback", rewards)
        out[k][0] += len(rewards)
        out[k][1] += r["usage"]["completion_tokens"]


def run(policy, secs, groups_per_step):
    data = tempfile.mkdtemp()
    cfg = pathlib.Path(data) / "serve.toml"
    cfg.write_text(f"[online]\n{policy}\n[[learn]]\nname = \"busy\"\n"
                   f"groups_per_step = {groups_per_step}\n")
    proc, base = start_server(["--data-dir", data, "--config", str(cfg)])
    try:
        stop, out = threading.Event(), [[0, 0] for _ in range(16)]
        threads = [threading.Thread(target=stream, args=(base, stop, out, k)) for k in range(16)]
        t0 = time.time()
        for t in threads:
            t.start()
        time.sleep(secs)
        stop.set()
        for t in threads:
            t.join()
        took = time.time() - t0
        st = call(base, "GET", "/v1/train/status")
        a, pol = st["adapters"]["busy"], st["policy"]
        mean, p99 = itl(metrics(base))
        return {"rewarded": sum(o[0] for o in out), "tokens_per_second": sum(o[1] for o in out) / took,
                "steps": a["steps"], "trained": a["trained"], "stale": a["dropped"].get("stale", 0),
                "dropped": sum(a["dropped"].values()), "dropped_by_reason": a["dropped"],
                "pending_groups": a["pending_groups"],
                "share": pol["train_share"], "last_change": pol["last_change"],
                "itl_mean": mean, "itl_p99": p99}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--secs", type=float, default=120)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--groups-per-step", type=int, default=8)
    ap.add_argument("--policy", action="append", default=None,
                    help="NAME=[online] lines (e.g. 'budget=train_itl_budget = 1.5'); repeatable")
    a = ap.parse_args()
    policies = [p.split("=", 1) for p in (a.policy or ["fixed=", "budget=train_itl_budget = 1.5"])]
    rows = {name: [] for name, _ in policies}
    for rnd in range(a.rounds):
        for name, lines in policies:
            r = run(lines.replace("\\n", "\n"), a.secs, a.groups_per_step)
            rows[name].append(r)
            print(f"round {rnd} {name}: {json.dumps(r)}", flush=True)
    def med(xs):
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2
    for name, rs in rows.items():
        k = lambda key: med([r[key] for r in rs])
        print(f"{name:10s} rewarded {k('rewarded'):6.0f}  trained {k('trained'):6.0f} "
              f"({k('trained') / max(k('rewarded'), 1):.0%})  dropped {k('dropped'):6.0f} (stale {k('stale'):.0f})  "
              f"steps {k('steps'):4.1f}  share {k('share'):.3f}  serving {k('tokens_per_second'):6.1f} tok/s  "
              f"ITL mean {k('itl_mean') * 1e3:5.1f} ms  p99 {k('itl_p99') * 1e3:5.1f} ms")


if __name__ == "__main__":
    main()
