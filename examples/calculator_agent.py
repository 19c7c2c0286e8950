"""An agent that learns to use a calculator tool, through Flywheel's public API.

Start the server with a learning adapter that trains on constrained samples (the generic tool
format constrains every answer of a template without tool support, such as SmolLM2's), then run
this client:

    flywheel serve --config examples/calculator.toml      # learning adapter "calc"
    python3 examples/calculator_agent.py --model calc [--url http://127.0.0.1:8080] [--steps 30]

Each step poses one arithmetic question ("What is 47 * 86?") to `--group` episodes at once.
An episode is a short agent loop through the official `openai` SDK: the model may call the
`calculator` tool (its call comes back as `tool_calls`), the client runs it and sends the result
back as a `tool` message, until the model answers in text (at most `--turns` turns). Every turn
carries the extension fields `episode` (this episode) and `group` (this question), so the
server logs each turn and trains all of them with the episode's advantage. The reward, 1 when
the final answer contains the right number, is posted once per episode with
`POST /v1/feedback {"episode", "reward"}`; the client then waits for the trainer to publish the
next version. It prints the mean reward and tool-use rate per step and saves them as CSV and a
PNG plot (with matplotlib).

Status: the loop, the episodes and the training run end to end, but on SmolLM2 the policy does
not improve yet (see README, "Learning online"): its answers are constrained by the generic tool
format (trained with the model's unconstrained log-probs; forced tokens are left out), and
rewards are too rare for a 135M model to find the right answers.
"""

import argparse
import concurrent.futures as cf
import json
import random
import re
import time

from openai import OpenAI

from flywheel_client import post, pyplot, save_csv, status, wait_trained

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Compute a op b exactly, for integers a and b.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "op": {"enum": ["+", "-", "*"]}, "b": {"type": "integer"}},
        "required": ["a", "op", "b"], "additionalProperties": False}}}]


def calculate(args):
    a, op, b = int(args["a"]), args["op"], int(args["b"])
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def episode(client, a, question, answer, episode_id, group_id):
    """One agent loop; returns (reward, used the tool, the final text, the versions served)."""
    msgs = [{"role": "system", "content": a.system}, {"role": "user", "content": question}]
    used, versions, text = False, [], ""
    for _ in range(a.turns):
        r = client.chat.completions.create(
            model=a.model, messages=msgs, tools=TOOLS, max_tokens=a.max_tokens,
            temperature=1.0, extra_body={"episode": episode_id, "group": group_id})
        versions.append(r.model_extra.get("adapter_version"))
        m = r.choices[0].message
        if not m.tool_calls:
            text = m.content or ""
            break
        used = True
        msgs.append(m.model_dump(exclude_none=True))
        for call in m.tool_calls:
            try:
                result = str(calculate(json.loads(call.function.arguments)))
            except (ValueError, KeyError, TypeError) as e:
                result = f"error: {e}"
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = [int(x) for x in re.findall(r"-?\d+", text.replace(",", ""))]
    reward = 1.0 if answer in numbers else 0.0
    return reward, used, text, versions


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="calc")
    ap.add_argument("--key", default="none")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--group", type=int, default=8, help="episodes per question")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system", default="Use the calculator tool for arithmetic, then give the "
                    "user its result.")
    ap.add_argument("--out", default="calculator")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    client = OpenAI(base_url=a.url + "/v1", api_key=a.key)
    rows, t0 = [], time.time()
    for step in range(a.steps):
        x, y, op = rng.randint(12, 99), rng.randint(12, 99), rng.choice("+-*")
        answer = {"+": x + y, "-": x - y, "*": x * y}[op]
        question = f"What is {x} {op} {y}?"
        tag = f"s{step}-{rng.getrandbits(32):08x}"
        t_step = time.time()
        before = status(a.url, a.model, a.key)
        with cf.ThreadPoolExecutor(a.group) as pool:
            runs = list(pool.map(
                lambda i: episode(client, a, question, answer, f"{tag}-e{i}", tag),
                range(a.group)))
        for i, (reward, _, _, _) in enumerate(runs):
            post(a.url, "/v1/feedback", {"episode": f"{tag}-e{i}", "reward": reward}, a.key)
        # Wait until this group is trained (a new version) or dropped (no reward variance).
        wait_trained(a.url, a.model, a.key, before)
        rewards = [r[0] for r in runs]
        mean = sum(rewards) / len(rewards)
        tool_rate = sum(r[1] for r in runs) / len(runs)
        version = min(v for r in runs for v in r[3])
        rows.append({"step": step, "version": version, "mean_reward": mean,
                     "tool_rate": tool_rate, "seconds": time.time() - t0,
                     "step_seconds": time.time() - t_step})
        print(f"step {step:3d}  version {version:3d}  {question:<16} reward {mean:.2f}  "
              f"tool use {tool_rate:.2f}  e.g. {runs[0][2][:40]!r}  "
              f"step {time.time() - t_step:5.1f} s  total {time.time() - t0:6.1f} s", flush=True)
    save_csv(rows, a.out)
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: wrote only", a.out + ".csv")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in rows], [r["mean_reward"] for r in rows], "o-", label="reward")
    ax1.plot([r["step"] for r in rows], [r["tool_rate"] for r in rows], "s--", label="tool use")
    ax1.set_xlabel("step (one question, its episodes)")
    ax1.legend()
    ax2.plot([r["seconds"] for r in rows], [r["mean_reward"] for r in rows], "o-")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("mean reward (right answer)")
    fig.suptitle(f"Flywheel: '{a.model}' learning to use a calculator tool")
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=100)
    print("wrote", a.out + ".png and", a.out + ".csv")


if __name__ == "__main__":
    main()
