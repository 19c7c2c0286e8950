"""Runs in the `tinker` virtual environment: against the server argv[1] with the key argv[2], a
`ServiceClient` creates a LoRA training client on the served model argv[3] (rank 8, the attention
and MLP projections) and reads its info; a second, with the SDK's defaults (LoRA on the LM head
too), is refused. Prints one JSON line: the run's id and info, the session's runs, the key's runs
and the run as a `RestClient` reads them, and the refusal's message."""

import json
import sys

import tinker


def main(base, key, model):
    client = tinker.ServiceClient(base_url=base, api_key=key)
    training = client.create_lora_training_client(
        base_model=model, rank=8, seed=7, train_unembed=False).result()
    info = training.get_info()
    session_id = client.holder.get_session_id()
    rest = tinker.RestClient(base_url=base, api_key=key)
    session = rest.get_session(session_id).result()
    listed = [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    one = rest.get_training_run(training.model_id).result()
    try:
        client.create_lora_training_client(base_model=model, rank=8).result()
        refused = None
    except Exception as e:  # noqa: BLE001 - the SDK's error type is what is reported
        refused = f"{type(e).__name__}: {e}"
    print(json.dumps({
        "model_id": training.model_id,
        "session_id": session_id,
        "info": info.model_dump(mode="json"),
        "session_runs": session.training_run_ids,
        "refused": refused,
        "listed": listed,
        "one": one.model_dump(mode="json"),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
