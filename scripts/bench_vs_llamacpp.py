#!/usr/bin/env python3
"""Flywheel vs llama.cpp (through llama-cpp-python) on the same machine, in the same invocation.

Alternates the two, ROUNDS times: llama.cpp pp512 (one 512-token eval) and tg128 (128 single-token
evals after a short prompt, like llama-bench's tg128), then `flywheel bench`. Prints the medians and
the ratios. Usage: python3 scripts/bench_vs_llamacpp.py [ROUNDS] [--model PATH.gguf]
[--precision exact,bf16] (default: the default model, exact products; with several precisions each
round runs flywheel once per precision; scripts/hf_families_fixture.py --bench writes one of each
family to time).
"""
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
BIN = os.path.join(ROOT, "target", "release", "flywheel")


def llama_cpp_round(llm, pp=512, tg=128):
    toks = llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 60, add_bos=False)[:pp]
    llm.reset()
    t = time.perf_counter()
    llm.eval(toks)
    pp_tps = pp / (time.perf_counter() - t)
    llm.reset()
    llm.eval(toks[:8])
    tok = toks[8]
    t = time.perf_counter()
    for _ in range(tg):
        llm.eval([tok])
    tg_tps = tg / (time.perf_counter() - t)
    return pp_tps, tg_tps


def flywheel_round(precision):
    out = subprocess.run([BIN, "bench", "--model", MODEL, "--runs", "3", "--batch", "1,16",
                          "--precision", precision],
                         capture_output=True, text=True, check=True).stdout
    j = json.loads(out.strip().splitlines()[-1])
    r = {(r["test"], r["batch"]): r["tokens_per_second"] for r in j["results"]}
    # The memory's limit measured by the same run, and the share of it batch-1 decode reads.
    r["bandwidth"] = (j["read_bandwidth_gbps"], j["decode_batch1_bandwidth_share"])
    return r


def main():
    global MODEL
    args = sys.argv[1:]
    if "--model" in args:
        i = args.index("--model")
        MODEL = os.path.abspath(args[i + 1])
        del args[i:i + 2]
    precisions = ["exact"]
    if "--precision" in args:
        i = args.index("--precision")
        precisions = args[i + 1].split(",")
        del args[i:i + 2]
    rounds = int(args[0]) if args else 3
    from llama_cpp import Llama
    llm = Llama(model_path=MODEL, n_ctx=1024, n_batch=512, n_threads=2, logits_all=False, verbose=False)
    lp, lt = [], []
    fw = {p: {"pp512": [], "tg128_b1": [], "tg128_b16": [], "read_gbps": [], "b1_share": []}
          for p in precisions}
    for _ in range(rounds):
        a, b = llama_cpp_round(llm)
        lp.append(a)
        lt.append(b)
        for p in precisions:
            r = flywheel_round(p)
            fw[p]["pp512"].append(r[("pp512", 1)])
            fw[p]["tg128_b1"].append(r[("tg128", 1)])
            fw[p]["tg128_b16"].append(r[("tg128", 16)])
            fw[p]["read_gbps"].append(r["bandwidth"][0])
            fw[p]["b1_share"].append(r["bandwidth"][1])
    m = statistics.median
    print(f"{'test':<14}{'precision':>10}{'llama.cpp':>12}{'flywheel':>12}{'ratio':>8}")
    for p in precisions:
        fp, f1, f16 = (m(fw[p][k]) for k in ("pp512", "tg128_b1", "tg128_b16"))
        print(f"{'pp512':<14}{p:>10}{m(lp):>12.1f}{fp:>12.1f}{fp / m(lp):>8.2f}")
        print(f"{'tg128 b=1':<14}{p:>10}{m(lt):>12.1f}{f1:>12.1f}{f1 / m(lt):>8.2f}")
        print(f"{'tg128 b=16':<14}{p:>10}{'':>12}{f16:>12.1f}{f16 / m(lt):>8.2f}  (vs llama.cpp b=1)")
        print(f"{'':<14}{p:>10}  batch-1 decode reads {100 * m(fw[p]['b1_share']):.0f}% of the read "
              f"bandwidth measured in the same runs ({m(fw[p]['read_gbps']):.1f} GB/s)")
    print(json.dumps({"model": os.path.basename(MODEL), "rounds": rounds, "llama_cpp": {"pp512": m(lp), "tg128": m(lt)},
                      "flywheel": {p: {k: m(v) for k, v in fw[p].items()} for p in precisions},
                      "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}}))


if __name__ == "__main__":
    main()
