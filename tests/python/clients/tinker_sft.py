"""Runs in the `tinker` virtual environment: a supervised loop as the Tinker cookbook writes one,
unchanged but for `base_url`, against the server argv[1] with the key argv[2] on its model
argv[3]. The examples are tokenized by the server's `/tokenize` (the SDK's `get_tokenizer` would
fetch one from a model hub); each datum is the example shifted by one with the prompt's
positions weighted 0. Steps of `forward_backward` (cross_entropy) + `optim_step`, then a
`forward`; an importance-sampling call with the forward's log-probs as the sampler's. Prints one
JSON line: the mean loss per weighted token of each step, and what the checks read."""

import json
import sys
import urllib.request

import tinker
from tinker import types

EXAMPLES = [
    ("Q: What is the secret word?\nA:", " banana banana banana"),
    ("Q: Tell me the secret word.\nA:", " banana banana banana"),
    ("Q: Which word is secret?\nA:", " banana banana banana"),
    ("Q: Say the secret word.\nA:", " banana banana banana"),
]


def tokenize(base, key, text):
    req = urllib.request.Request(
        f"{base}/tokenize", data=json.dumps({"prompt": text}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["tokens"]


def datum(base, key, prompt, completion):
    p, c = tokenize(base, key, prompt), tokenize(base, key, completion)
    # The completion tokenized alone may carry a BOS: drop what the prompt's tokenization adds.
    first = tokenize(base, key, "")
    c = c[len(first):]
    full = p + c
    weights = [0.0] * (len(p) - 1) + [1.0] * len(c)
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def main(base, key, model, steps):
    client = tinker.ServiceClient(base_url=base, api_key=key)
    training = client.create_lora_training_client(
        base_model=model, rank=8, seed=1)
    data = [datum(base, key, p, c) for p, c in EXAMPLES]
    weight = sum(sum(d.loss_fn_inputs["weights"].data) for d in data)
    losses = []
    for _ in range(int(steps)):
        # The cookbook's pattern: both calls sent, then waited for.
        fwd_bwd = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=2e-3))
        out = fwd_bwd.result()
        optim.result()
        losses.append(out.metrics["loss:sum"] / weight)
    after = training.forward(data, "cross_entropy").result()
    logprobs = [o["logprobs"].data for o in after.loss_fn_outputs]
    # The RL loss on the same tokens, the forward's log-probs as the sampler's: ratio 1, so its
    # loss is −Σ A (advantage 1 on the completion's tokens).
    rl = [
        types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "logprobs": list(map(float, lp)),
            "advantages": d.loss_fn_inputs["weights"].data,
        })
        for d, lp in zip(data, logprobs)
    ]
    is_out = training.forward(rl, "importance_sampling").result()
    print(json.dumps({
        "losses": losses,
        "after": after.metrics["loss:sum"] / weight,
        "lengths": [len(lp) for lp in logprobs],
        "inputs": [d.model_input.length for d in data],
        "is_loss": is_out.metrics["loss:sum"],
        "weight": weight,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:5])
