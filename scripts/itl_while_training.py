"""Serving latency while the trainer is busy vs idle, on the default model, same server, same
invocation. A backlog of rewarded groups (n=8, 48 tokens) through a learning adapter keeps the
trainer busy; the load is streaming chat on the base model at concurrency 8 (loadtest). Runs
idle, busy, idle, busy and prints the ITL/TTFT percentiles and the busy/idle ratios (medians).

    cargo build --release -p flywheel -p loadtest
    python3 scripts/itl_while_training.py [--rounds 2] [--backlog 12]
"""

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from flywheel_server import MODEL, ROOT, start_server  # noqa: E402

LOADTEST = ROOT / "target" / "release" / "loadtest"


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def status(base):
    with urllib.request.urlopen(base + "/v1/train/status", timeout=60) as r:
        return json.loads(r.read())["adapters"]["busy"]


def load(base, requests):
    out = subprocess.run([str(LOADTEST), "--url", base, "--model", MODEL.stem, "--concurrency", "8",
                          "--requests", str(requests), "--max-tokens", "64"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{"):])["server"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backlog", type=int, default=12)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--share", type=float, default=None, help="online.train_share")
    ap.add_argument("--online", default="", help="more [online] lines (a share policy: train_itl_budget = 1.5)")
    a = ap.parse_args()
    data = tempfile.mkdtemp()
    cfg = pathlib.Path(data) / "serve.toml"
    share = "" if a.share is None else f"train_share = {a.share}\n"
    cfg.write_text("[online]\nmax_off_policy_steps = 1000000\n" + share + a.online.replace("\\n", "\n") + "\n")
    proc, base = start_server(["--learn", "busy", "--data-dir", data, "--config", str(cfg)])
    try:
        rows = []
        for rnd in range(a.rounds):
            idle = load(base, a.requests)
            # The backlog: sampled first, rewarded at once, trained while the load runs.
            groups = [post(base, "/v1/chat/completions", {
                "model": "busy", "messages": [{"role": "user", "content": f"Tell me a story {i}."}],
                "n": 8, "max_tokens": 48, "temperature": 1.0}) for i in range(a.backlog)]
            s0 = status(base)["steps"]
            post(base, "/v1/feedback", [{"id": g["id"], "choice": c["index"], "reward": c["index"] % 2}
                                        for g in groups for c in g["choices"]])
            time.sleep(0.5)
            busy = load(base, a.requests)
            s1 = status(base)["steps"]
            rows.append((idle, busy, s1 - s0))
            print(f"round {rnd}: idle ITL p50 {idle['itl_p50']*1e3:.1f} p99 {idle['itl_p99']*1e3:.1f} ms | "
                  f"busy ITL p50 {busy['itl_p50']*1e3:.1f} p99 {busy['itl_p99']*1e3:.1f} ms | "
                  f"{s1 - s0} steps trained during the busy run", flush=True)
            # Let the trainer drain the backlog before the next idle run.
            deadline = time.time() + 900
            while status(base)["pending_groups"] > 0 and time.time() < deadline:
                time.sleep(1)
        def med(xs):
            xs = sorted(xs)
            return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2
        for k in ["itl_p50", "itl_p99", "ttft_p50", "ttft_p99", "output_tokens_per_second"]:
            i, b = med([r[0][k] for r in rows]), med([r[1][k] for r in rows])
            print(f"{k:26s} idle {i:9.4f}  busy {b:9.4f}  busy/idle {b / i:5.2f}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
