"""Schemathesis hooks for the fuzz run (tests/python/test_fuzz.py): generation stays short (a
capped `max_tokens` and `n`, the served model, no streams: schemathesis checks whole SSE events against the chunk
schema, a false positive (its check ST108), so streams are validated by the contract test in
test_server.py instead)."""

import os

import schemathesis

CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict):
        # The served model, so that requests reach generation (unknown models are tested apart).
        if isinstance(body.get("model"), str) and os.environ.get("FLYWHEEL_FUZZ_MODEL"):
            body["model"] = os.environ["FLYWHEEL_FUZZ_MODEL"]
        for k, cap in CAPS.items():
            v = body.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > cap:
                body[k] = cap
        # Absent, a completion may run to the end of the context (8192 tokens): cap it too.
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
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
