"""PPO's own resume state: the value model, the adaptive KL coefficient and the optimizer over policy and
value parameters. A run stopped with SIGTERM and resumed matches an uninterrupted one, value model included."""

import json
import signal

import torch
from conftest import assert_resumed_run_matches
from safetensors.torch import load_file
from test_faults_and_resume import PPO_RESUMABLE


def test_sigterm_and_resume_restore_the_value_model_and_the_kl_coefficient(tmp_path):
    run, reference = assert_resumed_run_matches("ppo_async.py", PPO_RESUMABLE, tmp_path, stop_after=7, sig=signal.SIGTERM)
    last = sorted(p.name for p in (reference / "checkpoints").glob("step_*"))[-1]
    assert last == "step_000030" and (run / "checkpoints" / last).is_dir()
    steps = sorted(json.loads(p.read_text())["step"] for p in (run / "checkpoints").glob("step_*/trainer_state.json"))
    assert steps[0] == 5 and 7 <= steps[1] < 10 and steps[2:] == [10, 15, 20, 25, 30]  # SIGTERM's at the step boundary
    for name in ("value/model.safetensors", "optimizer.safetensors"):
        resumed, expected = load_file(run / "checkpoints" / last / name), load_file(reference / "checkpoints" / last / name)
        assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected), name
    states = [json.loads((r / "checkpoints" / last / "trainer_state.json").read_text()) for r in (run, reference)]
    assert states[0]["kl_coef"] == states[1]["kl_coef"] != 0.05  # the controller moved it, and the resume carried it on
    assert states[0]["optimizer"] == states[1]["optimizer"]
    # the checkpoint's policy/ is the causal LM alone (what transformers and vLLM load); value/ the value model alone
    policy = load_file(reference / "checkpoints" / last / "policy" / "model.safetensors")
    value = load_file(reference / "checkpoints" / last / "value" / "model.safetensors")
    assert not any(k.startswith(("policy.", "value_model.")) for k in [*policy, *value])
    assert any(k.startswith("score.") for k in value) and not any(k.startswith("score.") for k in policy)
