"""Agent frameworks as their users call them, on the default model (each test is skipped when its
client is not installed; `pip install langchain-openai` to run them): LangChain's `bind_tools`
(auto and forced) and `with_structured_output` in each of its methods."""

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
