"""Runs in the `tinker` virtual environment: sampling as the Tinker cookbook's RL loop does it,
against the server argv[1] with the key argv[2] on its model argv[3]. A LoRA run takes one
supervised step (so its adapter is not the identity), publishes its weights for sampling
(`save_weights_and_get_sampling_client`, and by name with `save_weights_for_sampler`), samples
4 sequences at temperature 1 with the prompt's log-probs, then scores prompt + each sample with
`forward` on the same run. With argv[4] "oft", the run is OFT (our extension, asked for through
`user_metadata`; rank 32 is its block size; no LM head). Prints one JSON line: the run's info, the samples, their log-probs, the forward's
log-probs at the same positions, the prompt's log-probs both ways, and what a chat completion
with the sampler path as `model` answered."""

import json
import sys
import urllib.request

import tinker
from tinker import types


def post(base, key, path, body):
    req = urllib.request.Request(
        f"{base}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def main(base, key, model, method="lora"):
    client = tinker.ServiceClient(base_url=base, api_key=key)
    if method == "oft":
        training = client.create_lora_training_client(
            base_model=model, rank=32, seed=3, train_unembed=False,
            user_metadata={"flywheel.adapter": "oft"}).result()
    else:
        training = client.create_lora_training_client(
            base_model=model, rank=8, seed=3).result()
    prompt = post(base, key, "/tokenize", {"prompt": "The capital of France is"})["tokens"]
    full = prompt + post(base, key, "/tokenize", {"prompt": " Paris."})["tokens"][-3:]
    step = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:]})
    training.forward_backward([step], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    sampler = training.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt), num_samples=4,
        sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=11),
        include_prompt_logprobs=True).result()
    named = training.save_weights_for_sampler("after-one-step").result().path
    again = client.create_sampling_client(model_path=named).result().sample(
        prompt=types.ModelInput.from_ints(prompt), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()

    seqs = [list(map(int, s.tokens)) for s in out.sequences]
    data = []
    for toks in seqs:
        whole = prompt + toks
        data.append(types.Datum(model_input=types.ModelInput.from_ints(whole[:-1]),
                                loss_fn_inputs={"target_tokens": whole[1:]}))
    fwd = training.forward(data, "cross_entropy").result()
    forward_lps = [list(map(float, o["logprobs"].data))[len(prompt) - 1:]
                   for o in fwd.loss_fn_outputs]
    chat = post(base, key, "/v1/chat/completions", {
        "model": named, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    print(json.dumps({
        "info": training.get_info().model_dump(mode="json"),
        "samples": seqs,
        "stop_reasons": [s.stop_reason for s in out.sequences],
        "sample_logprobs": [list(map(float, s.logprobs)) for s in out.sequences],
        "forward_logprobs": forward_lps,
        "prompt_logprobs": out.prompt_logprobs,
        "forward_prompt_logprobs": list(map(float, fwd.loss_fn_outputs[0]["logprobs"].data))[
            :len(prompt) - 1],
        "named_path": named,
        "named_sample": [list(map(int, s.tokens)) for s in again.sequences],
        "chat_model": chat["model"],
        "eos": post(base, key, "/tokenize", {"prompt": ""}),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:5])
