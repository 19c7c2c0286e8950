"""Schemathesis hooks for the fuzz run (tests/python/test_fuzz.py): generation stays short (a
capped `max_tokens` and `n`, the served model, no streams: schemathesis checks whole SSE events against the chunk
schema, a false positive (its check ST108), so streams are validated by the contract test in
test_server.py instead). One generation request in three carries a grammar nested at random, up
to past the server's bounds (a $ref chain, a Lark rule or terminal chain, nested brackets, a
nested regex): each must be answered, never crash the server. Protobuf bodies are random bytes."""

import hashlib
import json
import os

import schemathesis

CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2}


CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar")


def nested_grammar(seed):
    """A constraint nested `depth` deep, of one of five kinds (from `seed`)."""
    depth = 1 + (seed >> 3) % 600
    kind = seed % 5
    if kind == 0:
        defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                for i in range(depth)}
        defs[f"d{depth}"] = {"type": "integer"}
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$defs": defs, "$ref": "#/$defs/d0"}}}}
    if kind in (1, 2):
        name = (lambda i: f"T{i}") if kind == 2 else (lambda i: f"r{i}")
        rules = "".join(f'{name(i)}: "a" {name(i + 1)}\n' for i in range(depth))
        return {"guided_grammar": f"start: {name(0)}\n{rules}{name(depth)}: \"b\"\n"}
    if kind == 3:
        return {"guided_grammar": "start: " + "(" * depth + '"z"' + ")" * depth + "\n"}
    return {"guided_regex": "(" * depth + "[a-c]" + ")" * depth}


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict) and ("messages" in body or "prompt" in body):
        seed = int.from_bytes(hashlib.sha256(
            json.dumps(body, sort_keys=True, default=str).encode()).digest()[:8], "little")
        if seed % 3 == 0:
            for k in CONSTRAINTS:
                body.pop(k, None)
            body.update(nested_grammar(seed // 3))
    if isinstance(body, dict):
        # The served model, so that requests reach generation (unknown models are tested apart).
        if isinstance(body.get("model"), str) and os.environ.get("FLYWHEEL_FUZZ_MODEL"):
            body["model"] = os.environ["FLYWHEEL_FUZZ_MODEL"]
        for k, cap in CAPS.items():
            v = body.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > cap:
                body[k] = cap
        # Absent, a completion may run to the end of the context (8192 tokens): cap it too.
        if "input" in body:
            if body.get("max_output_tokens") is None:
                body["max_output_tokens"] = CAPS["max_output_tokens"]
        elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = CAPS["max_tokens"]
        # The token-in route (/inference/v1/generate) takes them in `sampling_params`.
        if "token_ids" in body:
            sp = body.get("sampling_params")
            if not isinstance(sp, dict):
                sp = body["sampling_params"] = {}
            for k in ("max_tokens", "n"):
                v = sp.get(k)
                if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                 and v > CAPS[k]):
                    sp[k] = CAPS[k]
        if body.get("stream") is not None:
            body["stream"] = False
    return body


# The Tinker API's protobuf bodies (`forward_backward`): arbitrary bytes, which the server must
# answer with a 4xx (not a ForwardBackwardRequest, or one that names a bad field), never a 5xx.
from hypothesis import strategies as st  # noqa: E402

schemathesis.openapi.media_type("application/x-protobuf", st.binary(max_size=512))


@schemathesis.deserializer("application/x-protobuf")
def protobuf_as_hex(ctx, response):
    """A protobuf result (`ForwardBackwardOutput`, `SampleResponse`) is checked as the binary
    string the contract documents."""
    return response.content.hex()
