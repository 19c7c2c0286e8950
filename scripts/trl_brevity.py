"""TRL's GRPO on the brevity task of examples/brevity.py, for a same-machine comparison.

The same model (the default GGUF, dequantized to f32 by transformers' GGUF loader: no hub), the
same prompts, reward (1 for answers of MIN to MAX words, else 0), group size (8 answers per
prompt, one prompt per step), max tokens, temperature 1, learning rate (2e-4 constant,
Flywheel's default) and adapter (PEFT OFT b=32 on all seven projections, Flywheel's default; `--adapter
lora` for LoRA r=16), 2 threads, no KL term (Flywheel's default kl_coef 0). Writes per step the
mean reward and the elapsed seconds as CSV, in the columns examples/brevity.py writes, so the two
runs compare directly (`scripts/compare_brevity.py`).

Needs torch, transformers, peft, gguf and trl from PyPI (not installed by the test script):
    /work/torchenv/bin/python scripts/trl_brevity.py [--steps 30] [--out examples/results/trl_brevity]
"""

import argparse
import csv
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "examples"))
from peft_fixture import TARGETS, load_smollm2  # noqa: E402
from brevity import PROMPTS  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--min-words", type=int, default=3)
    ap.add_argument("--max-words", type=int, default=15)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--adapter", choices=["oft", "lora"], default="oft")
    ap.add_argument("--out", default=str(ROOT / "examples" / "results" / "trl_brevity"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    from datasets import Dataset
    from peft import LoraConfig, OFTConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    smol = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    model = load_smollm2()
    # transformers' GGUF loader dequantizes every tensor to f32 but leaves the model marked as
    # GGUF-quantized, which its Trainer refuses to train: unmark it (the weights are plain f32).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # One prompt per step, in brevity.py's order.
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": PROMPTS[s % len(PROMPTS)]}]}
                              for s in range(a.steps)])
    rows = []
    t0 = time.time()
    last = [t0]

    def reward(completions, **_):
        words = [len((c[0]["content"] or "").split()) for c in completions]
        r = [1.0 if a.min_words <= w <= a.max_words else 0.0 for w in words]
        now = time.time()
        rows.append({"step": len(rows), "version": len(rows) + 1, "mean_reward": sum(r) / len(r),
                     "mean_words": sum(words) / len(words), "seconds": now - t0,
                     "step_seconds": now - last[0]})
        last[0] = now
        s = rows[-1]
        print(f"step {s['step']:3d}  mean reward {s['mean_reward']:.2f}  mean words "
              f"{s['mean_words']:5.1f}  total {s['seconds']:6.1f} s", flush=True)
        return r

    peft_cfg = (LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                           task_type="CAUSAL_LM") if a.adapter == "lora" else
                OFTConfig(r=0, oft_block_size=32, target_modules=TARGETS, task_type="CAUSAL_LM"))
    cfg = GRPOConfig(
        output_dir="/tmp/trl_brevity", learning_rate=a.lr, per_device_train_batch_size=a.n,
        num_generations=a.n, max_completion_length=a.max_tokens, temperature=1.0, beta=0.0,
        lr_scheduler_type="constant", max_steps=a.steps, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        bf16=False, shuffle_dataset=False, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data,
                          processing_class=tok, peft_config=peft_cfg)
    trainer.train()
    with open(a.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("wrote", a.out + ".csv")


if __name__ == "__main__":
    main()
