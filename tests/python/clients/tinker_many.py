"""Runs in the `tinker` virtual environment: several training runs at once through one
`ServiceClient` (the server argv[1], key argv[2], model argv[3], argv[4] steps). First one run
alone (the SDK's defaults, seed 11) learns the answer " apple apple" to one prompt; then four runs
(seeds 11..14) each learn their own answer to the same prompt, every step's `forward_backward` and
`optim_step` of all four submitted before any is awaited (the SDK sends them at once). Prints one
JSON line: the lone run's loss per step, each of the four's, and each of the four's loss on every
run's answer after training."""

import json
import sys

import tinker
from tinker import types

from tinker_sft import datum

PROMPT = "Q: What is your word?\nA:"
ANSWERS = [" apple apple", " river river", " candle candle", " violin violin"]


def train(pairs, steps):
    """`steps` steps of every (run, datum) pair, submitted together; each run's loss per step."""
    losses = [[] for _ in pairs]
    for _ in range(steps):
        calls = [(run.forward_backward([d], "cross_entropy"),
                  run.optim_step(types.AdamParams(learning_rate=3e-3))) for run, d in pairs]
        for i, (fwd_bwd, optim) in enumerate(calls):
            losses[i].append(fwd_bwd.result().metrics["loss:sum"])
            optim.result()
    return losses


def main(base, key, model, steps):
    steps = int(steps)
    client = tinker.ServiceClient(base_url=base, api_key=key)
    data = [datum(base, key, PROMPT, a) for a in ANSWERS]
    alone = client.create_lora_training_client(base_model=model, rank=8, seed=11)
    lone = train([(alone, data[0])], steps)[0]
    runs = [client.create_lora_training_client(base_model=model, rank=8, seed=11 + i)
            for i in range(len(ANSWERS))]
    together = train(list(zip(runs, data)), steps)
    cross = [[run.forward([d], "cross_entropy").result().metrics["loss:sum"] for d in data]
             for run in runs]
    print(json.dumps({"alone": lone, "together": together, "cross": cross}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
