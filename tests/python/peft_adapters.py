"""Rebuild, without torch, the seeded PEFT adapters of tests/fixtures/peft_smollm2.json: the same
SplitMix64 stream as scripts/peft_fixture.py, over PEFT's state-dict keys in sorted order, written
as PEFT writes them (adapter_config.json + f32 adapter_model.safetensors)."""

import json
import pathlib
import struct

import numpy as np

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# SmolLM2-135M: hidden 576, FFN 1536, 9 heads and 3 KV heads of 64, 30 layers.
DIMS = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
        "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
LAYERS = 30


def splitmix_uniform(seed, n):
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float64) / float(1 << 24) * 2.0 - 1.0).astype(np.float32)


def module_path(t):
    return ("self_attn." if t[0] in "qkvo" else "mlp.") + t


def shapes(spec):
    out = {}
    for l in range(LAYERS):
        for t in TARGETS:
            i, o = DIMS[t]
            p = f"base_model.model.model.layers.{l}.{module_path(t)}"
            if spec["peft_type"] == "LORA":
                out[p + ".lora_A.weight"] = (spec["r"], i)
                out[p + ".lora_B.weight"] = (o, spec["r"])
            else:
                b = spec["oft_block_size"]
                out[p + ".oft_R.weight"] = (i // b, b * (b - 1) // 2)
    return out


def tensors(spec):
    offset, out = 0, {}
    for k, shape in sorted(shapes(spec).items()):
        n = shape[0] * shape[1]
        out[k] = (splitmix_uniform(spec["seed"] + offset, n) * np.float32(spec["scale"])).reshape(shape)
        offset += n
    return out


def write_safetensors(path, ts):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for k in sorted(ts):
        b = np.ascontiguousarray(ts[k], dtype="<f4").tobytes()
        header[k] = {"dtype": "F32", "shape": list(ts[k].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_safetensors(path):
    data = pathlib.Path(path).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        assert v["dtype"] == "F32", v
        out[k] = np.frombuffer(data[8 + n + a:8 + n + b], dtype="<f4").reshape(v["shape"])
    return out


def write_adapter(d, spec):
    d = pathlib.Path(d)
    d.mkdir(parents=True, exist_ok=True)
    if spec["peft_type"] == "LORA":
        cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec["r"], "lora_alpha": spec["lora_alpha"],
               "lora_dropout": 0.0, "use_rslora": False, "bias": "none", "target_modules": TARGETS}
    else:
        cfg = {"peft_type": "OFT", "task_type": "CAUSAL_LM", "r": 0, "oft_block_size": spec["oft_block_size"],
               "use_cayley_neumann": True, "num_cayley_neumann_terms": 5, "coft": False, "eps": 6e-05,
               "block_share": False, "module_dropout": 0.0, "bias": "none", "target_modules": TARGETS}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    write_safetensors(d / "adapter_model.safetensors", tensors(spec))
    return d


def digest(tensors):
    """Per tensor (sorted names): its norm, 4 projections on SplitMix64 vectors (seeded by the
    tensor's index) and its first 8 values, all from f64 sums."""
    out = {}
    for idx, k in enumerate(sorted(tensors)):
        g = np.asarray(tensors[k], dtype=np.float64).ravel()
        proj = [float(np.dot(g, splitmix_uniform(7919 * idx + s, g.size).astype(np.float64))) for s in range(4)]
        out[k] = {"norm": float(np.linalg.norm(g)), "proj": proj, "head": [float(x) for x in g[:8]], "size": int(g.size)}
    return out
