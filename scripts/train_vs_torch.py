"""`flywheel bench --train` against PyTorch + PEFT (`scripts/torch_train_bench.py`) on the same
machine, alternately in one invocation (these machines are noisy: the ratio of neighbouring runs
is the measurement). One full step (forward, backward, AdamW) on BATCH x SEQ tokens, LoRA r=16 and
OFT b=32 on all seven projections; prints each round and the median ratio per adapter.

    python3 scripts/train_vs_torch.py [--rounds 2] [--batch 8] [--seq 256] [--torch-python PY]
        [--precision exact,bf16] [--torch-modes f32,bf16] [--kinds lora,oft]
        [--model GGUF --shape llama-1b]

`--model` trains on that GGUF (e.g. `flywheel random-model --shape llama-1b --quant q4_k_m`) and
`--shape` gives PyTorch the same shape with random f32 weights (speed does not depend on them).

Each round runs flywheel once per precision and PyTorch once per mode; the ratios are against
PyTorch's faster mode of that round (its f32 or its bf16 autocast).

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


def ours(kind, batch, seq, precision, model=None):
    extra = ["--model", model] if model else []
    out = subprocess.run(
        [os.path.join(ROOT, "target/release/flywheel"), "bench", "--train", "--adapter", kind,
         "--batch", str(batch), "--seq-len", str(seq), "--runs", "3", "--precision", precision]
        + extra,
        check=True, capture_output=True, text=True, cwd=ROOT).stdout
    j = json.loads(out.strip().splitlines()[-1])
    return j["tokens_per_second"], j["peak_rss_bytes"] / 1e9


def torch(py, kind, batch, seq, mode, shape="smollm2"):
    out = subprocess.run(
        [py, os.path.join(ROOT, "scripts/torch_train_bench.py"), kind, str(batch), str(seq), "3",
         mode, shape],
        check=True, capture_output=True, text=True, cwd=ROOT).stdout
    m = re.search(r"([\d.]+) tokens/s, peak RSS ([\d.]+) GB", out)
    return float(m.group(1)), float(m.group(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--torch-python", default="/tmp/peftenv/bin/python")
    ap.add_argument("--precision", default="exact")
    ap.add_argument("--torch-modes", default="f32")
    ap.add_argument("--kinds", default="lora,oft")
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default="smollm2")
    a = ap.parse_args()
    precisions, modes = a.precision.split(","), a.torch_modes.split(",")
    for kind in a.kinds.split(","):
        ratios = {p: [] for p in precisions}
        for r in range(a.rounds):
            fw = {p: ours(kind, a.batch, a.seq, p, a.model) for p in precisions}
            pt = {m: torch(a.torch_python, kind, a.batch, a.seq, m, a.shape) for m in modes}
            best = max(modes, key=lambda m: pt[m][0])
            for p in precisions:
                ratios[p].append(fw[p][0] / pt[best][0])
            line = ", ".join(f"flywheel {p} {fw[p][0]:.1f} tok/s ({fw[p][1]:.2f} GB)" for p in precisions)
            line += ", " + ", ".join(f"torch {m} {pt[m][0]:.1f} tok/s ({pt[m][1]:.2f} GB)" for m in modes)
            print(f"{kind} round {r + 1}: {line}; peer: torch {best}", flush=True)
        for p in precisions:
            print(f"{kind}: flywheel {p} / PyTorch's faster mode: median ratio "
                  f"{statistics.median(ratios[p]):.2f} over {a.rounds} rounds", flush=True)


if __name__ == "__main__":
    sys.exit(main())
