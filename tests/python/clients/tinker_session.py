"""Runs in the `tinker` virtual environment (the official Tinker SDK and its own pins): against
the server named by argv[1], with the key argv[2] (which the SDK sends as `X-API-Key`), a
`RestClient` reads the server's capabilities, a `ServiceClient` opens a session and, past one
heartbeat, the `RestClient` reads that session back. Prints one JSON line: the session's id, the
models and the session as the SDK parsed them."""

import json
import sys
import time

import tinker


def main(base, key):
    rest = tinker.RestClient(base_url=base, api_key=key)
    caps = rest.get_server_capabilities().result()
    client = tinker.ServiceClient(base_url=base, api_key=key)
    # The session opens with the first client that needs one (a training or sampling client;
    # here, asked for directly). The SDK beats every 10 s; the calling test asks the server
    # whether it heard it.
    session_id = client.holder.get_session_id()
    time.sleep(11)
    session = rest.get_session(session_id).result()
    print(json.dumps({
        "session_id": session_id,
        "models": [m.model_dump() for m in caps.supported_models],
        "session": session.model_dump(),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:3])
