"""LiteLLM against the server as its users call it (`openai/<model>` with `api_base`), on the
default model: a plain tools dict (no `additionalProperties`, an unbounded integer: greedy, the
model writes `"limit": 1000…` until the server bounds it) forced with `tool_choice`, a
pydantic `response_format` with a nested object, a per-request chat template in `extra_body`,
and `litellm.responses` (the Responses API). Skipped when litellm is not installed."""

import json
import pathlib
import sys
import urllib.request

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import MODEL, running  # noqa: E402

litellm = pytest.importorskip("litellm")
from pydantic import BaseModel  # noqa: E402


@pytest.fixture(scope="module")
def base():
    with running() as url:
        yield url


def args(base):
    return {"model": "openai/" + MODEL.stem, "api_base": base + "/v1", "api_key": "none"}


class Address(BaseModel):
    city: str


class Person(BaseModel):
    name: str
    address: Address


def test_litellm_tools_structured_outputs_templates_and_responses(base):
    tools = [{"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "limit": {"type": "integer"}},
                       "required": ["query"]}}}]
    r = litellm.completion(**args(base), messages=[{"role": "user", "content": "find cats"}],
                           tools=tools, tool_choice="required", max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "search"
    assert set(json.loads(call.function.arguments)) <= {"query", "limit"}
    r = litellm.completion(**args(base), messages=[{"role": "user", "content": "A person."}],
                           response_format=Person, max_tokens=150, temperature=0)
    Person.model_validate_json(r.choices[0].message.content)
    r = litellm.completion(**args(base), messages=[{"role": "user", "content": "hi"}],
                           max_tokens=3, extra_body={"chat_template": "{{ messages[0].content }} ->",
                                                     "return_token_ids": True})
    req = urllib.request.Request(base + "/detokenize",
                                 data=json.dumps({"tokens": r.prompt_token_ids}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        assert json.load(resp)["prompt"] == "hi ->"
    r = litellm.responses(**args(base), input="hi", max_output_tokens=5)
    assert r.output[0].type == "message" and r.output[0].content[0].text
    assert r.usage.output_tokens <= 5
