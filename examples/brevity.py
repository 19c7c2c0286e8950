"""Teach a learning adapter brevity through Flywheel's public API.

Start the server with a learning adapter, then run this client:

    cargo run --release -- serve --learn brief   # the default model is fetched on first use
    python3 examples/brevity.py --model brief [--url http://127.0.0.1:8080] [--steps 30]

Each step asks one chat prompt with n=8 through the adapter (the official `openai` package),
scores every answer (1 if it has 3 to 15 words, else 0: without the floor, saying nothing
is the shortest answer and the policy finds it), posts the rewards to
/v1/feedback, and waits for the trainer to publish the next version before asking again (a
client that waits for each answer, as in TRL's GRPO loop). It prints the mean reward per step and
adapter version and saves a plot of reward against version and time (PNG, with matplotlib) and
the raw numbers (CSV).
"""

import argparse
import time

from flywheel_client import post, pyplot, save_csv, status, wait_trained

PROMPTS = [
    "What is the capital of France?", "Describe the ocean.", "Why is the sky blue?",
    "Tell me about cats.", "What is photosynthesis?", "How do airplanes fly?",
    "What is a computer?", "Explain gravity.", "What do bees do?", "Describe a forest.",
    "What is music?", "How does rain form?", "What is the moon?", "Tell me about dogs.",
    "What is a volcano?", "Why do we sleep?",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="brief")
    ap.add_argument("--key", default="")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-words", type=int, default=15)
    # An empty answer is short too: without a floor the policy learns to say nothing.
    ap.add_argument("--min-words", type=int, default=3)
    ap.add_argument("--out", default="data/brevity",
                    help="where the CSV and PNG go (OUT.csv, OUT.png)")
    a = ap.parse_args()
    from openai import OpenAI  # here, so that scripts/trl_brevity.py can import PROMPTS alone

    # The SDK always sends a key; rewards must come with the key that made the completion.
    a.key = a.key or "none"
    client = OpenAI(base_url=a.url + "/v1", api_key=a.key)
    rows = []
    t0 = time.time()
    for step in range(a.steps):
        prompt = PROMPTS[step % len(PROMPTS)]
        t_step = time.time()
        r = client.chat.completions.create(
            model=a.model, messages=[{"role": "user", "content": prompt}], n=a.n,
            max_tokens=a.max_tokens, temperature=1.0)
        version = r.model_extra.get("adapter_version")
        rewards = [1.0 if a.min_words <= len((c.message.content or "").split()) <= a.max_words
                   else 0.0 for c in r.choices]
        before = status(a.url, a.model, a.key)
        code, _ = post(a.url, "/v1/feedback",
                       [{"id": r.id, "choice": c.index, "reward": w} for c, w in zip(r.choices, rewards)],
                       a.key)
        # Wait until this group is trained (a new version) or dropped (no reward variance).
        wait_trained(a.url, a.model, a.key, before)
        mean = sum(rewards) / len(rewards)
        words = sum(len((c.message.content or "").split()) for c in r.choices) / len(r.choices)
        rows.append({"step": step, "version": version, "mean_reward": mean, "mean_words": words,
                     "seconds": time.time() - t0, "step_seconds": time.time() - t_step})
        print(f"step {step:3d}  version {version:3d}  mean reward {mean:.2f}  mean words {words:5.1f}"
              f"  step {time.time() - t_step:5.1f} s  total {time.time() - t0:6.1f} s", flush=True)
    save_csv(rows, a.out)
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: wrote only", a.out + ".csv")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["version"] for r in rows], [r["mean_reward"] for r in rows], "o-")
    ax1.set_xlabel("adapter version")
    ax1.set_ylabel(f"mean reward ({a.min_words}-{a.max_words} words)")
    ax2.plot([r["seconds"] for r in rows], [r["mean_reward"] for r in rows], "o-")
    ax2.set_xlabel("seconds")
    fig.suptitle(f"Flywheel learning '{a.model}' through /v1/feedback")
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=100)
    print("wrote", a.out + ".png and", a.out + ".csv")


if __name__ == "__main__":
    main()
