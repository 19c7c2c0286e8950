"""Agent frameworks as their users call them, on the default model (each test is skipped when its
client is not installed; `pip install langchain-openai` to run them): LangChain's `bind_tools`
(auto and forced) and `with_structured_output` in each of its methods; schemas as people write
them (no `additionalProperties`) through LangChain and the openai SDK; chat templates through
`extra_body` and the Responses API (`use_responses_api=True`) through LangChain."""

import sys
import pathlib
from typing import Literal

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import MODEL, start_server  # noqa: E402

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    proc, base = start_server([])
    try:
        yield langchain_openai.ChatOpenAI(base_url=base + "/v1", api_key="none",
                                          model=MODEL.stem, temperature=0, max_tokens=120)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


def test_bind_tools_returns_calls(llm):
    # SmolLM2's template renders no tools: the generic format; forced, the call is certain.
    m = llm.bind_tools([add], tool_choice="add").invoke("hello")
    assert len(m.tool_calls) == 1
    call = m.tool_calls[0]
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())
    m = llm.bind_tools([add]).invoke("What is 2 + 3? Use the tool.")
    assert m.tool_calls or m.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output_gives_the_model(llm, method):
    r = llm.with_structured_output(Person, method=method).invoke(
        "Describe a person. Reply in JSON with name, age, mood.")
    assert isinstance(r, Person)
    assert 0 <= r.age <= 120 and r.mood in ("happy", "sad")


@tool
def search(query: str, limit: int = 5) -> str:
    """Search the web for a query."""
    return query


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(max_length=8)


class Customer(BaseModel):
    name: str = Field(max_length=20)
    address: Address


def test_ordinary_schemas_close_when_sampled():
    """Schemas as people write them say nothing of additionalProperties: a LangChain `@tool`,
    a plain tools dict through the openai SDK's stream helper (which raises
    LengthFinishReasonError on a call cut by max_tokens), and a nested pydantic model through
    `parse`. Sampled at temperature 1, each call and object closes with only its listed keys."""
    import openai

    proc, base = start_server([])
    try:
        hot = langchain_openai.ChatOpenAI(base_url=base + "/v1", api_key="none",
                                          model=MODEL.stem, temperature=1.0, max_tokens=256)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        lookup = [{"type": "function", "function": {
            "name": "lookup", "description": "Look an order up by its id.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                           "required": ["order_id"]}}}]
        for seed in range(2):
            m = hot.bind_tools([search], tool_choice="required").bind(seed=seed).invoke(
                "Find pictures of cats.")
            assert len(m.tool_calls) == 1, m
            assert set(m.tool_calls[0]["args"]) <= {"query", "limit"}, m.tool_calls
            with client.chat.completions.stream(
                    model=MODEL.stem, messages=[{"role": "user", "content": "Where is order 17?"}],
                    tools=lookup, tool_choice="required", temperature=1.0, seed=seed,
                    max_tokens=256) as s:
                final = s.get_final_completion()
            c = final.choices[0]
            assert c.finish_reason == "tool_calls", c
            assert set(c.message.tool_calls[0].function.parsed_arguments or
                       __import__("json").loads(c.message.tool_calls[0].function.arguments)) \
                == {"order_id"}
            r = client.chat.completions.parse(
                model=MODEL.stem, messages=[{"role": "user", "content": "Invent a customer."}],
                response_format=Customer, temperature=1.0, seed=seed, max_tokens=256)
            assert isinstance(r.choices[0].message.parsed, Customer), r
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_langchain_reaches_templates_and_the_responses_api(llm):
    """LangChain as its users pass server extensions (`extra_body`) and as it calls the Responses
    API (`use_responses_api=True`), unchanged."""
    import openai
    base = str(llm.openai_api_base)
    raising = langchain_openai.ChatOpenAI(
        base_url=base, api_key="none", model=MODEL.stem, max_tokens=4,
        extra_body={"chat_template": "{{ raise_exception('template reached the server') }}"})
    with pytest.raises(openai.BadRequestError, match="template reached the server"):
        raising.invoke("hi")
    templated = langchain_openai.ChatOpenAI(
        base_url=base, api_key="none", model=MODEL.stem, max_tokens=4,
        extra_body={"chat_template": "{{ greeting }} {{ messages[0].content }} ->",
                    "chat_template_kwargs": {"greeting": "Hello"}})
    assert isinstance(templated.invoke("hi").content, str)
    responses = langchain_openai.ChatOpenAI(
        base_url=base, api_key="none", model=MODEL.stem, max_tokens=8, use_responses_api=True)
    m = responses.invoke("Say hi.")
    assert m.response_metadata["id"].startswith("resp_")
    assert m.text()
    streamed = "".join(c.text() for c in responses.stream("Count."))
    assert streamed
