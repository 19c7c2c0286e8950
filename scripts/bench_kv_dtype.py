"""The KV cache's storage, f32 against f16, through the server on the default model: one 4001-token
prompt (prefix caching off), its prefill time and its decode time per token (129 tokens minus the
first), each dtype in its own server, alternating over 3 rounds, medians and the f16/f32 ratio.

    python3 scripts/bench_kv_dtype.py      # needs target/release/flywheel and the default model
"""
import json, subprocess, sys, time, urllib.request, statistics, tempfile, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from flywheel_server import start_server
cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
cfg.write("[engine]\nenable_prefix_caching = false\n"); cfg.close()
prompt = ("The quick brown fox jumps over the lazy dog. " * 400)
def one(base):
    body = json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    body2 = json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": 129,
                        "temperature": 0, "ignore_eos": True}).encode()
    def t(b):
        req = urllib.request.Request(base + "/v1/completions", data=b, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter(); r = json.load(urllib.request.urlopen(req)); return time.perf_counter() - t0, r
    a, r = t(body); b, r2 = t(body2)
    return r["usage"]["prompt_tokens"], a, (b - a) / 128
res = {"f32": [], "f16": []}
for rnd in range(3):
    for d in ["f32", "f16"]:
        proc, base = start_server(["--config", cfg.name, "--kv-cache-dtype", d])
        try:
            one(base)  # warm
            n, pre, dec = one(base)
            res[d].append((pre, dec))
        finally:
            proc.terminate(); proc.wait()
for d, v in res.items():
    print(d, "prompt", n, "tokens: prefill s median", round(statistics.median(x[0] for x in v), 3),
          "decode ms/token median", round(1000 * statistics.median(x[1] for x in v), 2))
p32 = statistics.median(x[1] for x in res["f32"]); p16 = statistics.median(x[1] for x in res["f16"])
print("decode f16/f32 time ratio", round(p16 / p32, 3))
