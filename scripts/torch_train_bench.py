"""PyTorch + PEFT reference for `flywheel bench --train`: one forward+backward+AdamW step on
BATCH x SEQ tokens of the default model (GGUF dequantized to f32 by transformers), LoRA r=16 or OFT
b=32 on all seven projections, 2 threads; median of RUNS steps after one warm-up, and peak RSS.
SHAPE `llama-1b`: a Llama-3.2-1B-shaped model with random f32 weights instead (transformers'
config, tied 128k-row embedding; speed does not depend on the values).

    /tmp/peftenv/bin/python scripts/torch_train_bench.py lora|oft [BATCH] [SEQ] [RUNS] [f32|bf16] [SHAPE]

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
shape = sys.argv[6] if len(sys.argv) > 6 else "smollm2"
torch.set_num_threads(2)


def llama_1b():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_parameters=rope, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float().eval()


base = {"smollm2": load_smollm2, "llama-1b": llama_1b}[shape]()
m = peft_model(base, kind, TARGETS, **(dict(r=16, lora_alpha=32) if kind == "lora" else dict(oft_block_size=32)))
m.train()
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, base.config.vocab_size, (batch, seq), generator=g)
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
