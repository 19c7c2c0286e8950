"""Runs in the `tinker` virtual environment: an RL loop as the Tinker cookbook writes one, against
the server argv[1] with the key argv[2] on its model argv[3], for argv[4] steps. The task is
brevity: a sample earns 1 when it ends (EOS) within 10 tokens, else 0. Each step publishes the
weights for sampling, samples 6 completions for each of 4 prompts at temperature 1, centres the
rewards per prompt (GRPO's advantage; seeded, so a run repeats), and trains on them with `importance_sampling` (the
sampler's log-probs as `logprobs`) and `optim_step`. Prints one JSON line: the mean reward of
each step."""

import json
import sys
import urllib.request

import tinker
from tinker import types

PROMPTS = ["Say hi.", "Name a color.", "What is 2+2?", "Give me one word."]


def tokenize(base, key, text):
    req = urllib.request.Request(
        f"{base}/tokenize", data=json.dumps({"messages": [{"role": "user", "content": text}],
                                             "add_generation_prompt": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["tokens"]


def main(base, key, model, steps):
    client = tinker.ServiceClient(base_url=base, api_key=key)
    training = client.create_lora_training_client(
        base_model=model, rank=8, seed=5, train_unembed=False).result()
    prompts = [tokenize(base, key, p) for p in PROMPTS]
    rewards = []
    for step in range(int(steps)):
        params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=step)
        sampler = training.save_weights_and_get_sampling_client().result()
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=6,
                                  sampling_params=params) for p in prompts]
        data, step_rewards = [], []
        for p, fut in zip(prompts, futures):
            seqs = fut.result().sequences
            r = [1.0 if s.stop_reason == "stop" else 0.0 for s in seqs]
            step_rewards.extend(r)
            mean = sum(r) / len(r)
            for s, ri in zip(seqs, r):
                toks = list(map(int, s.tokens))
                if ri == mean or not toks:
                    continue
                n = len(p) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(p + toks[:-1]),
                    loss_fn_inputs={
                        "target_tokens": p[1:] + toks,
                        "logprobs": [0.0] * n + list(map(float, s.logprobs)),
                        "advantages": [0.0] * n + [ri - mean] * len(toks),
                    }))
        rewards.append(sum(step_rewards) / len(step_rewards))
        if data:
            training.forward_backward(data, "importance_sampling")
            training.optim_step(types.AdamParams(learning_rate=6e-4)).result()
    print(json.dumps({"rewards": rewards}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
