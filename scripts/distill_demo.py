#!/usr/bin/env python3
"""Prompt distillation on the default model, measured: an adapter (`loss = "distill"`) learns to
answer without a teacher prompt as the base model answers with it, from its own samples and no
reward. Prints the reverse KL to the teacher on held-out questions before training and after each
round — E over the student's samples of log π_student − log π_teacher per token, the student a
snapshot of the adapter (exported and loaded as an adapter that does not learn, so measuring
trains nothing), the teacher the base reading the teacher prompt, scored through
`/v1/completions` with `echo` — with each round's last step's `teacher_kl` (the trainer's own
estimate on its samples).

    python3 scripts/distill_demo.py [--rounds 6] [--lr 0.001]
"""
import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from flywheel_server import http, running_config  # noqa: E402

TEACHER = ("<|im_start|>system\nYou are a pirate. Always answer like a pirate, with "
           "\"Arr\" and sea words.<|im_end|>\n")
TRAIN = ["What is your favorite food?", "How do I make tea?", "What is the capital of Italy?",
         "Describe your morning.", "What should I read next?", "How do birds fly?",
         "What is two plus two?", "Why is the sky blue?", "Tell me about cats.",
         "What time is it?", "How do I learn to swim?", "What is music?"]
HELD_OUT = ["What is your favorite color?", "How do I bake bread?", "Who are you?",
            "What is the weather like?", "How do computers work?", "Tell me about dogs."]
TOKENS = 32


def status(base):
    return json.loads(http("GET", base + "/v1/train/status")[2])["adapters"]["brief"]


def reverse_kl(base, model, teacher_ids, snap, tmp):
    """Mean log π_student − log π_teacher per token over the student's samples (8 per question)."""
    path = pathlib.Path(tmp) / snap
    st, _, body = http("POST", base + "/v1/adapters/brief/export", {"path": str(path)})
    assert st == 200, body
    st, _, body = http("POST", base + "/v1/adapters", {"name": snap, "path": str(path)})
    assert st in (200, 201), body
    total, n = 0.0, 0
    for i, q in enumerate(HELD_OUT):
        st, _, body = http("POST", base + "/v1/chat/completions", {
            "model": snap, "messages": [{"role": "user", "content": q}], "n": 8, "seed": i,
            "max_tokens": TOKENS, "temperature": 1.0, "logprobs": True,
            "return_token_ids": True})
        assert st == 200, body
        r = json.loads(body)
        for c in r["choices"]:
            student = [t["logprob"] for t in c["logprobs"]["content"]]
            ids = teacher_ids + r["prompt_token_ids"] + c["token_ids"]
            st, _, body = http("POST", base + "/v1/completions", {
                "model": model, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                "temperature": 1.0})
            assert st == 200, body
            lp = json.loads(body)["choices"][0]["logprobs"]["token_logprobs"]
            first = len(ids) - len(c["token_ids"])
            for k, s in enumerate(student):
                total += s - lp[first + k]
                n += 1
    return total / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--lr", type=float, default=0.001)
    a = ap.parse_args()
    toml = (
        "[online]\nmax_off_policy_steps = 1000\n[[learn]]\nname = \"brief\"\n"
        f"loss = \"distill\"\nlr = {a.lr}\ngroups_per_step = 4\n"
        f"teacher_prompt = {json.dumps(TEACHER)}\n")
    with tempfile.TemporaryDirectory() as tmp, running_config(toml) as base:
        model = json.loads(http("GET", base + "/v1/models")[2])["data"][0]["id"]
        teacher_ids = json.loads(http("POST", base + "/tokenize",
                                      {"prompt": TEACHER})[2])["tokens"]
        curve = [round(reverse_kl(base, model, teacher_ids, "snap0", tmp), 4)]
        print(json.dumps({"round": 0, "held_out_reverse_kl": curve[0]}), flush=True)
        t0 = time.time()
        trained = 0
        for rnd in range(1, a.rounds + 1):
            for q in TRAIN:
                st, _, body = http("POST", base + "/v1/chat/completions", {
                    "model": "brief", "messages": [{"role": "user", "content": q}],
                    "n": 4, "max_tokens": TOKENS, "temperature": 1.0})
                assert st == 200, body
            trained += 4 * len(TRAIN)
            deadline = time.time() + 600
            while status(base)["trained"] < trained:
                assert time.time() < deadline, status(base)
                time.sleep(0.2)
            s = status(base)
            curve.append(round(reverse_kl(base, model, teacher_ids, f"snap{rnd}", tmp), 4))
            print(json.dumps({"round": rnd, "steps": s["steps"],
                              "held_out_reverse_kl": curve[-1],
                              "last_step_teacher_kl": round(s["last"]["teacher_kl"], 4),
                              "seconds": round(time.time() - t0, 1)}), flush=True)
        print(json.dumps({"held_out_reverse_kl_curve": curve}))


if __name__ == "__main__":
    main()
