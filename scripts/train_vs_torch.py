"""`flywheel bench --train` against PyTorch + PEFT (`scripts/torch_train_bench.py`) on the same
machine, alternately in one invocation (these machines are noisy: the ratio of neighbouring runs
is the measurement). One full step (forward, backward, AdamW) on BATCH x SEQ tokens, LoRA r=16 and
OFT b=32 on all seven projections; prints each round and the median ratio per adapter.

    python3 scripts/train_vs_torch.py [--rounds 2] [--batch 8] [--seq 256] [--torch-python PY]

PY is a Python with torch, transformers, peft and gguf (default /tmp/peftenv/bin/python).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours(kind, batch, seq):
    out = subprocess.run(
        [os.path.join(ROOT, "target/release/flywheel"), "bench", "--train", "--adapter", kind,
         "--batch", str(batch), "--seq-len", str(seq), "--runs", "3"],
        check=True, capture_output=True, text=True, cwd=ROOT).stdout
    j = json.loads(out.strip().splitlines()[-1])
    return j["tokens_per_second"], j["peak_rss_bytes"] / 1e9


def torch(py, kind, batch, seq):
    out = subprocess.run(
        [py, os.path.join(ROOT, "scripts/torch_train_bench.py"), kind, str(batch), str(seq), "3"],
        check=True, capture_output=True, text=True, cwd=ROOT).stdout
    m = re.search(r"([\d.]+) tokens/s, peak RSS ([\d.]+) GB", out)
    return float(m.group(1)), float(m.group(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--torch-python", default="/tmp/peftenv/bin/python")
    a = ap.parse_args()
    for kind in ["lora", "oft"]:
        ratios = []
        for r in range(a.rounds):
            f, frss = ours(kind, a.batch, a.seq)
            t, trss = torch(a.torch_python, kind, a.batch, a.seq)
            ratios.append(f / t)
            print(f"{kind} round {r + 1}: flywheel {f:.1f} tok/s ({frss:.2f} GB), "
                  f"torch {t:.1f} tok/s ({trss:.2f} GB), ratio {f / t:.2f}", flush=True)
        print(f"{kind}: median ratio {statistics.median(ratios):.2f} over {a.rounds} rounds",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
