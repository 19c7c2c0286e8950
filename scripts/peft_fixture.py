"""PEFT reference fixtures, so that CI can check Flywheel's adapters against PEFT without torch.

Needs torch, transformers, peft and gguf from PyPI (not installed by the test script):
    python3 -m venv /tmp/peftenv && /tmp/peftenv/bin/pip install torch transformers peft gguf numpy
    /tmp/peftenv/bin/python scripts/peft_fixture.py tiny      # -> tests/fixtures/peft_tiny/
    /tmp/peftenv/bin/python scripts/peft_fixture.py smollm2   # -> tests/fixtures/peft_smollm2.json

tiny: a random 2-layer Llama (GQA, tied embeddings) written as an f32 GGUF with llama.cpp's Q/K row
permutation, and PEFT adapters on it (LoRA, rsLoRA, OFT with Cayley–Neumann, OFT exact Cayley) with
random values, saved by PEFT's own `save_pretrained`; `expected.json` holds PEFT's log-probs at every
position of a token sequence for the base and each adapter. tests/adapters.rs loads these folders.

smollm2: the default model (GGUF Q4_1, dequantized to f32 by transformers' GGUF loader) with a LoRA
and an OFT adapter on all seven projections whose values come from a seeded SplitMix64 stream (so a
test can rebuild the very same adapter with numpy), and PEFT's next-token log-probs after a chat
prompt. tests/python/test_adapters_peft.py rebuilds the adapters and compares `flywheel generate
--adapter` with them. With --check-export DIR it also loads a folder exported by Flywheel into PEFT
and prints the largest log-prob difference from Flywheel's own answer in DIR/flywheel.json.
"""

import argparse
import copy
import json
import pathlib
import sys

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from peft_adapters import splitmix_uniform  # noqa: E402  (the stream the CI test rebuilds)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def permute(w, n_head, n_head_kv):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF halves -> GGUF adjacent pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, cfg, path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        w.add_tensor(f"blk.{l}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{l}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], h, h))
        w.add_tensor(f"blk.{l}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], h, kvh))
        w.add_tensor(f"blk.{l}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{l}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{l}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{l}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{l}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{l}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def peft_model(base, kind, targets, **kw):
    from peft import LoraConfig, OFTConfig, get_peft_model

    if kind == "lora":
        cfg = LoraConfig(target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM", **kw)
    else:
        cfg = OFTConfig(target_modules=targets, r=0, task_type="CAUSAL_LM", **kw)
    return get_peft_model(copy.deepcopy(base), cfg).eval()


def log_probs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    out = ROOT / "tests" / "fixtures" / "peft_tiny"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    base = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * (torch.rand_like(p) - 0.5))
            else:
                p.normal_(0.0, 0.25)
    write_gguf(base, cfg, out / "tiny.gguf")
    tokens = [5, 17, 33, 2, 90, 41, 41, 7, 63, 12, 0, 88]
    expected = {"tokens": tokens, "base": log_probs(base, tokens).tolist()}
    variants = {
        "lora": ("lora", TARGETS, dict(r=4, lora_alpha=8)),
        "lora_rs": ("lora", ["q_proj", "k_proj", "down_proj"], dict(r=8, lora_alpha=4, use_rslora=True)),
        "oft": ("oft", TARGETS, dict(oft_block_size=16)),
        "oft_exact": ("oft", ["q_proj", "v_proj", "up_proj"],
                      dict(oft_block_size=8, use_cayley_neumann=False)),
    }
    for name, (kind, targets, kw) in variants.items():
        torch.manual_seed(1 + len(name))
        m = peft_model(base, kind, targets, **kw)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_" in n or "oft_R" in n:
                    p.normal_(0.0, 0.15)
        m.save_pretrained(str(out / name))
        (out / name / "README.md").unlink(missing_ok=True)
        expected[name] = log_probs(m, tokens).tolist()
    (out / "expected.json").write_text(json.dumps(expected))
    print(f"wrote {out}")


SMOL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n
PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
SMOL_VARIANTS = {
    "lora": {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "seed": 101, "scale": 0.05},
    "oft": {"peft_type": "OFT", "oft_block_size": 32, "seed": 202, "scale": 0.02},
}


def load_smollm2():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name,
                                                torch_dtype=torch.float32).eval()


def fill_seeded(m, spec):
    """Every adapter tensor, in PEFT's state-dict order, from one SplitMix64 stream."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    sd = get_peft_model_state_dict(m)
    offset = 0
    new = {}
    for k in sorted(sd):
        n = sd[k].numel()
        vals = splitmix_uniform(spec["seed"] + offset, n) * spec["scale"]
        offset += n
        new[k] = torch.from_numpy(vals.reshape(tuple(sd[k].shape)))
    set_peft_model_state_dict(m, new)


def smollm2(check_export=None):
    base = load_smollm2()
    out = {"prompt_token_ids": PROMPT, "targets": TARGETS, "variants": {}}
    lp = log_probs(base, PROMPT)[-1]
    top = torch.topk(lp, 20)
    out["base_top"] = [[int(i), float(v)] for v, i in zip(top.values, top.indices)]
    for name, spec in SMOL_VARIANTS.items():
        kw = dict(r=spec["r"], lora_alpha=spec["lora_alpha"]) if spec["peft_type"] == "LORA" \
            else dict(oft_block_size=spec["oft_block_size"])
        m = peft_model(base, name, TARGETS, **kw)
        fill_seeded(m, spec)
        lp = log_probs(m, PROMPT)[-1]
        top = torch.topk(lp, 20)
        out["variants"][name] = {**spec, "top": [[int(i), float(v)] for v, i in zip(top.values, top.indices)]}
        m.save_pretrained(f"/tmp/peft_smollm2_{name}")
        print(name, out["variants"][name]["top"][:3])
    path = ROOT / "tests" / "fixtures" / "peft_smollm2.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path} (PEFT's own folders in /tmp/peft_smollm2_*)")
    if check_export:
        check(base, pathlib.Path(check_export))


GRAD_SAMPLE = {"prompt_token_ids": PROMPT, "completion_token_ids": [504, 3575, 282, 4649, 314, 7042, 47]}


def smollm2_grads():
    """dJ/dθ of J = Σ completion log-probs (temperature 1) for each seeded adapter, as a digest:
    per tensor its norm, 4 seeded projections and its first 8 values (tests/python/peft_adapters.py
    computes the same digest of `flywheel grad`'s output)."""
    from peft_adapters import digest

    base = load_smollm2()
    tokens = GRAD_SAMPLE["prompt_token_ids"] + GRAD_SAMPLE["completion_token_ids"]
    p = len(GRAD_SAMPLE["prompt_token_ids"])
    out = {"sample": GRAD_SAMPLE, "variants": {}}
    for name, spec in SMOL_VARIANTS.items():
        kw = dict(r=spec["r"], lora_alpha=spec["lora_alpha"]) if spec["peft_type"] == "LORA" \
            else dict(oft_block_size=spec["oft_block_size"])
        m = peft_model(base, name, TARGETS, **kw)
        fill_seeded(m, spec)
        m.train()
        logits = m(torch.tensor([tokens])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        j = sum(lp[t - 1, tokens[t]] for t in range(p, len(tokens)))
        j.backward()
        grads = {}
        for n, prm in m.named_parameters():
            if prm.grad is not None:
                grads[n.replace(".default", "")] = prm.grad.detach().numpy().astype(np.float32)
        out["variants"][name] = {**spec, "objective": float(j), "tensors": digest(grads)}
        print(name, "J =", float(j), len(grads), "tensors")
    path = ROOT / "tests" / "fixtures" / "peft_smollm2_grads.json"
    path.write_text(json.dumps(out))
    print(f"wrote {path}")


def check(base, d):
    """Load a Flywheel export into PEFT; compare with Flywheel's log-probs in d/flywheel.json."""
    from peft import PeftModel

    m = PeftModel.from_pretrained(copy.deepcopy(base), str(d)).eval()
    fw = json.loads((d / "flywheel.json").read_text())
    lp = log_probs(m, fw["prompt_token_ids"])[-1]
    worst = max(abs(float(lp[t["token_id"]]) - t["logprob"]) for t in fw["logprobs"][0]["top_logprobs"])
    print(f"{d}: PEFT loaded it; largest |Δ log-prob| over Flywheel's top tokens: {worst:.2e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=["tiny", "smollm2", "grads", "check"])
    ap.add_argument("--check-export")
    a = ap.parse_args()
    if a.which == "tiny":
        tiny()
    elif a.which == "smollm2":
        smollm2(a.check_export)
    elif a.which == "grads":
        smollm2_grads()
    else:
        check(load_smollm2(), pathlib.Path(a.check_export))
    sys.exit(0)
