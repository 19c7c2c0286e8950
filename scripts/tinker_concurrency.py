#!/usr/bin/env python3
"""Tinker runs at once against one alone: the aggregate training tokens/s of N concurrent LoRA
runs (each its own SDK client and session, each taking steps of `forward_backward` with
cross_entropy on its own datums + `optim_step`) on one `flywheel serve`, for each N, alternating
in rounds, medians. Runs in the tinker SDK's virtual environment (scripts/test makes it):

    ~/.cache/flywheel/tinker-0.38.0-venv/bin/python scripts/tinker_concurrency.py \\
        [--runs 1,4] [--steps 3] [--datums 8] [--tokens 64] [--rounds 3]

Prints one line per N: tokens/s and the ratio to the first N, and the steps' time spread across
runs (fairness: the slowest run's time over the fastest's). Then what merging two runs' calls
into one pass over the base could gain at most: one run's `forward_backward` of 2 x datums in one
call against two calls of `datums` (alternating, medians of `rounds`)."""
import argparse
import os
import pathlib
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from flywheel_server import MODEL, running  # noqa: E402

import tinker  # noqa: E402
from tinker import types  # noqa: E402

KEY = "tml-bench"


def datums(seed, n, length):
    """n datums of `length` tokens, each run its own (a target it learns)."""
    out = []
    for d in range(n):
        toks = [(seed * 7919 + d * 104729 + i * 31) % 40000 + 100 for i in range(length + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:]}))
    return out


def one_round(base, n, a):
    clients = []
    for r in range(n):
        c = tinker.ServiceClient(base_url=base, api_key=KEY)
        t = c.create_lora_training_client(base_model=MODEL.stem, rank=8, seed=r,
                                          train_unembed=False).result()
        clients.append((c, t, datums(r, a.datums, a.tokens)))
    times = [0.0] * n
    start = threading.Barrier(n + 1)

    def work(i):
        _, t, data = clients[i]
        start.wait()
        t0 = time.time()
        for _ in range(a.steps):
            t.forward_backward(data, "cross_entropy")
            t.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        times[i] = time.time() - t0

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.time()
    for th in threads:
        th.join()
    wall = time.time() - t0
    tokens = n * a.steps * a.datums * a.tokens
    return tokens / wall, max(times) / max(min(times), 1e-9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="1,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ns = [int(x) for x in a.runs.split(",")]
    print(f"machine: {os.uname().nodename}, {os.cpu_count()} CPUs; {MODEL.name}; per run "
          f"{a.steps} steps of {a.datums} datums x {a.tokens} tokens; {a.rounds} rounds")
    rates = {n: [] for n in ns}
    spread = {n: [] for n in ns}
    with running(["--api-key", KEY]) as base:
        for _ in range(a.rounds):
            for n in ns:
                r, s = one_round(base, n, a)
                rates[n].append(r)
                spread[n].append(s)
        one, two = merge_probe(base, a)
    first = statistics.median(rates[ns[0]])
    for n in ns:
        m = statistics.median(rates[n])
        print(f"{n} run(s) at once: {m:7.1f} training tokens/s ({m / first:.2f}x {ns[0]}), "
              f"slowest run / fastest {statistics.median(spread[n]):.2f}")
    print(f"one pass of {2 * a.datums} datums: {one:.2f} s; two of {a.datums}: {two:.2f} s "
          f"(one pass / two: {one / two:.2f})")


def merge_probe(base, a):
    """Median times of one forward_backward of 2 x datums and of two of `datums` (one run)."""
    c = tinker.ServiceClient(base_url=base, api_key=KEY)
    t = c.create_lora_training_client(base_model=MODEL.stem, rank=8, seed=0,
                                      train_unembed=False).result()
    data = datums(0, 2 * a.datums, a.tokens)
    t.forward_backward(data[:a.datums], "cross_entropy").result()
    one, two = [], []
    for _ in range(a.rounds):
        t0 = time.time()
        t.forward_backward(data, "cross_entropy").result()
        one.append(time.time() - t0)
        t0 = time.time()
        t.forward_backward(data[:a.datums], "cross_entropy").result()
        t.forward_backward(data[a.datums:], "cross_entropy").result()
        two.append(time.time() - t0)
    return statistics.median(one), statistics.median(two)


if __name__ == "__main__":
    main()
