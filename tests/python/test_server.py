"""The server against its contracts, on the default model:

- every response, streaming chunk and error body validates against openapi/openapi.yaml (our
  contract) and, for OpenAI's endpoints, against OpenAI's own schemas
  (../shared/openai/openai-chat-subset.json, copied to tests/python/openai-chat-subset.json);
- every path and status the contract documents is exercised here, so the two cannot drift;
- the official `openai` SDK works against it: chat, streaming, n=4, logprobs.

Run with `python3 -m pytest -q tests/python` after `cargo build --release`.
"""

import copy
import json
import pathlib
import struct
import subprocess
import sys
import time

import jsonschema
import pytest
import referencing
import yaml
from referencing.jsonschema import DRAFT202012

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import KEY, ROOT, http, start_server  # noqa: E402

OFFICIAL = pathlib.Path(__file__).with_name("openai-chat-subset.json")
OURS = ROOT / "openapi" / "openapi.yaml"


LEARN = "contract-learn"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    proc, base = start_server(["--api-key", KEY, "--learn", LEARN, "--data-dir", str(data)])
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---------------------------------------------------------------- schema plumbing


def allow_nullable(node):
    """OpenAPI 3.0's `nullable: true` (still used in places of OpenAI's 3.1 file) as JSON Schema."""
    if isinstance(node, dict):
        node = {k: allow_nullable(v) for k, v in node.items()}
        if node.pop("nullable", False):
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [allow_nullable(v) for v in node]
    return node


def validator_for(doc, uri):
    resource = referencing.Resource.from_contents(doc, default_specification=DRAFT202012)
    registry = referencing.Registry().with_resource(uri, resource)

    def validate(instance, pointer):
        schema = {"$ref": f"{uri}#{pointer}"}
        jsonschema.Draft202012Validator(schema, registry=registry).validate(instance)

    return validate


OURS_DOC = yaml.safe_load(OURS.read_text())
OFFICIAL_DOC = allow_nullable(json.loads(OFFICIAL.read_text()))
validate_ours = validator_for(OURS_DOC, "urn:flywheel")
validate_official = validator_for(OFFICIAL_DOC, "urn:openai")

# Official schema of each OpenAI endpoint's 200 body and stream chunk.
OFFICIAL_200 = {
    "/v1/chat/completions": "/components/schemas/CreateChatCompletionResponse",
    "/v1/completions": "/components/schemas/CreateCompletionResponse",
    "/v1/models": "/components/schemas/ListModelsResponse",
}
OFFICIAL_CHUNK = {
    "/v1/chat/completions": "/components/schemas/CreateChatCompletionStreamResponse",
    "/v1/completions": "/components/schemas/CreateCompletionResponse",
}

exercised = set()


def our_pointer(path, method, status, content_type):
    op = OURS_DOC["paths"][path][method.lower()]
    resp = op["responses"][str(status)]
    if "$ref" in resp:
        name = resp["$ref"].split("/")[-1]
        resp = OURS_DOC["components"]["responses"][name]
        base = f"/components/responses/{name}"
    else:
        base = f"/paths/{path.replace('/', '~1')}/{method.lower()}/responses/{status}"
    assert content_type in resp["content"], f"{path} {status} does not document {content_type}"
    return f"{base}/content/{content_type.replace('/', '~1')}/schema"


def completion_official(doc):
    """OpenAI's published schema types an echoed prompt's log-probs as numbers, but its API (and
    vLLM) send null for the first prompt token; and it has no completions stream chunk, whose
    finish_reason is null until the end (as the real API sends it): validate with those nulls
    filled in."""
    c = copy.deepcopy(doc)
    for ch in c["choices"]:
        if ch["finish_reason"] is None:
            ch["finish_reason"] = "stop"
        lp = ch.get("logprobs")
        if lp:
            lp["token_logprobs"] = [0.0 if v is None else v for v in lp.get("token_logprobs", [])]
            lp["top_logprobs"] = [{} if v is None else v for v in lp.get("top_logprobs", [])]
    return c


def check(method, path, body=None, key=KEY, raw=None, expect=200, route=None,
          content_type="application/json"):
    """Call the server, check the status, validate the body (and each stream chunk). `route` is
    the documented path template when `path` fills one in (/v1/adapters/{name})."""
    status, headers, data = http(method, SERVER + path, body, key=key, raw=raw,
                                 content_type=content_type)
    assert status == expect, (status, data[:500])
    path = route or path
    exercised.add((path, str(status)))
    ctype = headers.get("content-type", headers.get("Content-Type", "")).split(";")[0]
    if ctype == "text/event-stream":
        events = [e[len("data: "):] for e in data.decode().split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        for c in chunks:
            if "error" in c:
                validate_ours(c, "/components/schemas/ErrorResponse")
                continue
            validate_ours(c, our_pointer(path, method, status, ctype))
            inst = completion_official(c) if path == "/v1/completions" else c
            validate_official(inst, OFFICIAL_CHUNK[path])
        return status, headers, chunks
    if ctype in ("text/plain", "text/html"):
        assert our_pointer(path, method, status, ctype)
        return status, headers, data.decode()
    if ctype == "application/x-protobuf":
        assert our_pointer(path, method, status, ctype)
        return status, headers, data
    doc = json.loads(data)
    validate_ours(doc, our_pointer(path, method, status, ctype))
    if status >= 400:
        validate_official(doc, "/components/schemas/ErrorResponse")
    elif path in OFFICIAL_200:
        inst = completion_official(doc) if path == "/v1/completions" else doc
        validate_official(inst, OFFICIAL_200[path])
    return status, headers, doc


SERVER = None


@pytest.fixture(autouse=True)
def _base(server):
    global SERVER
    SERVER = server


def model_id():
    return check("GET", "/v1/models")[2]["data"][0]["id"]


# ---------------------------------------------------------------- contract tests


def test_chat_responses_and_chunks_follow_both_schemas():
    m = model_id()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    _, _, r = check("POST", "/v1/chat/completions", {
        "model": m, "messages": msgs, "max_tokens": 8, "logprobs": True, "top_logprobs": 3,
        "n": 2, "seed": 1, "return_token_ids": True, "stop": ["\n\n"]})
    assert len(r["choices"]) == 2 and len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    _, _, chunks = check("POST", "/v1/chat/completions", {
        "model": m, "messages": msgs, "max_tokens": 8, "stream": True, "logprobs": True,
        "top_logprobs": 2, "stream_options": {"include_usage": True}, "n": 2,
        "return_token_ids": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    finished = {c["choices"][0]["index"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finished == {0, 1}


def test_completion_responses_and_chunks_follow_both_schemas():
    m = model_id()
    _, _, r = check("POST", "/v1/completions", {
        "model": m, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
        "logprobs": 2, "echo": True})
    assert r["choices"][0]["text"].startswith("The capital of France is")
    _, _, r = check("POST", "/v1/completions", {
        "model": m, "prompt": [504, 3575, 282], "max_tokens": 4, "return_token_ids": True})
    assert r["prompt_token_ids"] == [504, 3575, 282]
    check("POST", "/v1/completions", {
        "model": m, "prompt": "Once upon a time", "max_tokens": 6, "stream": True, "logprobs": 1,
        "stream_options": {"include_usage": True}})
    # Prompt scoring: echo + logprobs with nothing generated, and vLLM's prompt_logprobs.
    _, _, r = check("POST", "/v1/completions", {
        "model": m, "prompt": "The capital of France is Paris", "max_tokens": 0, "echo": True,
        "logprobs": 1})
    lp = r["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == r["usage"]["prompt_tokens"]
    assert r["choices"][0]["prompt_logprobs"][0] is None
    _, _, r = check("POST", "/v1/chat/completions", {
        "model": m, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "prompt_logprobs": 2, "logit_bias": {"504": -100}})
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]


def test_small_endpoints_follow_the_contract():
    m = model_id()
    _, _, t = check("POST", "/tokenize", {"model": m, "prompt": "Hello world"})
    assert t["count"] == len(t["tokens"]) > 0
    _, _, t2 = check("POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert t2["count"] > t["count"]
    _, _, d = check("POST", "/detokenize", {"tokens": t["tokens"]})
    assert d["prompt"] == "Hello world"
    check("GET", "/health", key=None)
    _, _, text = check("GET", "/metrics", key=None)
    assert "flywheel_time_to_first_token_seconds_bucket" in text
    # A batch of prompts (lm-eval with --batch_size): one choice per prompt, in order.
    _, _, b = check("POST", "/v1/completions", {
        "model": m, "prompt": ["The capital of France is", [504, 3575]], "max_tokens": 2,
        "temperature": 0, "return_token_ids": True})
    assert [c["index"] for c in b["choices"]] == [0, 1]
    assert b["choices"][1]["prompt_token_ids"] == [504, 3575]
    _, _, card = check("GET", f"/v1/models/{m}", route="/v1/models/{id}")
    assert card["id"] == m and card["max_model_len"] > 0
    check("GET", "/v1/models/org/nope", route="/v1/models/{id}", expect=404)
    check("GET", f"/v1/models/{m}", route="/v1/models/{id}", key="wrong", expect=401)
    _, _, info = check("GET", "/tokenizer_info")
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    check("GET", "/tokenizer_info", key="wrong", expect=401)
    # The token-in route: the tokens of "Hello world" in, token ids and log-probs out.
    _, _, g = check("POST", "/inference/v1/generate", {
        "model": m, "token_ids": t["tokens"], "return_token_ids": True,
        "sampling_params": {"max_tokens": 3, "temperature": 0.7, "logprobs": 2, "seed": 1}})
    c = g["choices"][0]
    assert len(c["token_ids"]) == len(c["logprobs"]["content"]) == g["usage"]["completion_tokens"]
    assert g["prompt_token_ids"] == t["tokens"]
    for path, body, status in [
            ("/inference/v1/generate", {"model": m, "token_ids": []}, 400),
            ("/inference/v1/generate", {"model": m, "token_ids": [1],
                                        "sampling_params": {"best_of": 2}}, 400),
            ("/inference/v1/generate", {"model": "nope", "token_ids": [1]}, 404),
            ("/inference/v1/generate", {"model": m, "token_ids": [1]}, 401)]:
        check("POST", path, body, key="wrong" if status == 401 else KEY, expect=status)
    big = json.dumps({"model": m, "token_ids": [1] * (1 << 20)}).encode()
    check("POST", "/inference/v1/generate", raw=big, expect=413)
    check("POST", "/inference/v1/generate", raw=json.dumps({"model": m, "token_ids": [1]}).encode(),
          content_type="text/plain", expect=415)


def test_errors_follow_both_schemas():
    m = model_id()
    chat = {"model": m, "messages": [{"role": "user", "content": "x"}]}
    for bad in [{"temperature": -1}, {"top_p": 0}, {"n": 0}, {"max_tokens": 100000},
                {"messages": "nope"}, {"logprobs": True, "top_logprobs": 50}]:
        _, _, e = check("POST", "/v1/chat/completions", {**chat, **bad}, expect=400)
        assert e["error"]["param"] is not None
    check("POST", "/v1/chat/completions", raw=b"{", expect=400)
    check("POST", "/v1/completions", {"model": m, "prompt": [999999]}, expect=400)
    check("POST", "/tokenize", {"tokens": 3}, expect=400)
    check("POST", "/detokenize", {"tokens": "x"}, expect=400)
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"model": m, "prompt": "x"}),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
        check("POST", path, body, key="wrong", expect=401)
    check("GET", "/v1/models", key=None, expect=401)
    big = json.dumps({**chat, "messages": [{"role": "user", "content": "a" * (3 << 20)}]}).encode()
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"model": m, "prompt": "x"})]:
        check("POST", path, raw=big, expect=413)
        check("POST", path, raw=json.dumps(body).encode(), content_type="text/plain", expect=415)
    for path, body in [("/v1/chat/completions", {**chat, "model": "nope"}),
                       ("/v1/completions", {"model": "nope", "prompt": "x"}),
                       ("/tokenize", {"model": "nope", "prompt": "x"}),
                       ("/detokenize", {"model": "nope", "tokens": [1]})]:
        _, _, e = check("POST", path, body, expect=404)
        assert e["error"]["param"] == "model"


def test_responses_follow_the_contract():
    m = model_id()
    R = "/v1/responses/{id}"
    _, _, r = check("POST", "/v1/responses", {"model": m, "input": "Hi.", "max_output_tokens": 4})
    assert r["id"].startswith("resp_") and r["usage"]["output_tokens"] <= 4
    _, _, got = check("GET", f"/v1/responses/{r['id']}", route=R)
    assert got["output"] == r["output"]
    check("GET", f"/v1/responses/{r['id']}", route=R, key="wrong", expect=401)
    check("GET", "/v1/responses/resp_nope", route=R, expect=404)
    # Streamed: numbered events, the last one the whole response, valid as the 200 body.
    status, headers, data = http("POST", SERVER + "/v1/responses",
                                 {"model": m, "input": "Hi.", "max_output_tokens": 4,
                                  "stream": True})
    assert status == 200 and headers.get("content-type", "").startswith("text/event-stream")
    events = [json.loads(e.split("data: ", 1)[1]) for e in data.decode().split("\n\n") if "data: " in e]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    validate_ours(events[-1]["response"], our_pointer("/v1/responses", "POST", 200,
                                                      "application/json"))
    for bad in [{"input": []}, {"background": True}, {"tools": [{"type": "web_search"}]}]:
        _, _, e = check("POST", "/v1/responses", {"model": m, "input": "x", **bad}, expect=400)
        assert e["error"]["param"]
    check("POST", "/v1/responses", {"model": m, "input": "x"}, key="wrong", expect=401)
    _, _, e = check("POST", "/v1/responses", {"model": "nope", "input": "x"}, expect=404)
    assert e["error"]["param"] == "model"
    big = json.dumps({"model": m, "input": "a" * (3 << 20)}).encode()
    check("POST", "/v1/responses", raw=big, expect=413)
    check("POST", "/v1/responses", raw=json.dumps({"model": m, "input": "x"}).encode(),
          content_type="text/plain", expect=415)


def test_embeddings_follow_the_contract():
    m = model_id()
    _, _, e = check("POST", "/v1/embeddings", {"model": m, "input": ["Hello", "world"]})
    assert len(e["data"]) == 2 and e["usage"]["prompt_tokens"] >= 2
    _, _, b = check("POST", "/v1/embeddings", {"model": m, "input": "Hi", "encoding_format": "base64"})
    assert isinstance(b["data"][0]["embedding"], str)
    # The official SDK (it asks for base64 and decodes it).
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=SERVER + "/v1", api_key=KEY)
    r = client.embeddings.create(model=m, input=["Hello", "world"])
    assert [round(x, 5) for x in r.data[0].embedding] == [round(x, 5) for x in e["data"][0]["embedding"]]
    for bad in [{"input": []}, {"input": "x", "dimensions": 3}, {"input": "x", "encoding_format": "hex"}]:
        check("POST", "/v1/embeddings", {"model": m, **bad}, expect=400)
    check("POST", "/v1/embeddings", {"model": m, "input": "x"}, key="wrong", expect=401)
    check("POST", "/v1/embeddings", {"model": "nope", "input": "x"}, expect=404)
    check("POST", "/v1/embeddings", raw=json.dumps({"model": m, "input": "a" * (3 << 20)}).encode(),
          expect=413)
    check("POST", "/v1/embeddings", raw=json.dumps({"model": m, "input": "x"}).encode(),
          content_type="text/plain", expect=415)


def test_overload_and_starting_states_follow_the_contract(tmp_path):
    # A server with room for one pending request answers 429 to the rest of a burst.
    cfg = tmp_path / "serve.toml"
    cfg.write_text("[server]\nmax_pending_requests = 1\nretry_after_secs = 2\n")
    proc, base = start_server(["--config", str(cfg)])
    global SERVER
    saved, SERVER = SERVER, base
    try:
        import concurrent.futures as cf
        m = http("GET", base + "/v1/models", key=None)
        m = json.loads(m[2])["data"][0]["id"]
        body = {"model": m, "prompt": "Count:", "max_tokens": 64, "ignore_eos": True}
        with cf.ThreadPoolExecutor(8) as ex:
            results = list(ex.map(lambda _: http("POST", base + "/v1/completions", body, key=None),
                                  range(8)))
        # The token-in route shares the queue.
        gen = {"model": m, "token_ids": [1, 2, 3],
               "sampling_params": {"max_tokens": 64, "ignore_eos": True}}
        with cf.ThreadPoolExecutor(8) as ex:
            gen_results = list(ex.map(
                lambda _: http("POST", base + "/inference/v1/generate", gen, key=None), range(8)))
        assert any(r[0] == 429 for r in gen_results)
        # The Responses API shares it too.
        resp = {"model": m, "input": "Count:", "max_output_tokens": 64}
        with cf.ThreadPoolExecutor(8) as ex:
            resp_results = list(ex.map(
                lambda _: http("POST", base + "/v1/responses", resp, key=None), range(8)))
        assert any(r[0] == 429 for r in resp_results)
        for status, headers, data in resp_results:
            if status == 429:
                validate_ours(json.loads(data), our_pointer("/v1/responses", "POST", 429,
                                                            "application/json"))
        exercised.add(("/v1/responses", "429"))
        emb = {"model": m, "input": ["Count: " * 200] * 4}
        with cf.ThreadPoolExecutor(8) as ex:
            emb_results = list(ex.map(
                lambda _: http("POST", base + "/v1/embeddings", emb, key=None), range(8)))
        assert any(r[0] == 429 for r in emb_results)
        exercised.add(("/v1/embeddings", "429"))
        for status, headers, data in gen_results:
            if status == 429:
                doc = json.loads(data)
                validate_ours(doc, our_pointer("/inference/v1/generate", "POST", 429,
                                               "application/json"))
        exercised.add(("/inference/v1/generate", "429"))
        limited = [r for r in results if r[0] == 429]
        assert limited and any(r[0] == 200 for r in results)
        for status, headers, data in limited:
            assert headers.get("retry-after", headers.get("Retry-After")) == "2"
            doc = json.loads(data)
            validate_ours(doc, our_pointer("/v1/completions", "POST", 429, "application/json"))
            validate_official(doc, "/components/schemas/ErrorResponse")
        for path in ["/v1/chat/completions", "/v1/completions"]:
            exercised.add((path, "429"))
    finally:
        SERVER = saved
        proc.terminate()
        proc.wait(timeout=30)


def test_adapters_follow_the_contract(tmp_path):
    m = model_id()
    A = "/v1/adapters/{name}"
    _, _, a = check("POST", "/v1/adapters", {"name": "contract-oft", "kind": "oft"}, expect=201)
    assert a["version"] == 1 and a["num_parameters"] == 2321280  # OFT b=32 on all seven (REFERENCE.md)
    # A new identity OFT answers as the base does, and says so.
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    _, _, base = check("POST", "/v1/chat/completions", {"model": m, "messages": msgs, "max_tokens": 8, "temperature": 0})
    _, _, ident = check("POST", "/v1/chat/completions", {"model": "contract-oft", "messages": msgs, "max_tokens": 8, "temperature": 0})
    assert ident["choices"][0]["message"]["content"] == base["choices"][0]["message"]["content"]
    assert (base["adapter"], base["adapter_version"]) == (None, 0)
    assert (ident["adapter"], ident["adapter_version"], ident["system_fingerprint"]) == ("contract-oft", 1, "contract-oft@1")
    _, _, chunks = check("POST", "/v1/chat/completions", {"model": "contract-oft", "messages": msgs, "max_tokens": 4, "stream": True})
    assert all(c["adapter_version"] == 1 for c in chunks)
    check("POST", "/v1/completions", {"model": "contract-oft", "prompt": "Hello", "max_tokens": 3, "stream": True})
    _, _, a = check("POST", "/v1/adapters", {"name": "contract-oft", "kind": "lora", "r": 4}, expect=200)
    assert (a["version"], a["parent_version"], a["kind"]) == (2, 1, "lora")
    _, _, lst = check("GET", "/v1/adapters")
    assert "contract-oft" in [x["id"] for x in lst["data"]]
    _, _, models = check("GET", "/v1/models")
    assert models["data"][0]["id"] == m and any(x["id"] == "contract-oft" and x["parent"] == m for x in models["data"])
    _, _, one = check("GET", "/v1/adapters/contract-oft", route=A)
    assert one["versions"][-1]["current"]
    out = tmp_path / "export"
    check("POST", "/v1/adapters/contract-oft/export", {"path": str(out)}, route=A + "/export")
    assert (out / "adapter_config.json").exists()
    check("POST", "/v1/adapters/contract-oft/export", {"path": str(out)}, route=A + "/export", expect=409)
    check("POST", "/v1/adapters/contract-oft/export", {}, route=A + "/export", expect=400)
    check("POST", "/v1/adapters/nope/export", {"path": str(tmp_path / "x")}, route=A + "/export", expect=404)
    check("POST", "/v1/load_lora_adapter", {"lora_name": "contract-lora", "lora_path": str(out)})
    check("POST", "/v1/load_lora_adapter", {"lora_name": "contract-lora"}, expect=400)
    check("POST", "/v1/unload_lora_adapter", {"lora_name": "contract-lora"})
    check("POST", "/v1/unload_lora_adapter", {"lora_name": "contract-lora"}, expect=404)
    check("POST", "/v1/unload_lora_adapter", {}, expect=400)
    check("POST", "/v1/adapters", {"name": "x"}, expect=400)
    check("POST", "/v1/adapters", {"name": "x", "path": str(tmp_path / "missing")}, expect=400)
    for method, path, route in [("GET", "/v1/adapters", None), ("POST", "/v1/adapters", None),
                                ("GET", "/v1/adapters/contract-oft", A),
                                ("DELETE", "/v1/adapters/contract-oft", A),
                                ("POST", "/v1/adapters/contract-oft/export", A + "/export"),
                                ("POST", "/v1/load_lora_adapter", None),
                                ("POST", "/v1/unload_lora_adapter", None)]:
        check(method, path, {}, key="wrong", route=route, expect=401)
    check("DELETE", "/v1/adapters/contract-oft", route=A)
    check("DELETE", "/v1/adapters/contract-oft", route=A, expect=404)
    check("GET", "/v1/adapters/contract-oft", route=A, expect=404)
    check("POST", "/v1/chat/completions", {"model": "contract-oft", "messages": msgs}, expect=404)


def test_feedback_and_training_follow_the_contract():
    msgs = [{"role": "user", "content": "Say hi"}]
    _, _, r = check("POST", "/v1/chat/completions", {
        "model": LEARN, "messages": msgs, "max_tokens": 4, "n": 2, "temperature": 1.0})
    cid = r["id"]
    F = "/v1/feedback/{id}"
    rewards = [{"id": cid, "choice": 0, "reward": 1.0}, {"id": cid, "choice": 1, "reward": 0.0}]
    check("POST", "/v1/feedback", rewards, expect=202)
    check("POST", "/v1/feedback", rewards[0], expect=200)
    check("POST", "/v1/feedback", {**rewards[0], "reward": 0.5}, expect=409)
    check("POST", "/v1/feedback", {"id": cid, "reward": "x"}, expect=400)
    check("POST", "/v1/feedback", {"id": "chatcmpl-none", "reward": 1}, expect=404)
    check("POST", "/v1/feedback", rewards, key="wrong", expect=401)
    check("POST", "/v1/feedback", raw=b"x" * (3 << 20), expect=413)
    check("POST", "/v1/feedback", raw=json.dumps(rewards).encode(), content_type="text/plain",
          expect=415)
    _, _, fb = check("GET", f"/v1/feedback/{cid}", route=F)
    assert [c["reward"] for c in fb["choices"]] == [1.0, 0.0]
    check("GET", "/v1/feedback/chatcmpl-none", route=F, expect=404)
    check("GET", f"/v1/feedback/{cid}", route=F, key="wrong", expect=401)
    # An episode: two turns, one reward for both.
    for content in ["Say hi", "Again"]:
        check("POST", "/v1/chat/completions", {
            "model": LEARN, "messages": [{"role": "user", "content": content}], "max_tokens": 3,
            "episode": "contract-ep", "group": "contract-task"})
    check("POST", "/v1/feedback", {"episode": "contract-ep", "reward": 1.0}, expect=202)
    check("POST", "/v1/feedback", {"episode": "contract-ep", "reward": 1.0}, expect=200)
    check("POST", "/v1/feedback", {"episode": "contract-ep", "reward": 0.0}, expect=409)
    _, _, ep = check("GET", "/v1/feedback?episode=contract-ep", route="/v1/feedback")
    assert ep["reward"] == 1.0 and len(ep["turns"]) == 2
    check("GET", "/v1/feedback?episode=nope", route="/v1/feedback", expect=404)
    check("GET", "/v1/feedback", expect=400)
    check("GET", "/v1/feedback?episode=contract-ep", route="/v1/feedback", key="wrong", expect=401)
    _, _, st = check("GET", "/v1/train/status")
    assert LEARN in st["adapters"]
    check("GET", "/v1/train/status", key="wrong", expect=401)
    T = "/v1/adapters/{name}/train"
    check("POST", "/v1/adapters/contract-learn2/train", {"method": "lora", "lora_r": 4}, route=T,
          expect=201)
    _, _, t = check("POST", "/v1/adapters/contract-learn2/train", {"lr": 1e-4}, route=T)
    assert t["status"]["config"]["lr"] == pytest.approx(1e-4)
    # A learning adapter's shape is fixed for its lineage, and only its trainer publishes to it.
    _, _, e = check("POST", "/v1/adapters/contract-learn2/train", {"method": "oft"}, route=T,
                    expect=409)
    assert e["error"]["param"] == "method"
    check("POST", "/v1/adapters/contract-learn2/train", {"lr": 2.0}, route=T, expect=400)
    check("POST", "/v1/adapters/big/train", {"method": "lora", "lora_r": 100000}, route=T,
          expect=400)
    check("POST", "/v1/adapters/contract-learn2/train", {}, route=T, key="wrong", expect=401)
    _, _, e = check("POST", "/v1/adapters", {"name": "contract-learn2", "kind": "oft"},
                    expect=409)
    assert e["error"]["code"] == "adapter_is_learning"
    check("POST", "/v1/load_lora_adapter",
          {"lora_name": "contract-learn2", "lora_path": "/nonexistent"}, expect=409)
    for action in ["pause", "resume"]:
        R = "/v1/train/{name}/" + action
        _, _, t = check("POST", f"/v1/train/contract-learn2/{action}", route=R)
        assert t["status"]["state"] == ("paused" if action == "pause" else "running")
        check("POST", f"/v1/train/nope/{action}", route=R, expect=404)
        check("POST", f"/v1/train/contract-learn2/{action}", route=R, key="wrong", expect=401)
    # Two steps, then a manual rollback (the guards' own run: tests/server_guards.rs) and the
    # history the dashboard draws.
    for k in range(2):
        _, _, r = check("POST", "/v1/chat/completions", {
            "model": "contract-learn2", "messages": [{"role": "user", "content": "Hi"}],
            "n": 2, "max_tokens": 3, "temperature": 1.0})
        check("POST", "/v1/feedback", [{"id": r["id"], "choice": 0, "reward": 0.0},
                                       {"id": r["id"], "choice": 1, "reward": 1.0}], expect=202)
        deadline = time.time() + 120
        while check("GET", "/v1/train/status")[2]["adapters"]["contract-learn2"]["steps"] <= k:
            assert time.time() < deadline
            time.sleep(0.1)
    v = check("GET", "/v1/train/status")[2]["adapters"]["contract-learn2"]["version"]
    RB = "/v1/adapters/{name}/rollback"
    _, _, t = check("POST", "/v1/adapters/contract-learn2/rollback", {"version": v - 1}, route=RB)
    assert t["status"]["version"] == v - 1 and t["status"]["last_decision"]["reason"] == "manual"
    check("POST", "/v1/adapters/contract-learn2/rollback", {"version": v - 1}, route=RB,
          expect=400)
    check("POST", "/v1/adapters/contract-learn2/rollback", {"version": 1, "at": 2}, route=RB,
          expect=400)
    check("POST", "/v1/adapters/nope/rollback", {"version": 1}, route=RB, expect=404)
    check("POST", "/v1/adapters/contract-learn2/rollback", {"version": 1}, route=RB, key="wrong",
          expect=401)
    H = "/v1/train/{name}/history"
    _, _, h = check("GET", "/v1/train/contract-learn2/history", route=H)
    assert [s["version"] for s in h["steps"]] == [v - 1, v], h
    assert h["decisions"][0]["decision"] == "rollback", h
    check("GET", "/v1/train/contract-learn2/history?limit=0", route=H, expect=400)
    check("GET", "/v1/train/nope/history", route=H, expect=404)
    check("GET", "/v1/train/contract-learn2/history", route=H, key="wrong", expect=401)
    _, _, page = check("GET", "/dashboard", key=None)
    assert "<svg" in page or "createElementNS" in page


def test_tinker_routes_follow_the_contract():
    """The Tinker API's first routes (the SDK's own run: test_tinker.py)."""
    for path in ["/api/v1/healthz", "/api/v1/get_server_capabilities"]:
        check("GET", path)
        check("GET", path, key="wrong", expect=401)
    check("POST", "/api/v1/client/config", {"sdk_version": "0.38.0"})
    check("POST", "/api/v1/client/config", {"sdk_version": 3}, expect=400)
    check("POST", "/api/v1/client/config", {}, key="wrong", expect=401)
    _, _, created = check("POST", "/api/v1/create_session",
                          {"tags": ["a"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0"})
    check("POST", "/api/v1/create_session", {"tags": "a"}, expect=400)
    check("POST", "/api/v1/create_session", {}, key="wrong", expect=401)
    sid = created["session_id"]
    beat = {"session_id": sid, "type": "session_heartbeat"}
    check("POST", "/api/v1/session_heartbeat", beat)
    check("POST", "/api/v1/session_heartbeat", {}, expect=400)
    check("POST", "/api/v1/session_heartbeat", beat, key="wrong", expect=401)
    check("POST", "/api/v1/session_heartbeat", {"session_id": "session-none"}, expect=404)
    R = "/api/v1/sessions/{id}"
    _, _, got = check("GET", f"/api/v1/sessions/{sid}", route=R)
    assert got["user_metadata"] == {"k": "v"}
    check("GET", f"/api/v1/sessions/{sid}?access_scope=all", route=R, expect=400)
    check("GET", f"/api/v1/sessions/{sid}", route=R, key="wrong", expect=401)
    check("GET", "/api/v1/sessions/session-none", route=R, expect=404)
    _, _, models = check("GET", "/v1/models")
    base = models["data"][0]["id"]
    run = {"session_id": sid, "model_seq_id": 0, "base_model": base,
           "lora_config": {"rank": 4, "train_unembed": False}}
    _, _, fut = check("POST", "/api/v1/create_model", run)
    check("POST", "/api/v1/create_model", run, expect=409)
    check("POST", "/api/v1/create_model", {**run, "lora_config": {"rank": 4, "train_unembed": "yes"}},
          expect=400)
    check("POST", "/api/v1/create_model", {**run, "base_model": "nope"}, expect=404)
    check("POST", "/api/v1/create_model", run, key="wrong", expect=401)
    _, _, done = check("POST", "/api/v1/retrieve_future", {"request_id": fut["request_id"]})
    assert done == {"type": "create_model", "model_id": fut["model_id"]}
    check("POST", "/api/v1/retrieve_future", {}, expect=400)
    check("POST", "/api/v1/retrieve_future", {"request_id": "req-none"}, expect=410)
    check("POST", "/api/v1/retrieve_future", {"request_id": "x"}, key="wrong", expect=401)
    _, _, info = check("POST", "/api/v1/get_info", {"model_id": fut["model_id"]})
    assert info["lora_rank"] == 4
    check("POST", "/api/v1/get_info", {}, expect=400)
    check("POST", "/api/v1/get_info", {"model_id": "nope"}, expect=404)
    check("POST", "/api/v1/get_info", {"model_id": "nope"}, key="wrong", expect=401)
    # Runs together hold at most twice what one adapter may (50M parameters here): two of rank
    # 128 (39M each on this model), and a third is refused.
    big = {**run, "lora_config": {"rank": 128, "train_unembed": False}}
    for seq in (1, 2):
        check("POST", "/api/v1/create_model", {**big, "model_seq_id": seq})
    _, _, full = check("POST", "/api/v1/create_model", {**big, "model_seq_id": 3}, expect=429)
    assert full["error"]["code"] == "training_runs_full"
    check("POST", "/api/v1/telemetry", {"events": [], "session_id": sid})
    check("POST", "/api/v1/telemetry", {"events": 1}, expect=400)
    check("POST", "/api/v1/telemetry", {"events": []}, key="wrong", expect=401)


def _pb(num, wire, payload):
    """One protobuf field: varint (wire 0) or length-delimited (wire 2) bytes."""
    def varint(n):
        out = b""
        while True:
            b, n = n & 0x7F, n >> 7
            out += bytes([b | (0x80 if n else 0)])
            if not n:
                return out
    if wire == 0:
        return varint(num << 3) + varint(payload)
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def _fb_body(model_id, tokens, targets, loss="cross_entropy"):
    """A ForwardBackwardRequest (tinker_public) of one datum, written by hand."""
    tensor = (_pb(1, 2, struct.pack(f"<{len(targets)}q", *targets)) + _pb(3, 0, 2)
              + _pb(4, 0, len(targets)))
    entry = _pb(1, 2, b"target_tokens") + _pb(2, 2, tensor)
    chunk = _pb(1, 2, _pb(1, 2, struct.pack(f"<{len(tokens)}i", *tokens)))
    datum = _pb(1, 2, chunk) + _pb(2, 2, entry)
    return (_pb(1, 2, model_id.encode()) + _pb(2, 0, 1) + _pb(3, 2, datum)
            + _pb(4, 2, loss.encode()))


def test_tinker_training_and_sampling_follow_the_contract():
    _, _, models = check("GET", "/v1/models")
    base = models["data"][0]["id"]
    _, _, created = check("POST", "/api/v1/create_session", {"tags": []})
    sid = created["session_id"]
    run = {"session_id": sid, "model_seq_id": 0, "base_model": base,
           "lora_config": {"rank": 4, "train_unembed": False}}
    _, _, fut = check("POST", "/api/v1/create_model", run)
    mid = fut["model_id"]

    def result(f):
        for _ in range(100):
            _, h, r = check("POST", "/api/v1/retrieve_future", {"request_id": f["request_id"]})
            if isinstance(r, bytes) or r.get("type") != "try_again":
                return r
        raise AssertionError("no result")

    pb = "application/x-protobuf"
    FB = "/api/v1/forward_backward"
    ok = _fb_body(mid, [1, 2, 3, 4], [2, 3, 4, 5])
    _, _, f = check("POST", FB, raw=ok, content_type=pb)
    assert isinstance(result(f), bytes)
    check("POST", FB, raw=_fb_body(mid, [1, 2, 3, 4], [9, 9, 9, 9]), content_type=pb, expect=400)
    check("POST", FB, raw=_fb_body(mid, [1], [2], loss="nope"), content_type=pb, expect=400)
    check("POST", FB, raw=_fb_body("session-x:train:0", [1], [2]), content_type=pb, expect=404)
    check("POST", FB, raw=ok, content_type=pb, key="wrong", expect=401)
    check("POST", FB, raw=ok, content_type="application/json", expect=415)
    check("POST", FB, raw=b"x" * (3 << 20), content_type=pb, expect=413)
    OS = "/api/v1/optim_step"
    step = {"model_id": mid, "adam_params": {"learning_rate": 1e-4}}
    _, _, f = check("POST", OS, step)
    assert result(f)["metrics"]["datums:sum"] == 1
    check("POST", OS, {**step, "adam_params": {"learning_rate": -1}}, expect=400)
    check("POST", OS, {**step, "model_id": "nope"}, expect=404)
    check("POST", OS, step, key="wrong", expect=401)
    SW = "/api/v1/save_weights_for_sampler"
    _, _, f = check("POST", SW, {"model_id": mid, "path": "contract"})
    path = result(f)["path"]
    assert path == f"tinker://{mid}/sampler_weights/contract"
    _, _, f = check("POST", SW, {"model_id": mid, "sampling_session_seq_id": 0})
    assert result(f)["sampling_session_id"].startswith("sampler-")
    check("POST", SW, {"model_id": mid, "path": "../x"}, expect=400)
    check("POST", SW, {"model_id": "nope", "path": "a"}, expect=404)
    check("POST", SW, {"model_id": mid, "path": "a"}, key="wrong", expect=401)
    CS = "/api/v1/create_sampling_session"
    sess = {"session_id": sid, "sampling_session_seq_id": 1, "model_path": path}
    _, _, s = check("POST", CS, sess)
    check("POST", CS, {**sess, "model_path": None}, expect=400)
    check("POST", CS, {**sess, "model_path": "tinker://nope"}, expect=404)
    check("POST", CS, sess, key="wrong", expect=401)
    S = "/api/v1/samplers/{id}"
    sampler = s["sampling_session_id"]
    _, _, got = check("GET", f"/api/v1/samplers/{sampler}", route=S)
    assert got == {"sampler_id": sampler, "base_model": base, "model_path": path}
    check("GET", "/api/v1/samplers/sampler-none", route=S, expect=404)
    check("GET", f"/api/v1/samplers/{sampler}", route=S, key="wrong", expect=401)
    AS = "/api/v1/asample"
    ask = {"sampling_session_id": sampler, "num_samples": 2,
           "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
           "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 1},
           "prompt_logprobs": True, "type": "sample"}
    _, _, f = check("POST", AS, ask)
    assert len(f["sample_sequence_ids"]) == 2 and isinstance(result(f), bytes)
    check("POST", AS, {**ask, "topk_sample_logprobs": 2}, expect=400)
    check("POST", AS, {**ask, "sampling_params": {"min_p": 0.1}}, expect=400)
    check("POST", AS, {**ask, "sampling_session_id": "sampler-none"}, expect=404)
    check("POST", AS, ask, key="wrong", expect=401)
    SV, LD = "/api/v1/save_weights", "/api/v1/load_weights"
    _, _, f = check("POST", SV, {"model_id": mid, "path": "contract-state"})
    state = result(f)["path"]
    assert state == f"tinker://{mid}/weights/contract-state"
    check("POST", SV, {"model_id": mid, "path": "contract-state"}, expect=409)
    check("POST", SV, {"model_id": mid, "path": "../up"}, expect=400)
    check("POST", SV, {"model_id": mid, "path": "y", "ttl_seconds": 3600}, expect=400)
    check("POST", SV, {"model_id": "nope", "path": "x"}, expect=404)
    check("POST", SV, {"model_id": mid, "path": "x"}, key="wrong", expect=401)
    _, _, f = check("POST", LD, {"model_id": mid, "path": state, "optimizer": True})
    assert result(f) == {"type": "load_weights", "path": state}
    _, _, f = check("POST", LD, {"session_id": sid, "model_seq_id": 7, "path": state,
                                 "optimizer": False})
    assert f["model_id"] == f"{sid}:train:7"
    check("POST", LD, {"session_id": sid, "model_seq_id": 7, "path": state, "optimizer": False},
          expect=409)
    check("POST", LD, {"model_id": mid, "path": state}, expect=400)
    check("POST", LD, {"model_id": mid, "path": "tinker://../weights/x", "optimizer": True},
          expect=404)
    check("POST", LD, {"model_id": mid, "path": state, "optimizer": True}, key="wrong",
          expect=401)
    TR, TRS = "/api/v1/training_runs/{id}", "/api/v1/training_runs"
    _, _, one = check("GET", f"/api/v1/training_runs/{mid}", route=TR)
    assert one["training_run_id"] == mid and one["lora_rank"] == 4 and one["base_model"] == base
    check("GET", f"/api/v1/training_runs/{mid}?access_scope=all", route=TR, expect=400)
    check("GET", "/api/v1/training_runs/session-none:train:0", route=TR, expect=404)
    check("GET", f"/api/v1/training_runs/{mid}", route=TR, key="wrong", expect=401)
    _, _, runs = check("GET", "/api/v1/training_runs?limit=50&offset=0", route=TRS)
    assert mid in [r["training_run_id"] for r in runs["training_runs"]]
    assert runs["cursor"]["total_count"] >= 2
    check("GET", "/api/v1/training_runs?limit=x", route=TRS, expect=400)
    check("GET", "/api/v1/training_runs", route=TRS, key="wrong", expect=401)
    CK, DL = "/api/v1/training_runs/{id}/checkpoints", \
        "/api/v1/training_runs/{id}/checkpoints/weights/{name}"
    _, _, cks = check("GET", f"/api/v1/training_runs/{mid}/checkpoints", route=CK)
    assert [c["tinker_path"] for c in cks["checkpoints"]] == [state]
    check("GET", "/api/v1/training_runs/session-none:train:0/checkpoints", route=CK, expect=404)
    check("GET", f"/api/v1/training_runs/{mid}/checkpoints", route=CK, key="wrong", expect=401)
    gone = f"/api/v1/training_runs/{mid}/checkpoints/weights/contract-state"
    check("DELETE", gone, key="wrong", route=DL, expect=401)
    check("DELETE", f"/api/v1/training_runs/{mid}/checkpoints/weights/.hidden", route=DL,
          expect=400)
    status, _, _ = http("DELETE", SERVER + gone, key=KEY)
    assert status == 204
    exercised.add((DL, "204"))
    check("DELETE", gone, route=DL, expect=404)
    _, _, cks = check("GET", f"/api/v1/training_runs/{mid}/checkpoints", route=CK)
    assert cks["checkpoints"] == []


def test_sessions_follow_the_contract():
    S, SR = "/v1/sessions/{id}", "/v1/sessions/{id}/reward"
    _, _, s = check("POST", "/v1/sessions", {"adapter": LEARN, "gamma": 0.5}, expect=201)
    check("POST", "/v1/sessions", {"gamma": 2}, expect=400)
    check("POST", "/v1/sessions", {}, key="wrong", expect=401)
    # A turn by the session key, with whatever model the agent names.
    _, _, r = check("POST", "/v1/chat/completions", {
        "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 3}, key=s["key"])
    assert r["model"] == LEARN
    _, _, v = check("GET", f"/v1/sessions/{s['id']}", route=S)
    assert v["turns"] == 1 and v["completions"][0]["id"] == r["id"]
    check("GET", f"/v1/sessions/{s['id']}", route=S, key="wrong", expect=401)
    check("GET", "/v1/sessions/sess_none", route=S, expect=404)
    check("POST", f"/v1/sessions/{s['id']}/reward", {"rewards": [1, 2]}, route=SR, expect=400)
    check("POST", f"/v1/sessions/{s['id']}/reward", {"reward": 1}, route=SR, key="wrong",
          expect=401)
    check("POST", "/v1/sessions/sess_none/reward", {"reward": 1}, route=SR, expect=404)
    _, _, ack = check("POST", f"/v1/sessions/{s['id']}/reward", {"reward": 1}, route=SR,
                      expect=202)
    assert ack["state"] == "rewarded" and ack["returns"] == [1.0]
    check("POST", f"/v1/sessions/{s['id']}/reward", {"reward": 1}, route=SR, expect=200)
    check("POST", f"/v1/sessions/{s['id']}/reward", {"reward": 0}, route=SR, expect=409)
    _, _, e = check("POST", "/v1/sessions", {"adapter": LEARN}, expect=201)
    _, _, d = check("DELETE", f"/v1/sessions/{e['id']}", route=S)
    assert d["state"] == "ended"
    check("DELETE", f"/v1/sessions/{e['id']}", route=S, key="wrong", expect=401)
    check("DELETE", "/v1/sessions/sess_none", route=S, expect=404)


def test_every_documented_path_and_status_was_exercised():
    """Runs last in this module: the contract documents nothing the tests above did not see,
    except statuses that cannot be provoked from outside (500, 503 while loading)."""
    # 403: admin routes refused on a server bound to a non-loopback address without an admin key;
    # tests bind loopback only (tests/server_adapters.rs checks the admin key).
    unprovokable = {"500", "503", "403"}
    methods = {"get", "post", "put", "patch", "delete"}
    documented = {(p, s) for p, ops in OURS_DOC["paths"].items() for m, op in ops.items()
                  if m in methods for s in op["responses"] if s not in unprovokable}
    missing = documented - exercised
    assert not missing, f"documented but not exercised: {sorted(missing)}"


# ---------------------------------------------------------------- the official SDK


def test_the_openai_sdk_works():
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=SERVER + "/v1", api_key=KEY)
    m = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert 0 < r.usage.completion_tokens <= 20

    text = ""
    n_chunks = 0
    for chunk in client.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16,
            stream=True, stream_options={"include_usage": True}):
        n_chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        else:
            assert chunk.usage.completion_tokens > 0
    assert text and n_chunks > 2

    r = client.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "Pick a number."}], max_tokens=8, n=4,
        temperature=1.0, seed=3, logprobs=True, top_logprobs=5)
    assert len(r.choices) == 4 and sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        lps = c.logprobs.content
        assert lps and all(len(t.top_logprobs) == 5 and t.logprob <= 0 for t in lps)
    assert len({tuple(t.token for t in c.logprobs.content) for c in r.choices}) > 1

    # Token in, token out through the SDK as RL clients stream completions (vLLM's
    # `return_token_ids`): each choice's prompt ids come once, with its first token.
    ids = {"return_token_ids": True, "ignore_eos": True}
    prompts, tokens = {}, {0: [], 1: []}
    for chunk in client.completions.create(model=m, prompt="Once upon a time", max_tokens=5, n=2,
                                           stream=True, extra_body=ids):
        for c in chunk.choices:
            extra = c.model_extra or {}
            if extra.get("prompt_token_ids") is not None:
                assert c.index not in prompts
                prompts[c.index] = extra["prompt_token_ids"]
            tokens[c.index] += extra.get("token_ids") or []
    whole = client.completions.create(model=m, prompt="Once upon a time", max_tokens=1,
                                      extra_body=ids)
    want = whole.choices[0].model_extra["prompt_token_ids"]
    assert want and prompts == {0: want, 1: want}
    assert [len(t) for t in tokens.values()] == [5, 5]

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])

    # An adapter is selected by `model`, as with vLLM's LoRA adapters.
    assert http("POST", SERVER + "/v1/adapters", {"name": "sdk-lora", "kind": "lora"})[0] == 201
    assert "sdk-lora" in [x.id for x in client.models.list().data]
    r = client.chat.completions.create(
        model="sdk-lora", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.model == "sdk-lora" and r.system_fingerprint == "sdk-lora@1"
    assert r.model_extra["adapter_version"] == 1
