"""What constrained decoding costs the batch it shares: tokens/s of 16 concurrent chat streams,
all free, against 16 streams of which 4 are constrained by a JSON Schema (a long string inside
an object: llguidance's lexer works on every token), alternating rounds, medians.

    cargo build --release
    python3 scripts/bench_constrained.py [--rounds 3] [--tokens 128]

Starts its own server on the default model (127.0.0.1, a free port) and stops it.
"""

import argparse
import concurrent.futures as cf
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}},
          "required": ["story"], "additionalProperties": False}


def start():
    p = subprocess.Popen([os.path.join(ROOT, "target", "release", "flywheel"), "serve",
                          "--model", MODEL, "--port", "0", "--host", "127.0.0.1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    addr = None
    while time.time() < deadline:
        line = re.sub(r"\x1b\[[0-9;]*m", "", p.stdout.readline())
        if "listening" in line and "local=" in line:
            addr = line.split("local=")[1].split()[0]
        if " ready" in line and addr:
            return p, addr
    p.kill()
    sys.exit("the server did not start")


def chat(addr, body):
    req = urllib.request.Request(f"http://{addr}/v1/chat/completions",
                                 data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def round_(addr, model, tokens, constrained):
    bodies = []
    for i in range(16):
        b = {"model": model, "messages": [{"role": "user", "content": f"Tell story number {i}."}],
             "max_tokens": tokens, "temperature": 1.0, "seed": i}
        if i < constrained:
            b["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "s", "schema": SCHEMA}}
        else:
            b["ignore_eos"] = True
        bodies.append(b)
    t0 = time.time()
    with cf.ThreadPoolExecutor(16) as pool:
        rs = list(pool.map(lambda b: chat(addr, b), bodies))
    wall = time.time() - t0
    n = sum(r["usage"]["completion_tokens"] for r in rs)
    for r, b in zip(rs, bodies):
        if "response_format" in b:
            assert r["choices"][0]["message"]["content"].startswith('{"story": "'), r
    return n / wall, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    p, addr = start()
    try:
        model = json.loads(urllib.request.urlopen(f"http://{addr}/v1/models").read())["data"][0]["id"]
        round_(addr, model, 16, 4)  # warm-up: the vocabulary's grammar tables are built once
        free, mixed = [], []
        for k in range(a.rounds):
            f, nf = round_(addr, model, a.tokens, 0)
            m, nm = round_(addr, model, a.tokens, 4)
            free.append(f)
            mixed.append(m)
            print(f"round {k}: 16 free {f:7.1f} tok/s ({nf} tokens)   "
                  f"12 free + 4 constrained {m:7.1f} tok/s ({nm} tokens)", flush=True)
        mf, mm = statistics.median(free), statistics.median(mixed)
        print(f"median: 16 free {mf:.1f} tok/s; with 4 constrained {mm:.1f} tok/s; "
              f"ratio {mm / mf:.3f}")
    finally:
        p.terminate()
        p.wait(timeout=30)


if __name__ == "__main__":
    main()
