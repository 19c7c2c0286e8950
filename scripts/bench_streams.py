#!/usr/bin/env python3
"""Concurrent streams against llama.cpp's server: the same GGUF file served by `flywheel serve`
and by `llama-server` (16 slots), each sent the same N concurrent completions (a fixed prompt,
`max_tokens` tokens each, EOS ignored) over HTTP, alternating servers for `--rounds` rounds.
Prints per run the aggregate generated tokens/s (wall time from the first request sent to the
last answer, after one warm-up request) and, at the end, the median ratio.

    scripts/bench_streams.py --llama-server PATH [--model models/random/llama-1b.q4_k_m.gguf] \\
        [--streams 16] [--tokens 32] [--rounds 2] [--precision exact]

The model: `flywheel random-model --shape llama-1b --quant q4_k_m --out ...` (speed does not
depend on the values). Both servers get every core (`-t` = the CPU count for llama-server).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from flywheel_server import stop  # noqa: E402

FLYWHEEL = os.path.join(ROOT, "target", "release", "flywheel")
PROMPT = "Once upon a time, in a land far away, there lived a curious engineer who"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=900):
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url, proc, secs=300):
    deadline = time.time() + secs
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} never answered")


def run(kind, a):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    threads = os.cpu_count()
    if kind == "flywheel":
        cmd = [FLYWHEEL, "serve", "--model", a.model, "--port", str(port),
               "--precision", a.precision]
        model = None
    else:
        ctx = a.streams * (64 + a.tokens + 64)
        cmd = [a.llama_server, "-m", a.model, "--port", str(port), "-np", str(a.streams),
               "-c", str(ctx), "-t", str(threads), "-tb", str(threads)]
        model = "m"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(base + "/health", proc)
        if model is None:
            with urllib.request.urlopen(base + "/v1/models") as r:
                model = json.loads(r.read())["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": a.tokens, "temperature": 1.0,
                "ignore_eos": True}
        post(base + "/v1/completions", dict(body, max_tokens=4))  # warm-up
        done = []

        def one(i):
            r = post(base + "/v1/completions", dict(body, seed=i))
            done.append(r["usage"]["completion_tokens"])

        ts = [threading.Thread(target=one, args=(i,)) for i in range(a.streams)]
        t0 = time.time()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        secs = time.time() - t0
        assert len(done) == a.streams, done
        return sum(done) / secs, sum(done)
    finally:
        stop(proc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "random",
                                                    "llama-1b.q4_k_m.gguf"))
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", default="exact")
    a = ap.parse_args()
    if not a.llama_server:
        sys.exit("give --llama-server (or $LLAMA_SERVER)")
    rates = {"flywheel": [], "llama-server": []}
    for rnd in range(a.rounds):
        for kind in ("flywheel", "llama-server"):
            rate, n = run(kind, a)
            rates[kind].append(rate)
            print(json.dumps({"round": rnd, "server": kind, "streams": a.streams,
                              "tokens": n, "tokens_per_second": round(rate, 2)}), flush=True)
    f, l = statistics.median(rates["flywheel"]), statistics.median(rates["llama-server"])
    print(json.dumps({"flywheel_over_llama_server": round(f / l, 3),
                      "precision": a.precision}))


if __name__ == "__main__":
    main()
