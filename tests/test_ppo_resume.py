"""PPO's own resume state: the value model, the adaptive KL coefficient and the optimizer over policy and
value parameters. A run stopped with SIGTERM and resumed matches an uninterrupted one, value model included."""

import signal

import torch
from conftest import assert_resumed_run_matches
from safetensors.torch import load_file
from test_faults_and_resume import PPO_RESUMABLE


def test_sigterm_and_resume_restore_the_value_model_and_the_kl_coefficient(tmp_path):
    run, reference = assert_resumed_run_matches(
        "ppo_async.py", PPO_RESUMABLE, tmp_path, stop_after=7, sig=signal.SIGTERM
    )
    last = sorted(p.name for p in (reference / "checkpoints").glob("step_*"))[-1]
    assert last == "step_000030" and (run / "checkpoints" / last).is_dir()
    # accelerate's save_state: the registered objects are the scheduler (0), the progress (1) and the KL coefficient (2)
    steps = sorted(
        torch.load(p, weights_only=False)["step"] for p in (run / "checkpoints").glob("step_*/custom_checkpoint_1.pkl")
    )
    assert steps[0] == 5 and 7 <= steps[1] < 10 and steps[2:] == [10, 15, 20, 25, 30]  # SIGTERM's at the step boundary
    checkpoints = [r / "checkpoints" / last for r in (run, reference)]
    # the prepared model is PolicyAndValue: its weights are the policy's and the value model's
    resumed, expected = (load_file(c / "model.safetensors") for c in checkpoints)
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)
    assert {k.split(".")[0] for k in expected} == {"policy", "value_model"} and "value_model.score.weight" in expected
    resumed, expected = (torch.load(c / "optimizer.bin", weights_only=True) for c in checkpoints)
    assert resumed["param_groups"] == expected["param_groups"] and resumed["state"].keys() == expected["state"].keys()
    for i, state in expected["state"].items():
        assert all(torch.equal(resumed["state"][i][k], v) for k, v in state.items()), i
    coefs = [torch.load(c / "custom_checkpoint_2.pkl", weights_only=False)["kl_coef"] for c in checkpoints]
    assert coefs[0] == coefs[1] != 0.05  # the controller moved it, and the resume carried it on
    # the final policy/ is the causal LM alone (what transformers and vLLM load), without the value model
    policy = load_file(reference / "policy" / "model.safetensors")
    assert not any(k.startswith(("policy.", "value_model.", "score.")) for k in policy)
