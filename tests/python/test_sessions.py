"""Agents as they are: the OpenAI Agents SDK and a LangGraph agent, unmodified but for their base
URL and key (a session key from POST /v1/sessions), run tool-using agents on the default model;
every model call they make is a turn of their session's episode, and once each session is
rewarded every turn trains with its session's reward (two sessions of one group: one step over
all their turns, each trained on exactly what was served)."""

import asyncio
import json
import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import KEY, http, running  # noqa: E402

openai = pytest.importorskip("openai")


def weather(city: str) -> str:
    """Get the weather for a city."""
    return f"sunny in {city}"


def run_agents_sdk(base, key):
    """A tool-using agent as the Agents SDK's docs write one; only the client differs."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=base + "/v1", api_key=key))
    agent = agents.Agent(
        name="weather", instructions="Answer with the tool's result.",
        tools=[agents.function_tool(weather)], model="gpt-4o-mini",
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48))
    try:
        r = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3))
        items = r.new_items
    except agents.exceptions.MaxTurnsExceeded as e:
        # A 135M model calls the tool again and again: the run ends at its turn limit.
        items = e.run_data.new_items
    calls = [i for i in items if i.type == "tool_call_item"]
    assert calls and calls[0].raw_item.name == "weather", items


def run_langgraph(base, key):
    """LangGraph's prebuilt ReAct agent over LangChain's ChatOpenAI; only the client differs."""
    pytest.importorskip("langgraph")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    # Seeded: a forced call's free-form argument can run past max_tokens on some draws (then
    # it is no call and the graph ends after one turn); this seed's draws call the tool.
    llm = ChatOpenAI(base_url=base + "/v1", api_key=key, model="gpt-4o-mini", max_tokens=64,
                     seed=7)
    tools = [tool(weather)]
    # The tool bound as required: LangGraph's documented way to make the agent use it.
    graph = create_react_agent(llm.bind_tools(tools, tool_choice="required"), tools)
    try:
        graph.invoke({"messages": [("user", "What is the weather in Paris? Use the tool.")]},
                     {"recursion_limit": 5})
    except GraphRecursionError:
        pass  # the model kept calling the tool: the graph stopped at its limit


def test_unmodified_agents_learn_from_their_sessions_rewards(tmp_path):
    cfg = tmp_path / "serve.toml"
    # Both agents force their tool (tool_choice "required"): those turns are sampled under a
    # grammar, which trains only when the server is told to train such samples.
    cfg.write_text("[online]\ngroup_timeout_secs = 0.5\nmax_off_policy_steps = 1000\n"
                   "train_off_policy_samples = true\n")
    with running(["--api-key", KEY, "--learn", "brief", "--config", str(cfg)]) as base:
        sessions = {}
        for name in ("agents_sdk", "langgraph"):
            st, _, body = http("POST", base + "/v1/sessions", {"group": "weather"})
            assert st == 201, body
            sessions[name] = json.loads(body)
        run_agents_sdk(base, sessions["agents_sdk"]["key"])
        run_langgraph(base, sessions["langgraph"]["key"])
        turns = {}
        for name, s in sessions.items():
            st, _, body = http("GET", base + f"/v1/sessions/{s['id']}")
            v = json.loads(body)
            print(name, "turns:", v["turns"])
            assert v["turns"] >= 2, v  # a tool call, then the model again
            assert all(c["adapter"] == "brief" for c in v["completions"]), v
            turns[name] = v["turns"]
        for name, reward in (("agents_sdk", 1.0), ("langgraph", 0.0)):
            st, _, body = http("POST", base + f"/v1/sessions/{sessions[name]['id']}/reward",
                               {"reward": reward})
            assert st == 202, body
        deadline = time.time() + 120
        while True:
            s = json.loads(http("GET", base + "/v1/train/status")[2])["adapters"]["brief"]
            if s["steps"] >= 1:
                break
            assert time.time() < deadline, (s, [http("GET", base + f"/v1/sessions/{x['id']}")[2]
                                                for x in sessions.values()])
            time.sleep(0.2)
        assert s["last"]["sequences"] == sum(turns.values()), (s["last"], turns)
        assert s["last"]["logprob_diff_max"] == 0.0, s["last"]
        for name, reward in (("agents_sdk", 1.0), ("langgraph", 0.0)):
            v = json.loads(http("GET", base + f"/v1/sessions/{sessions[name]['id']}")[2])
            assert v["state"] == "rewarded", v
            for c in v["completions"]:
                assert (c["reward"], c["trained_step"]) == (reward, 1), v
