"""Runs that survive faults: every algorithm file stops cleanly on a fault injected in generation, in
reward scoring, as a NaN loss or a NaN score, and a run killed mid-way resumes to the same result as one
that was not."""

import importlib
import json
import signal

import psutil
import pytest
import torch
from conftest import SMALL_RUN, TINY, assert_resumed_run_matches, read_metrics, run_with_fault

SCRIPTS = ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"]
SMALL = ["--total_episodes", "512", "--local_micro_batch_size", "8", "--eval_freq", "4", "--num_eval_prompts", "32"]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("fault", ["generation:3", "scoring:3"])
def test_a_fault_surfaces_within_5_s_and_shuts_the_engine_down(script, fault, tmp_path):
    code, output, seconds, children = run_with_fault(script, fault, SMALL, tmp_path)
    print(f"{script} {fault}: exit {code} {seconds:.1f} s after the fault")
    assert code not in (0, None) and "Traceback" in output and "injected test fault in" in output, output[-3000:]
    assert seconds < 5, output[-3000:]
    assert children, "the engine should have been started"
    assert not psutil.wait_procs(children, timeout=10)[1], "processes left behind"
    assert not (tmp_path / "policy").exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(script, tmp_path):
    code, output, _, children = run_with_fault(script, "nan_loss:5", [*SMALL, "--save_freq", "2"], tmp_path)
    assert code not in (0, None) and "loss is nan at step 5" in output, output[-3000:]
    assert f"the last good one is {tmp_path}/checkpoints/step_000004" in output
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    train, _ = read_metrics(tmp_path)
    assert [m["step"] for m in train] == [0, 1, 2, 3, 4]  # the NaN step is not logged as if it were fine
    assert not psutil.wait_procs(children, timeout=10)[1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_nan_or_inf_scores_are_refused_naming_the_step_and_the_source(script):
    """The shared check, run right after scoring and before any pairing or advantage."""
    check_scores = importlib.import_module(script.removesuffix(".py")).check_scores
    check_scores(torch.tensor([0.5, -3.0, 0.0, 1e30]), "reward model --reward_model_path rm", 7)  # finite: goes on
    for bad, shown in [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf")]:
        with pytest.raises(RuntimeError) as error:
            check_scores(torch.tensor([0.5, bad, 0.0, 1.0]), "reward model --reward_model_path rm", 7)
        assert str(error.value) == f"reward model --reward_model_path rm gave nan/inf scores at step 7 (1 of 4 completions: {shown})"
    with pytest.raises(RuntimeError) as error:
        check_scores(torch.tensor([float("nan")] * 5 + [1.0]), "GSM8k's verifier", 0)
    assert str(error.value) == "GSM8k's verifier gave nan/inf scores at step 0 (5 of 6 completions: nan, nan, nan, nan, ...)"


def test_a_nan_score_stops_the_run_at_its_step_before_it_trains(tmp_path):
    """One whole run (online DPO; the check is the same text in the three files): one score of step 3 made NaN."""
    code, output, _, children = run_with_fault("online_dpo_async.py", "nan_score:3", SMALL, tmp_path)
    num_completions = json.loads((tmp_path / "args.json").read_text())["episodes_per_step"]
    message = f"reward model --reward_model_path {TINY / 'reward'} gave nan/inf scores at step 3 (1 of {num_completions} completions: nan)"
    assert code not in (0, None) and f"RuntimeError: {message}" in output, output[-3000:]
    train, _ = read_metrics(tmp_path)
    assert [m["step"] for m in train] == [0, 1, 2]  # step 3 is neither trained nor logged
    assert not (tmp_path / "policy").exists()
    assert not psutil.wait_procs(children, timeout=10)[1]


RESUMABLE = [*SMALL, "--save_freq", "5", "--async_level", "2"]
# PPO's with its own resume state in play (value model, adaptive KL, engine logprobs): test_ppo_resume.py shares the reference run
PPO_RESUMABLE = [*SMALL_RUN, "--save_freq", "5", "--async_level", "2", "--adaptive_kl", "--kl_target", "0.1", "--old_logprobs", "engine"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_killed_mid_way_resumes_exactly(script, tmp_path):
    """SIGKILL to the trainer and its engine after step 12; the run resumes from its step-10 checkpoint.
    async_level 2: the checkpoint must carry the two older policy versions the generator still owes batches from."""
    run, _ = assert_resumed_run_matches(script, PPO_RESUMABLE if script == "ppo_async.py" else RESUMABLE, tmp_path, stop_after=12, sig=signal.SIGKILL)
    num_steps = json.loads((run / "args.json").read_text())["num_steps"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{s:06d}" for s in range(5, num_steps, 5)]


def test_sigterm_writes_a_checkpoint_at_the_step_boundary_and_resumes_exactly(tmp_path):
    """Pre-emption: SIGTERM to the trainer only; it finishes its step, checkpoints, exits with 143."""
    run, _ = assert_resumed_run_matches("online_dpo_async.py", RESUMABLE, tmp_path, stop_after=7, sig=signal.SIGTERM)
    steps = sorted(json.loads(p.read_text())["step"] for p in (run / "checkpoints").glob("step_*/trainer_state.json"))
    assert steps[0] == 5 and 7 <= steps[1] < 10  # the --save_freq one, then the one written on SIGTERM
