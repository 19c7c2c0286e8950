"""Runs in the `tinker` virtual environment: saved state across a server kill, against the
server argv[1] with the key argv[2] on its model argv[3], in phase argv[4]. Phase "before": a
LoRA run takes 2 steps (forward_backward with cross_entropy + optim_step), saves its state
(`save_state`), then takes 2 more steps; prints the state's path and the loss of each of those 2
steps. Phase "after" (argv[5] the path; run on a restarted server over the same data directory):
`create_training_client_from_state_with_optimizer` makes a new run from the state, which takes
the same 2 steps; prints their losses, and what loading the state into a fresh run of another
rank answered, and the checkpoints a `RestClient` lists before and after deleting one."""

import json
import sys

import tinker
from tinker import types


def data():
    out = []
    for d in range(3):
        toks = [(d * 131 + i * 17) % 5000 + 200 for i in range(17)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:]}))
    return out


def step(run, batch):
    fb = run.forward_backward(batch, "cross_entropy")
    run.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return fb.result().metrics["loss:sum"]


def main(base, key, model, phase, path=None):
    client = tinker.ServiceClient(base_url=base, api_key=key)
    batch = data()
    if phase == "before":
        run = client.create_lora_training_client(
            base_model=model, rank=8, seed=2, train_unembed=False).result()
        for _ in range(2):
            step(run, batch)
        saved = run.save_state("two-steps").result().path
        losses = [step(run, batch) for _ in range(2)]
        print(json.dumps({"path": saved, "losses": losses}))
        return
    run = client.create_training_client_from_state_with_optimizer(path).result()
    losses = [step(run, batch) for _ in range(2)]
    other = client.create_lora_training_client(
        base_model=model, rank=4, seed=2, train_unembed=False).result()
    try:
        other.load_state(path).result()
        refused = None
    except Exception as e:  # noqa: BLE001 - the SDK's error type is what is reported
        refused = f"{type(e).__name__}: {e}"
    # The states a RestClient lists: the killed server's run's, then the new run's own, which
    # is deleted again.
    rest = tinker.RestClient(base_url=base, api_key=key)
    old_run = path[len("tinker://"):].split("/")[0]
    listed_old = [c.tinker_path for c in rest.list_checkpoints(old_run).result().checkpoints]
    mine = run.save_state("after-restart").result().path
    listed_new = [c.checkpoint_id
                  for c in rest.list_checkpoints(run.model_id).result().checkpoints]
    rest.delete_checkpoint_from_tinker_path(mine).result()
    after_delete = [c.checkpoint_id
                    for c in rest.list_checkpoints(run.model_id).result().checkpoints]
    print(json.dumps({"losses": losses, "info": run.get_info().model_dump(mode="json"),
                      "refused": refused, "listed_old": listed_old, "listed_new": listed_new,
                      "after_delete": after_delete}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
