#!/usr/bin/env python3
"""Speed at real sizes: random-weight models of real shapes (`flywheel random-model`: speed does
not depend on the values) against llama.cpp's `llama-bench` on the same file, alternating in one
invocation, medians of the rounds. Prints one line per test with tokens/s, the ratio, and batch-1
decode's share of the read bandwidth `flywheel bench` measures in the same run.

    scripts/bench_real.py [--shapes llama-1b,llama-3b] [--quants q4_k_m,q8_0] \\
        [--precisions exact,int8] [--pp 512] [--tg 64] [--rounds 3] [--llama-bench PATH]

Files are written once under models/random/ (git-ignored). llama-bench: --llama-bench, or
$LLAMA_BENCH; without one the llama.cpp column is skipped, saying so (scripts/gpu-llamacpp's
trimmed source builds it: see docs/gpu.md).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLYWHEEL = os.path.join(ROOT, "target", "release", "flywheel")


def model(shape, quant):
    path = os.path.join(ROOT, "models", "random", f"{shape}.{quant}.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run([FLYWHEEL, "random-model", "--shape", shape, "--quant", quant,
                        "--out", path + ".tmp"], check=True)
        os.replace(path + ".tmp", path)
    return path


def flywheel(path, precision, pp, tg, threads):
    out = subprocess.run(
        [FLYWHEEL, "bench", "--model", path, "--prompt-tokens", str(pp), "--decode-tokens",
         str(tg), "--batch", "1", "--runs", "1", "--precision", precision, "--threads",
         str(threads)],
        check=True, capture_output=True, text=True).stdout
    j = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    r = {x["test"][:2]: x["tokens_per_second"] for x in j["results"]}
    return r["pp"], r["tg"], j["weight_bytes_per_token"], j["read_bandwidth_gbps"]


def llama_bench(exe, path, pp, tg, threads):
    out = subprocess.run([exe, "-m", path, "-p", str(pp), "-n", str(tg), "-t", str(threads),
                          "-r", "1", "-o", "json"], check=True, capture_output=True,
                         text=True).stdout
    rows = json.loads(out)
    pp_ts = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    tg_ts = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    return pp_ts, tg_ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-1b")
    ap.add_argument("--quants", default="q4_k_m")
    ap.add_argument("--precisions", default="exact,int8")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    a = ap.parse_args()
    if not os.path.exists(FLYWHEEL):
        sys.exit("build first: cargo build --release")
    if not a.llama_bench:
        print("llama-bench not given (--llama-bench or $LLAMA_BENCH): its column is skipped")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), "?")
    print(f"machine: {cpu}, {a.threads} threads; pp{a.pp}, tg{a.tg}, medians of {a.rounds} "
          "alternating rounds")
    for shape in a.shapes.split(","):
        for quant in a.quants.split(","):
            path = model(shape, quant)
            ours = {p: [] for p in a.precisions.split(",")}
            theirs = []
            for _ in range(a.rounds):
                for p in ours:
                    ours[p].append(flywheel(path, p, a.pp, a.tg, a.threads))
                if a.llama_bench:
                    theirs.append(llama_bench(a.llama_bench, path, a.pp, a.tg, a.threads))
            med = lambda xs: statistics.median(xs)
            lc_pp = med([t[0] for t in theirs]) if theirs else None
            lc_tg = med([t[1] for t in theirs]) if theirs else None
            for p, runs in ours.items():
                pp, tg = med([r[0] for r in runs]), med([r[1] for r in runs])
                share = tg * runs[0][2] / (med([r[3] for r in runs]) * 1e9)
                ratio = lambda x, y: f"{x / y:.2f}x" if y else "-"
                print(f"{shape} {quant} {p:>5}: pp{a.pp} {pp:7.1f} tok/s ({ratio(pp, lc_pp)} "
                      f"llama.cpp {lc_pp or 0:.1f}), tg {tg:6.2f} tok/s ({ratio(tg, lc_tg)} "
                      f"llama.cpp {lc_tg or 0:.2f}), decode at {100 * share:.0f}% of the read "
                      "bandwidth")


if __name__ == "__main__":
    main()
