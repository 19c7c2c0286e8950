"""Runs in the `tinker` virtual environment (with torch, which the SDK's forward_backward_custom
needs): against the server argv[1] with the key argv[2] on its model argv[3], a loss the server
does not know, L = Σ_d (Σ_t w_t · logprob_t)² / T_d (per datum: the square of its weighted
log-likelihood over its length), trained through `forward_backward_custom` as the SDK drives it
(a forward, torch's gradient of L with respect to the log-probs, a backward weighted by it).
Beside it, a second run of the same seed does by hand, in f64 with numpy, what that must amount
to: `forward`, dL/dlogprob computed exactly, `forward_backward` with cross_entropy weighted by
−dL/dlogprob. Prints one JSON line: L as the SDK reported it and in f64 from the forward's
log-probs; both runs' gradient norms (from optim_step); how far their log-probs are apart after
the step, against how far the step moved them; L over further custom steps."""

import json
import sys

import numpy as np
import tinker
from tinker import types

from tinker_sft import EXAMPLES, datum


def weights_of(d):
    return np.asarray(d.loss_fn_inputs["weights"].data, dtype=np.float64)


def loss_f64(data, logprobs):
    """L and dL/dlogprob, in f64."""
    total, grads = 0.0, []
    for d, lp in zip(data, logprobs, strict=True):
        w, lp = weights_of(d), np.asarray(lp, dtype=np.float64)
        s = float(np.dot(w, lp))
        total += s * s / len(lp)
        grads.append(2.0 * s * w / len(lp))
    return total, grads


def custom(data, logprobs_list):
    loss = sum(((d.loss_fn_inputs["weights"].to_torch() * lp).sum() ** 2) / lp.numel()
               for d, lp in zip(data, logprobs_list, strict=True))
    return loss, {"custom:sum": float(loss.detach())}


def logprobs(run, data):
    out = run.forward(data, "cross_entropy").result()
    return [o["logprobs"].data for o in out.loss_fn_outputs]


def main(base, key, model, steps):
    client = tinker.ServiceClient(base_url=base, api_key=key)
    make = lambda: client.create_lora_training_client(  # noqa: E731
        base_model=model, rank=8, seed=3, train_unembed=False)
    a, b = make(), make()
    data = [datum(base, key, p, c) for p, c in EXAMPLES]
    adam = types.AdamParams(learning_rate=2e-3)

    before = logprobs(a, data)
    reported = a.forward_backward_custom(data, custom).result()
    step_a = a.optim_step(adam).result()

    # By hand on run b: the same seed, so the same weights before the step.
    assert logprobs(b, data) == before
    want, grads = loss_f64(data, before)
    weighted = [types.Datum(model_input=d.model_input,
                            loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                            "weights": (-g).astype(np.float32).tolist()})
                for d, g in zip(data, grads, strict=True)]
    b.forward_backward(weighted, "cross_entropy").result()
    step_b = b.optim_step(adam).result()
    after_a, after_b = logprobs(a, data), logprobs(b, data)
    gap = max(abs(x - y) for u, v in zip(after_a, after_b, strict=True)
              for x, y in zip(u, v, strict=True))
    moved = max(abs(x - y) for u, v in zip(after_a, before, strict=True)
                for x, y in zip(u, v, strict=True))

    losses = [want]
    for _ in range(steps):
        a.forward_backward_custom(data, custom).result()
        a.optim_step(adam).result()
        losses.append(loss_f64(data, logprobs(a, data))[0])
    print(json.dumps({
        "reported": reported.metrics, "want": want,
        "grad_norm_custom": step_a.metrics["grad_norm:mean"],
        "grad_norm_by_hand": step_b.metrics["grad_norm:mean"],
        "gap_after_step": gap, "moved_by_step": moved, "losses": losses,
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
