"""`flywheel grad` on the default model against PyTorch + PEFT's autograd.

tests/fixtures/peft_smollm2_grads.json was written by `scripts/peft_fixture.py grads` (torch,
transformers' GGUF loader dequantizing the Q4_1 model to f32, PEFT): for the seeded LoRA r=8 and
OFT b=32 adapters on all seven projections, the objective J = Σ log π over a fixed completion and a
digest of dJ/dθ per tensor (norm, 4 seeded projections, first values). Here the same adapters are
rebuilt with numpy, `flywheel grad` computes J and the gradients through the frozen 4-bit base, and
the digests are compared: per-tensor relative error ≤ 1e-3.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import peft_adapters  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "flywheel"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "peft_smollm2_grads.json").read_text())


@pytest.mark.parametrize("variant", sorted(FIXTURE["variants"]))
def test_flywheel_grad_matches_pytorch_peft(variant, tmp_path):
    ref = FIXTURE["variants"][variant]
    d = peft_adapters.write_adapter(tmp_path / variant, ref)
    sample = tmp_path / "sample.json"
    sample.write_text(json.dumps(FIXTURE["sample"]))
    out = tmp_path / "grads.safetensors"
    # Exact (f32) products: compared with PyTorch's f32 to 1e-4 (not the default BF16's).
    r = subprocess.run([str(BIN), "grad", "--model", str(MODEL), "--adapter", str(d), "--sample",
                        str(sample), "--out", str(out), "--precision", "exact"], check=True,
                       capture_output=True, text=True, timeout=600)
    res = json.loads(r.stdout)
    assert len(res["token_logprobs"]) == len(FIXTURE["sample"]["completion_token_ids"])
    assert abs(res["objective"] - ref["objective"]) <= 1e-4 * abs(ref["objective"]), (res["objective"], ref["objective"])
    ours = peft_adapters.digest(peft_adapters.read_safetensors(out))
    assert sorted(ours) == sorted(ref["tensors"])
    worst = 0.0
    for k, want in ref["tensors"].items():
        got = ours[k]
        n = want["norm"]
        assert n > 0, k
        unorm = np.sqrt(want["size"] / 3.0)  # a uniform [-1, 1) vector's norm, about
        rel = max([abs(got["norm"] - n) / n] + [abs(a - b) / (n * unorm) for a, b in zip(got["proj"], want["proj"])])
        worst = max(worst, rel)
        assert rel <= 1e-3, f"{k}: relative error {rel:.2e}"
    print(f"{variant}: J {res['objective']:.6f} vs {ref['objective']:.6f}; worst per-tensor relative error {worst:.2e} over {len(ours)} tensors")
