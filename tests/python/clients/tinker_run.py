"""Runs in the `tinker` virtual environment: against the server argv[1] with the key argv[2], a
`ServiceClient` creates a LoRA training client on the served model argv[3] (rank 8, the attention
and MLP projections) and reads its info; a second, with the SDK's defaults (LoRA on the LM head
too). Prints one JSON line: the run's id and info, the session's runs, the key's runs and the run
as a `RestClient` reads them, and the second run's id and info."""

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
    defaults = client.create_lora_training_client(base_model=model, rank=8)
    print(json.dumps({
        "model_id": training.model_id,
        "session_id": session_id,
        "info": info.model_dump(mode="json"),
        "session_runs": session.training_run_ids,
        "defaults_id": defaults.model_id,
        "defaults_info": defaults.get_info().model_dump(mode="json"),
        "listed": listed,
        "one": one.model_dump(mode="json"),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
