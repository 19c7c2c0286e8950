"""PyTorch + PEFT reference for `flywheel bench --train`: one forward+backward+AdamW step on
BATCH x SEQ tokens of the default model (GGUF dequantized to f32 by transformers), LoRA r=16 or OFT
b=32 on all seven projections, 2 threads; median of RUNS steps after one warm-up, and peak RSS.

    /tmp/peftenv/bin/python scripts/torch_train_bench.py lora|oft [BATCH] [SEQ] [RUNS] [f32|bf16]

bf16: the forward under `torch.autocast("cpu", dtype=torch.bfloat16)` (oneDNN's BF16 kernels;
PyTorch's faster mode where the CPU has AVX512_BF16 or AMX).
"""

import resource
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from peft_fixture import TARGETS, load_smollm2, peft_model  # noqa: E402

kind = sys.argv[1]
batch, seq, runs = (int(a) for a in (sys.argv[2:5] + ["8", "256", "3"][len(sys.argv[2:5]):]))
mode = sys.argv[5] if len(sys.argv) > 5 else "f32"
assert mode in ("f32", "bf16"), mode
torch.set_num_threads(2)
base = load_smollm2()
m = peft_model(base, kind, TARGETS, **(dict(r=16, lora_alpha=32) if kind == "lora" else dict(oft_block_size=32)))
m.train()
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 49152, (batch, seq), generator=g)
times = []
for i in range(runs + 1):
    t0 = time.time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
        out = m(ids).logits.float()
    lp = torch.log_softmax(out[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -lp.mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.time() - t0)
times = sorted(times[1:])
step = times[len(times) // 2]
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(f"torch {torch.__version__} {mode} {kind}: {batch}x{seq} step {step:.2f} s, {batch * seq / step:.1f} tokens/s, peak RSS {rss / 1e9:.2f} GB")
