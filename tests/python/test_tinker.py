"""Thinking Machines' Tinker SDK (`tinker` 0.38, the official client, unchanged) against
Flywheel's Tinker API. The SDK pins its own dependencies, so it runs in its own virtual
environment, `$FLYWHEEL_TINKER_VENV` (scripts/test makes it, by default in
`~/.cache/flywheel/tinker-0.38.0-venv`, outside the checkout); skipped without it.

Checked so far, with the SDK's telemetry on as users run it: a `RestClient` with a `tml-` key
lists the served model (trainable and sampleable); a
`ServiceClient` reads the server's flags and opens a session whose heartbeats the server records,
and the `RestClient` reads it back; the session is the key's alone; another key is refused. A
LoRA training client is created on the served model (`create_model` through a future,
`get_info`) with the id the SDK computes, and listed in its session; a second with the SDK's
defaults (LoRA on the LM head too). A supervised loop as the cookbook writes it, on the SDK's
defaults (`forward_backward`
with cross_entropy, `optim_step`, futures awaited as the SDK does) lowers the loss on the served
4-bit base. Four runs trained at once each learn their own answer, and the first takes the very
losses it takes alone. Sampling from a run's published weights returns, for every sampled token, the very
log-prob `forward` computes for it on the same run (to the bit), and the prompt's log-probs the
same way; the sampler path also serves as `model` on chat completions. An RL loop
(importance_sampling on the brevity task, the cookbook's pattern) raises the reward. A custom
loss (`forward_backward_custom`, torch in the client) trains through its exact gradient. A saved
state survives a kill -9 of the server."""

import json
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from flywheel_server import MODEL, ROOT, http, running, venv_python  # noqa: E402

VENV_PY = venv_python("FLYWHEEL_TINKER_VENV", "tinker-0.38.0-venv",
                      "the tinker SDK pins its own dependencies")

KEY = "tml-flywheel-test"
ADMIN = "tml-flywheel-admin"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The module's clients open some 40 runs (a session's runs end only when it has been silent
    # for 5 minutes): room for them beside each other (runs hold twice max_adapter_params).
    # Its own data directory: sessions and runs are kept there across restarts, and another
    # run's would be brought back here.
    tmp = tmp_path_factory.mktemp("tinker")
    cfg = tmp / "serve.toml"
    cfg.write_text("[limits]\nmax_adapter_params = 150000000\n")
    args = ["--api-key", KEY, "--admin-key", ADMIN, "--config", str(cfg),
            "--data-dir", str(tmp / "data")]
    with running(args) as url:
        yield url


def sdk(server, key):
    return subprocess.run(
        [str(VENV_PY), str(ROOT / "tests/python/clients/tinker_session.py"), server, key],
        capture_output=True, text=True, timeout=120)


def test_a_service_client_opens_a_session_and_sees_the_model(server):
    out = sdk(server, KEY)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    st, _, body = http("GET", f"{server}/v1/models", key=KEY)
    context = json.loads(body)["data"][0]["max_model_len"]
    assert got["models"] == [{"model_name": MODEL.stem, "max_context_length": context,
                              "trainable": True, "sampleable": True}]
    sid = got["session_id"]
    assert got["session"] == {"training_run_ids": [], "sampler_ids": [], "user_metadata": {},
                              "display_name": None}
    # The session is the key's, and the SDK's heartbeat (every 10 s) reached it.
    st, _, body = http("GET", f"{server}/api/v1/sessions/{sid}", key=KEY)
    assert st == 200, body
    s = json.loads(body)
    assert s["training_run_ids"] == [] and s["sampler_ids"] == []
    assert s["last_heartbeat_at"] > s["created_at"], s
    # Another key (the admin's, also accepted here) does not see it; an unknown key is refused.
    st, _, _ = http("GET", f"{server}/api/v1/sessions/{sid}", key=ADMIN)
    assert st == 404
    st, _, _ = http("GET", f"{server}/api/v1/sessions/{sid}", key="tml-someone-else")
    assert st == 401
    st, _, body = http("POST", f"{server}/api/v1/session_heartbeat",
                       {"session_id": "session-nope"}, key=KEY)
    assert st == 404 and json.loads(body)["error"]["code"] == "session_not_found"


def test_a_training_client_is_created_on_the_served_model(server):
    out = subprocess.run(
        [str(VENV_PY), str(ROOT / "tests/python/clients/tinker_run.py"), server, KEY, MODEL.stem],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # The id the SDK computes from its session and its count of training clients.
    assert got["model_id"] == f"{got['session_id']}:train:0"
    info = got["info"]
    assert info["model_id"] == got["model_id"] and info["is_lora"] and info["lora_rank"] == 8
    assert info["model_data"]["model_name"] == MODEL.stem
    assert info["model_data"]["arch"] == "llama"
    assert got["session_runs"] == [got["model_id"]]
    assert got["model_id"] in got["listed"]
    assert got["one"]["training_run_id"] == got["model_id"] and got["one"]["lora_rank"] == 8
    # The SDK's defaults (LoRA on the LM head too) make the session's second run.
    assert got["defaults_id"] == f"{got['session_id']}:train:1", got
    assert got["defaults_info"]["is_lora"] and got["defaults_info"]["lora_rank"] == 8


def test_a_key_the_server_does_not_know_is_refused(server):
    out = sdk(server, "tml-wrong")
    assert out.returncode != 0
    assert "401" in out.stderr or "Unauthorized" in out.stderr or "AuthenticationError" in out.stderr, \
        out.stderr[-2000:]


def test_a_supervised_loop_lowers_the_loss(server):
    steps = 6
    out = subprocess.run(
        [str(VENV_PY), str(ROOT / "tests/python/clients/tinker_sft.py"), server, KEY, MODEL.stem,
         str(steps)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print("tinker supervised loop:", json.dumps(got))
    losses = got["losses"]
    assert len(losses) == steps and all(x > 0 for x in losses), losses
    # Memorizing one answer: the loss per weighted token falls by more than half.
    assert got["after"] < 0.5 * losses[0], got
    assert got["lengths"] == got["inputs"], got
    # importance_sampling at ratio 1 with advantage 1 on the weighted tokens: −(their count).
    assert abs(got["is_loss"] + got["weight"]) < 1e-3 * got["weight"], got


def client(server, script, *args, timeout=600):
    # -X faulthandler: a native crash (the client once died of SIGABRT, torch and the SDK's
    # threads in one process) prints every thread's Python stack.
    out = subprocess.run(
        [str(VENV_PY), "-X", "faulthandler", str(ROOT / "tests/python/clients" / script), server,
         KEY, MODEL.stem, *map(str, args)],
        capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout[-1000:], out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["lora", "oft"])
def test_samples_carry_the_log_probs_training_computes(server, method):
    got = client(server, "tinker_sample.py", method)
    assert got["info"]["is_lora"] == (method == "lora"), got["info"]
    assert len(got["samples"]) == 4 and all(got["samples"]), got
    assert set(got["stop_reasons"]) <= {"stop", "length"}
    # Train = serve: each sampled token's log-prob is forward's for the same tokens and weights,
    # to the bit (floats through JSON round-trip exactly).
    for sampled, forward in zip(got["sample_logprobs"], got["forward_logprobs"], strict=True):
        assert sampled == forward, (sampled, forward)
    assert got["prompt_logprobs"][0] is None
    assert got["prompt_logprobs"][1:] == got["forward_prompt_logprobs"]
    run_path = got["named_path"]
    assert run_path.startswith("tinker://session-") and \
        run_path.endswith(":train:0/sampler_weights/after-one-step"), run_path
    assert len(got["named_sample"][0]) == 4
    assert got["chat_model"] == run_path[len("tinker://"):]


def test_runs_at_once_each_learn_their_own_answer_unaffected_by_the_others(server):
    got = client(server, "tinker_many.py", 5)
    print("tinker runs at once:", json.dumps(got))
    alone, together, cross = got["alone"], got["together"], got["cross"]
    # The first of four runs trained at once takes, to the bit, the losses it takes alone (same
    # seed, same data): the others' calls change nothing of it.
    assert together[0] == alone, (together[0], alone)
    for i, losses in enumerate(together):
        assert losses[-1] < 0.5 * losses[0], (i, losses)
        # Each run's own answer is the one it learned: its loss there is its lowest.
        assert min(range(len(cross[i])), key=lambda j: cross[i][j]) == i, (i, cross[i])


def test_an_rl_loop_raises_the_reward(server):
    rewards = client(server, "tinker_rl.py", 5)["rewards"]
    print("tinker RL loop, mean reward per step:", rewards)
    assert len(rewards) == 5
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.25, rewards


def test_saved_state_survives_a_kill_of_the_server(tmp_path):
    """save_state, kill -9, restart over the same data directory: a run made from the state
    with its optimizer continues with the very losses the uninterrupted run had."""
    import flywheel_server

    args = ["--api-key", KEY, "--data-dir", str(tmp_path / "data")]
    script = str(ROOT / "tests/python/clients/tinker_state.py")
    proc, base = flywheel_server.start_server(args)
    try:
        out = subprocess.run([str(VENV_PY), script, base, KEY, MODEL.stem, "before"],
                             capture_output=True, text=True, timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert out.returncode == 0, out.stderr[-3000:]
    before = json.loads(out.stdout.strip().splitlines()[-1])
    proc, base = flywheel_server.start_server(args)
    try:
        out = subprocess.run([str(VENV_PY), script, base, KEY, MODEL.stem, "after",
                              before["path"]], capture_output=True, text=True, timeout=300)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert out.returncode == 0, out.stderr[-3000:]
    after = json.loads(out.stdout.strip().splitlines()[-1])
    print("tinker state across a kill:", before, after)
    assert before["path"].endswith(":train:0/weights/two-steps"), before
    # Training is deterministic and the state holds the adapter and AdamW whole: the same bits.
    assert after["losses"] == before["losses"], (before, after)
    assert after["info"]["lora_rank"] == 8
    # A run of another rank refuses the state, naming why.
    assert after["refused"] and "saved state" in after["refused"], after
    # Listed by the RestClient: the killed server's run's state, and a new one until deleted.
    assert after["listed_old"] == [before["path"]], after
    assert after["listed_new"] == ["weights/after-restart"], after
    assert after["after_delete"] == [], after


@pytest.fixture(scope="module")
def exact_server(tmp_path_factory):
    """A server with exact (f32) products: the custom loss's gradient is compared with one
    weighted by hand to 1e-5, closer than BF16's rounding of the upstream gradient keeps two
    weightings that differ in their last f32 bits (4.6e-5 apart, measured)."""
    tmp = tmp_path_factory.mktemp("tinker-exact")
    args = ["--api-key", KEY, "--admin-key", ADMIN, "--data-dir", str(tmp / "data"),
            "--precision", "exact"]
    with running(args) as url:
        yield url


def test_a_custom_loss_trains_through_its_exact_gradient(exact_server):
    """forward_backward_custom as the SDK drives it (torch in the client): the loss it reports is
    the f64 one, its step is the step of cross_entropy weighted by −dL/dlogprob computed in f64
    (same gradient norm, same log-probs after it, far closer than the step moved them), and the
    custom loss falls over steps."""
    if subprocess.run([str(VENV_PY), "-c", "import torch"], capture_output=True).returncode != 0:
        pytest.skip("no torch in the tinker environment (scripts/test installs it): the SDK's "
                    "forward_backward_custom needs it")
    got = client(exact_server, "tinker_custom.py", 4)
    print("tinker custom loss:", json.dumps(got))
    want = got["want"]
    assert abs(got["reported"]["loss:sum"] - want) <= 1e-5 * abs(want), got
    assert abs(got["reported"]["custom:sum"] - want) <= 1e-5 * abs(want), got
    gc, gh = got["grad_norm_custom"], got["grad_norm_by_hand"]
    assert gc > 0 and abs(gc - gh) <= 1e-5 * gh, got
    assert got["moved_by_step"] > 1e-3, got
    assert got["gap_after_step"] <= 1e-3 * got["moved_by_step"], got
    losses = got["losses"]
    assert losses[-1] < 0.5 * losses[0], losses
