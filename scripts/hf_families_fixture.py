"""Transformers and PEFT reference fixtures for every model family, so that CI checks Flywheel's
forward, adapters and gradients on each family against transformers/PEFT without torch.

Needs torch, transformers, peft (PyPI) and llama.cpp's own converter (convert_hf_to_gguf.py and
gguf-py, shipped in the llama-cpp-python sdist: LLAMA_CPP=<its vendor/llama.cpp>):
    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch transformers peft numpy
    LLAMA_CPP=/path/to/vendor/llama.cpp /tmp/hfenv/bin/python scripts/hf_families_fixture.py

For each family (qwen2, qwen3, qwen3moe, llama3, gemma3, and gemma2 with its attention and final
logit soft-caps set low enough to bite: without the attention cap transformers' log-probs move by
2.5, without the final one by 6.9) it builds a tiny random model with
transformers (config from scratch, weights rounded to f16 so the f16 GGUF is exact), converts it
with llama.cpp's converter (its tensor names, Q/K permutation, Gemma's 1 + w norms, stacked
experts), and writes to tests/fixtures/hf/<family>/:
  model.gguf            the converted model
  expected.json         the token sequence, transformers' log-softmax at every position (f64),
                        and each adapter's log-probs of the completion tokens
  lora/, oft/           PEFT adapters (random values) saved by PEFT's save_pretrained
  grads_<name>.safetensors   dJ/dθ (J = Σ completion log-probs) by autograd, PEFT's tensor names
tests/hf_families.rs reads them. With `--bench FAMILY OUT.gguf` it writes one bigger model of the
family (Q8_0) to time instead.
"""

import json
import os
import pathlib
import shutil
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAMA_CPP = pathlib.Path(os.environ.get("LLAMA_CPP", ""))
if not (LLAMA_CPP / "convert_hf_to_gguf.py").exists():
    sys.exit("set LLAMA_CPP to llama.cpp's source folder (vendor/llama.cpp of the llama-cpp-python sdist)")
sys.path.insert(0, str(LLAMA_CPP / "gguf-py"))
sys.path.insert(0, str(LLAMA_CPP))

# The tokenizer's size (256 bytes, 4 merges, 3 control tokens): Gemma's converter keeps only the
# tokenizer's rows of the embedding, so the model has no rows beyond it.
VOCAB = 263
TOKENS = [5, 17, 33, 2, 250, 41, 41, 7, 258, 12, 0, 88, 150, 151, 9, 77, 200, 3, 64, 128]
PROMPT_LEN = 8
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]


def write_tokenizer(d):
    """A byte-level BPE tokenizer (256 bytes, three control tokens, a few merges) that
    transformers loads and llama.cpp's converter reads (as a GPT-2-style vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    merges = [("h", "e"), ("l", "l"), ("Ġ", "t"), ("he", "ll")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token=None)
    fast.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    fast.save_pretrained(d)


def init_weights(model, gemma):
    torch.manual_seed(1234)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                # Gemma's norms multiply by 1 + w (the converter writes 1 + w).
                centre = 0.0 if gemma else 1.0
                p.copy_(centre + 0.4 * (torch.rand_like(p) - 0.5))
            elif n.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "mlp.gate.weight" in n:
                p.normal_(0.0, 1.0)  # the router: distinct expert choices
            else:
                p.normal_(0.0, 0.25)
            p.copy_(p.half().float())  # exact in the f16 GGUF


def build(family, bench=False):
    """A tiny model of `family`; with `bench`, one big enough to time (hidden 512, 8 layers, the
    MoE with 32 experts of width 256, 4 per token; the dense MLPs 1536 wide)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  max_position_embeddings=64, rms_norm_eps=1e-6)
    if bench:
        common.update(hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                      max_position_embeddings=2048)
    layers = 8 if bench else 2
    if family == "qwen2":
        cfg = tf.Qwen2Config(num_hidden_layers=layers, num_key_value_heads=2, rope_theta=1e6,
                             tie_word_embeddings=False, **common)
        return tf.Qwen2ForCausalLM(cfg), ALL
    if family == "qwen3":
        cfg = tf.Qwen3Config(num_hidden_layers=layers, num_key_value_heads=2, head_dim=32 + 32 * bench,
                             rope_theta=1e6, tie_word_embeddings=True, **common)
        return tf.Qwen3ForCausalLM(cfg), ALL
    if family == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(num_hidden_layers=layers, num_key_value_heads=2,
                                head_dim=32 + 32 * bench, rope_theta=1e6,
                                num_experts=32 if bench else 8,
                                num_experts_per_tok=4 if bench else 2,
                                moe_intermediate_size=256 if bench else 32, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[],
                                tie_word_embeddings=False, **common)
        cfg._experts_implementation = "eager"  # a loop over experts (any dtype, f64 included)
        return tf.Qwen3MoeForCausalLM(cfg), ATTN
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}
        cfg = tf.LlamaConfig(num_hidden_layers=layers, num_key_value_heads=1 + bench,
                             rope_parameters=rope,
                             tie_word_embeddings=True, **common)
        return tf.LlamaForCausalLM(cfg), ALL
    if family == "gemma2":
        hd = 64 if bench else 32
        # Soft caps low enough that they change these random weights' scores and logits.
        cfg = tf.Gemma2Config(num_hidden_layers=8 if bench else 4, num_key_value_heads=1,
                              head_dim=hd, sliding_window=512 if bench else 5,
                              query_pre_attn_scalar=hd, attn_logit_softcapping=4.0,
                              final_logit_softcapping=5.0, tie_word_embeddings=True, **common)
        cfg._attn_implementation = "eager"
        return tf.Gemma2ForCausalLM(cfg), ALL
    if family == "gemma3":
        hd = 64 if bench else 32
        cfg = tf.Gemma3TextConfig(num_hidden_layers=12 if bench else 6, num_key_value_heads=1,
                                  head_dim=hd, sliding_window=512 if bench else 5,
                                  query_pre_attn_scalar=hd,
                                  final_logit_softcapping=None, attn_logit_softcapping=None,
                                  tie_word_embeddings=True, **common)
        cfg._attn_implementation = "eager"
        return tf.Gemma3ForCausalLM(cfg), ALL
    raise SystemExit(family)


def convert(model_dir, out, ftype=None):
    """llama.cpp's converter on the HF folder, f16; the vocab read as a GPT-2-style BPE (the
    converter's check of the pre-tokenizer's hash is for real vocabularies)."""
    import gguf
    from conversion import base
    from conversion import get_model_class  # noqa: F401  (registers the families)
    import convert_hf_to_gguf as conv

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    hparams = base.ModelBase.load_hparams(model_dir, False)
    arch = conv.get_model_architecture(hparams, base.ModelType.TEXT)
    cls = conv.get_model_class(arch, mmproj=False)
    cls.set_vocab = lambda self: self._set_vocab_gpt2()
    with torch.inference_mode():
        m = cls(model_dir, ftype or gguf.LlamaFileType.MOSTLY_F16, out)
        m.write()


def log_probs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def peft_variant(base, kind, targets):
    import copy
    from peft import LoraConfig, OFTConfig, get_peft_model

    if kind == "lora":
        cfg = LoraConfig(target_modules=targets, r=4, lora_alpha=8, lora_dropout=0.0,
                         task_type="CAUSAL_LM")
    else:
        cfg = OFTConfig(target_modules=targets, r=0, oft_block_size=16, task_type="CAUSAL_LM")
    m = get_peft_model(copy.deepcopy(base), cfg)
    torch.manual_seed(7 if kind == "lora" else 8)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n or "oft_R" in n:
                p.normal_(0.0, 0.1)
    return m


def completion_logps_and_grads(m):
    """Log-probs of the completion tokens and dJ/dθ (J = their sum), in f64."""
    m = m.double()
    m.train(False)
    for n, p in m.named_parameters():
        p.requires_grad_("lora_" in n or "oft_R" in n)
    logits = m(torch.tensor([TOKENS])).logits[0]
    lp = torch.log_softmax(logits, dim=-1)
    picked = torch.stack([lp[i - 1, TOKENS[i]] for i in range(PROMPT_LEN, len(TOKENS))])
    picked.sum().backward()
    grads = {}
    for n, p in m.named_parameters():
        if p.requires_grad:
            # PEFT's saved names: no adapter name.
            grads[n.replace(".default", "")] = p.grad.detach().float().contiguous()
    return picked.detach().tolist(), grads


def bench_model(family, out):
    """`--bench FAMILY OUT.gguf`: a model of `family` big enough to time, Q8_0 (scripts/
    bench_vs_llamacpp.py --model OUT.gguf times it against llama.cpp)."""
    import gguf

    model, _ = build(family, bench=True)
    model = model.float().eval()
    init_weights(model, family.startswith("gemma"))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        write_tokenizer(d)
        convert(pathlib.Path(d), pathlib.Path(out), gguf.LlamaFileType.MOSTLY_Q8_0)
    print(f"wrote {out}")


def main():
    from safetensors.torch import save_file

    if sys.argv[1:2] == ["--bench"]:
        bench_model(sys.argv[2], sys.argv[3])
        return
    families = sys.argv[1:] or ["qwen2", "qwen3", "qwen3moe", "llama3", "gemma3", "gemma2"]
    for family in families:
        out = ROOT / "tests" / "fixtures" / "hf" / family
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        model, targets = build(family)
        model = model.float().eval()
        init_weights(model, family.startswith("gemma"))
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            write_tokenizer(d)
            convert(pathlib.Path(d), out / "model.gguf")
        expected = {"family": family, "tokens": TOKENS, "prompt_len": PROMPT_LEN,
                    "base": log_probs(model.double(), TOKENS).tolist(), "adapters": {}}
        model = model.float()
        for kind in ["lora", "oft"]:
            m = peft_variant(model, kind, targets)
            m.save_pretrained(str(out / kind))
            (out / kind / "README.md").unlink(missing_ok=True)
            lps, grads = completion_logps_and_grads(m)
            expected["adapters"][kind] = lps
            save_file(grads, str(out / f"grads_{kind}.safetensors"))
        (out / "expected.json").write_text(json.dumps(expected))
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{family}: wrote {out} ({size} bytes)")


if __name__ == "__main__":
    main()
