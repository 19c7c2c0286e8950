"""The Responses API as its clients call it, on the default model: the OpenAI Agents SDK's default
`Agent` + `Runner` (plain, streamed, with a function tool, with a structured `output_type`), and
the openai SDK's `responses.create` (text and item input, `instructions`, function calls and
their outputs, `previous_response_id`, `text.format`, streamed events, `responses.retrieve`).
Also chat templates per request and reasoning models through the openai SDK's `extra_body`."""

import asyncio
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import MODEL, running  # noqa: E402

openai = pytest.importorskip("openai")
from pydantic import BaseModel  # noqa: E402


@pytest.fixture(scope="module")
def base():
    with running() as url:
        yield url


def sync_client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none")


class City(BaseModel):
    name: str
    sunny: bool


def test_agents_sdk_default_agent_and_runner(base):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none")
    model = agents.OpenAIResponsesModel(model=MODEL.stem, openai_client=client)
    settings = agents.ModelSettings(max_tokens=48, temperature=0)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        return f"sunny in {city}"

    async def run():
        plain = agents.Agent(name="a", instructions="Be brief.", model=model,
                             model_settings=settings)
        r = await agents.Runner.run(plain, "Say hello.")
        assert isinstance(r.final_output, str) and r.final_output
        assert r.raw_responses[0].response_id.startswith("resp_")
        # Streamed: text deltas arrive, and their sum is the final output.
        s = agents.Runner.run_streamed(plain, "Say hi.")
        deltas = []
        async for ev in s.stream_events():
            if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta":
                deltas.append(ev.data.delta)
        assert len(deltas) > 1 and "".join(deltas) == s.final_output
        # A function tool the model must call; the run stops on its output.
        tooled = agents.Agent(
            name="t", instructions="Use the tool.", tools=[get_weather], model=model,
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=64,
                                                temperature=0),
            tool_use_behavior="stop_on_first_tool")
        r = await agents.Runner.run(tooled, "Weather in Paris?")
        calls = [i for i in r.new_items if i.type == "tool_call_item"]
        assert len(calls) == 1 and calls[0].raw_item.name == "get_weather"
        assert isinstance(json.loads(calls[0].raw_item.arguments)["city"], str)
        assert r.final_output.startswith("sunny in ")
        # A structured output type: text.format json_schema, parsed by the SDK.
        typed = agents.Agent(name="s", instructions="Describe a city as JSON.", model=model,
                             output_type=City,
                             model_settings=agents.ModelSettings(max_tokens=160, temperature=0))
        r = await agents.Runner.run(typed, "Paris")
        assert isinstance(r.final_output, City)

    asyncio.run(run())


def test_openai_sdk_responses_conversation_tools_and_stream(base):
    c = sync_client(base)
    r1 = c.responses.create(model=MODEL.stem, input="My name is Ann.", max_output_tokens=3,
                            instructions="Be brief.")
    assert r1.status == "incomplete" and r1.incomplete_details.reason == "max_output_tokens"
    assert r1.usage.output_tokens == 3 and r1.output_text
    assert r1.instructions == "Be brief."
    r2 = c.responses.create(model=MODEL.stem, input="What is my name?", max_output_tokens=8,
                            previous_response_id=r1.id)
    # The stored conversation went in first: a longer prompt than the question alone.
    alone = c.responses.create(model=MODEL.stem, input="What is my name?", max_output_tokens=8)
    assert r2.usage.input_tokens > alone.usage.input_tokens + r1.usage.output_tokens
    assert c.responses.retrieve(r1.id).output_text == r1.output_text
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL.stem, input="x", previous_response_id="resp_nope")
    # A forced function call, then its output sent back as an item.
    tools = [{"type": "function", "name": "add", "description": "Add two integers.",
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                              "b": {"type": "integer"}},
                             "required": ["a", "b"]}}]
    r = c.responses.create(model=MODEL.stem, input="What is 2 + 3?", tools=tools,
                           tool_choice={"type": "function", "name": "add"}, max_output_tokens=64,
                           temperature=0)
    call = [o for o in r.output if o.type == "function_call"][0]
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"}
    r = c.responses.create(model=MODEL.stem, previous_response_id=r.id, max_output_tokens=16,
                           input=[{"type": "function_call_output", "call_id": call.call_id,
                                   "output": "5"}])
    assert r.output_text
    # text.format: the answer follows the schema.
    r = c.responses.create(model=MODEL.stem, input="A city.", max_output_tokens=160, temperature=0,
                           text={"format": {"type": "json_schema", "name": "city",
                                            "schema": City.model_json_schema(), "strict": True}})
    City.model_validate_json(r.output_text)
    # Streamed events, numbered, ending with the whole response.
    events = list(c.responses.create(model=MODEL.stem, input="Hi.", max_output_tokens=12,
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    # Unimplemented fields are refused by name.
    with pytest.raises(openai.BadRequestError, match="background"):
        c.responses.create(model=MODEL.stem, input="x", background=True)


def test_chat_templates_and_kwargs_through_the_openai_sdk(base):
    c = sync_client(base)
    tmpl = ("{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}Answer: {% endif %}")
    r = c.chat.completions.create(
        model=MODEL.stem, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"chat_template": tmpl, "chat_template_kwargs": {"greeting": "Hello"},
                    "return_token_ids": True})
    ids = r.model_extra["prompt_token_ids"]
    import urllib.request
    req = urllib.request.Request(base + "/detokenize", data=json.dumps({"tokens": ids}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        assert json.load(resp)["prompt"] == "Hello hi\nAnswer: "
    # Continuing the assistant's final message.
    r = c.chat.completions.create(
        model=MODEL.stem, max_tokens=4,
        messages=[{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content is not None
