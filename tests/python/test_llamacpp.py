"""Flywheel against llama.cpp (llama-cpp-python) on the default model.

- Tokenizer: ids equal to llama.cpp's on a corpus of awkward texts.
- Forward: the next-token distribution of Flywheel's fast kernels is at least as close to exact
  f32 math (Flywheel's scalar reference kernels: dequantized weights, f32 activations, f64 sums)
  as llama.cpp's is, measured as mean |Δ log-prob| over the exact top-20 tokens; and llama.cpp
  itself is close to exact math, so both run the same model.

Run: python3 -m pytest tests/python (needs target/release/flywheel and the default model).
"""
import json
import os
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
BIN = os.environ.get("FLYWHEEL_BIN", os.path.join(ROOT, "target", "release", "flywheel"))

CORPUS = [
    "Hello world",
    "What is the capital of France?",
    "  leading spaces and trailing   ",
    "digits 0123456789 and 3.14159, 1,000,000 and 2024-11-22",
    "Unicode: naïve café, Grüße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji 🙂👍🏽🚀 and ZWJ 👨‍👩‍👧‍👦 family",
    "runs of spaces     and\ttabs\t\tand newlines\n\n\nend",
    "windows\r\nline\r\nendings\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "control tokens inline: <|endoftext|> and <|im_end|>text",
    "code: fn main() { println!(\"{}\", x >> 2 != y); } // comment",
    "contractions: I'm, you're, it's, we'll, they've, I'd, don't",
    "MiXeD CaSe and ALLCAPS and snake_case and kebab-case",
    "",
    " ",
    "\n",
    "a" * 300,
    "punctuation!!! ??? ... --- ((())) [[]] {{}} @#$%^&*",
]

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Why is the sky blue? Explain briefly."}],
]


def flywheel(*args, stdin=None):
    out = subprocess.run([BIN, *args], input=stdin, capture_output=True, text=True, check=True)
    return out.stdout


@pytest.fixture(scope="module")
def llama_vocab():
    from llama_cpp import Llama
    return Llama(model_path=MODEL, vocab_only=True, verbose=False)


@pytest.mark.parametrize("text", CORPUS)
def test_token_ids_equal_llama_cpp(llama_vocab, text):
    ours = json.loads(flywheel("tokenize", "--model", MODEL, "--json", stdin=text))["token_ids"]
    theirs = llama_vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert ours == list(theirs)


def test_ground_truth_ids():
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ours = json.loads(flywheel("tokenize", "--model", MODEL, "--json", stdin=text))["token_ids"]
    assert ours == [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def has_precision(precision):
    """Whether this CPU runs the products of `precision` (bf16: AVX512_BF16, int8: AVX512_VNNI)."""
    r = subprocess.run([BIN, "generate", "--model", MODEL, "--prompt", "a", "--max-tokens", "1",
                        "--precision", precision], capture_output=True, text=True, timeout=120)
    return r.returncode == 0


def next_token(messages, reference, precision="exact"):
    args = ["generate", "--model", MODEL, "--messages", json.dumps(messages), "--max-tokens", "1",
            "--temperature", "0", "--top-logprobs", "200", "--json", "--precision", precision]
    if reference:
        args.append("--reference-kernels")
    v = json.loads(flywheel(*args))
    top = {e["token_id"]: e["logprob"] for e in v["logprobs"][0]["top_logprobs"]}
    return v["prompt_token_ids"], top


def closeness(low=None):
    """Per prompt: (text, |Δ| of the fast kernels, of llama.cpp, exact argmax, llama.cpp's argmax,
    |Δ| of the `low` precision's products or None), |Δ| the mean over the exact top-20 of
    |log-prob − exact|."""
    from llama_cpp import Llama
    llm = Llama(model_path=MODEL, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    rows = []
    for messages in PROMPTS:
        ids, exact = next_token(messages, reference=True)
        _, fast = next_token(messages, reference=False)
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[len(ids) - 1], dtype=np.float64)
        m = logits.max()
        lp = logits - (m + np.log(np.exp(logits - m).sum()))
        top20 = sorted(exact, key=lambda t: -exact[t])[:20]
        ours = np.mean([abs(fast[t] - exact[t]) for t in top20])
        theirs = np.mean([abs(lp[t] - exact[t]) for t in top20])
        moved = None
        if low:
            _, b = next_token(messages, reference=False, precision=low)
            moved = np.mean([abs(b[t] - exact[t]) for t in top20])
        rows.append((messages[-1]["content"], ours, theirs, top20[0], int(np.argmax(lp)), moved))
    return rows


def test_fast_kernels_at_least_as_close_to_exact_math_as_llama_cpp():
    rows = closeness()
    for content, ours, theirs, _, _, _ in rows:
        print(f"{content[:40]:<42} flywheel {ours:.5f}  llama.cpp {theirs:.5f}")
    mean_ours = np.mean([r[1] for r in rows])
    mean_theirs = np.mean([r[2] for r in rows])
    print(f"mean |Δ log-prob| over the exact top-20: flywheel {mean_ours:.5f}, llama.cpp {mean_theirs:.5f}")
    # llama.cpp runs the same model: its distribution is close to exact math (it quantizes activations).
    assert mean_theirs < 0.2
    assert mean_ours <= mean_theirs


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_low_precision_products_closer_to_exact_math_than_llama_cpp(precision):
    """The fast paths (`--precision bf16`: BF16 operands; `int8`: 8-bit activations, as llama.cpp
    has) move the next-token distribution less than llama.cpp does."""
    if not has_precision(precision):
        pytest.skip(f"this CPU lacks what {precision} products need: the path is not measured")
    rows = closeness(low=precision)
    for content, _, theirs, _, _, low in rows:
        print(f"{content[:40]:<42} flywheel {precision} {low:.5f}  llama.cpp {theirs:.5f}")
    mean_low = np.mean([r[5] for r in rows])
    mean_theirs = np.mean([r[2] for r in rows])
    print(f"mean |Δ log-prob| over the exact top-20: flywheel {precision} {mean_low:.5f}, llama.cpp {mean_theirs:.5f}")
    assert 0 < mean_low < mean_theirs


def test_chat_answer_is_sensible():
    out = flywheel("generate", "--model", MODEL, "--chat", "What is the capital of France?", "--max-tokens", "30")
    assert "Paris" in out


if __name__ == "__main__":
    for content, ours, theirs, a, b, low in closeness(low="int8" if has_precision("int8") else None):
        print(f"{content[:40]:<42} flywheel {ours:.5f}  int8 {low}  llama.cpp {theirs:.5f}  argmax exact {a} llama.cpp {b}")


def test_embeddings_equal_llama_cpp_mean_pooling():
    """/v1/embeddings against llama.cpp's mean-pooled, normalised embeddings of the same texts
    (the final norm's output averaged over the tokens): the same vectors up to llama.cpp's
    quantized activations (cosine ≥ 0.999)."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from flywheel_server import http, start_server
    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama
    texts = ["Hello world", "What is the capital of France?", "emoji 🙂 and café"]
    llm = Llama(model_path=MODEL, n_ctx=512, n_threads=2, embedding=True,
                pooling_type=LLAMA_POOLING_TYPE_MEAN, verbose=False)
    theirs = [np.array(v) for v in llm.embed(texts, normalize=True)]
    proc, base = start_server([])
    try:
        status, _, data = http("POST", base + "/v1/embeddings",
                               {"model": os.path.basename(MODEL)[:-5], "input": texts}, key=None)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert status == 200, data
    ours = [np.array(d["embedding"]) for d in json.loads(data)["data"]]
    for t, a, b in zip(texts, ours, theirs):
        cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        print(f"{t!r}: cosine {cos:.6f}")
        assert abs(np.linalg.norm(a) - 1) < 1e-5 and cos > 0.999, (t, cos)
    # Different texts are told apart more than the two implementations differ.
    assert float(ours[0] @ ours[1]) < 0.999
