"""PEFT adapters for the default model give PEFT's next-token distribution through Flywheel.

tests/fixtures/peft_smollm2.json was written by scripts/peft_fixture.py with torch + peft: a LoRA
(r=8) and an OFT (b=32) adapter on all seven projections of SmolLM2-135M-Instruct, their values a
seeded SplitMix64 stream, and PEFT's top-20 next-token log-probs after a chat prompt (the GGUF
dequantized to f32 by transformers). Here the same adapters are rebuilt with numpy (bit-identical
to the files PEFT saved, checked when the fixture was made), loaded by `flywheel generate
--adapter`, and the log-probs compared. Runs after `cargo build --release`.
"""

import json
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import peft_adapters  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "flywheel"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "peft_smollm2.json").read_text())
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def flywheel_top(adapter=None, k=20):
    # Exact (f32) products: compared with PEFT's f32 forward to well under 1e-3 (the default,
    # BF16 where the CPU has it, moves log-probs by some 0.05).
    args = [str(BIN), "generate", "--model", str(MODEL), "--prompt", PROMPT, "--max-tokens", "1",
            "--json", "--top-logprobs", str(k), "--precision", "exact"]
    if adapter:
        args += ["--adapter", str(adapter)]
    out = json.loads(subprocess.run(args, check=True, capture_output=True, text=True, timeout=300).stdout)
    assert out["prompt_token_ids"] == FIXTURE["prompt_token_ids"]
    return {t["token_id"]: t["logprob"] for t in out["logprobs"][0]["top_logprobs"]}


@pytest.mark.parametrize("variant", sorted(FIXTURE["variants"]))
def test_peft_adapter_gives_pefts_next_token_distribution(variant, tmp_path):
    spec = FIXTURE["variants"][variant]
    d = peft_adapters.write_adapter(tmp_path / variant, spec)
    ours = flywheel_top(d)
    theirs = {int(t): v for t, v in spec["top"]}
    base = {int(t): v for t, v in FIXTURE["base_top"]}
    # The same most likely tokens, and the same log-probs to well under PEFT-vs-ours f32 noise.
    top5 = [t for t, _ in spec["top"][:5]]
    assert sorted(ours, key=ours.get, reverse=True)[:5] == top5
    common = set(ours) & set(theirs)
    assert len(common) >= 15
    worst = max(abs(ours[t] - theirs[t]) for t in common)
    print(f"{variant}: max |Δ log-prob| vs PEFT over {len(common)} top tokens: {worst:.2e}")
    assert worst < 1e-3
    # The adapter really moved the distribution (so agreement above is not the base's).
    moved = max(abs(theirs[t] - base[t]) for t in set(theirs) & set(base))
    assert moved > 0.02, moved
