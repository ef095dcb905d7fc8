"""rloo_async.py end to end, as a user runs it (subprocesses, real engine, tiny task). The runs are the README's
examples with the tests' smaller sizes (tests/test_docs.py runs the same commands and shares them)."""

import math
import shutil
import sys

import pytest
from conftest import ROOT, SMALL_RUN, assert_default_run_learns, check_run, run_script, shared_run

from dev import copies

PYTHON = sys.executable


@pytest.mark.xdist_group("rloo_small")
def test_async_1_keeps_the_lag_invariant_and_the_on_policy_ratio():
    """The README's `rloo_async.py` example."""
    args, train, _ = check_run(shared_run([PYTHON, "rloo_async.py", *SMALL_RUN]), "rloo_async.py")
    assert args["async_level"] == 1 and args["episodes_per_step"] == 8 * 2 and args["num_steps"] == 16
    # one mini-batch, one epoch: the only update meets the data with old logprobs from the same weights
    for m in train:
        assert m["policy/clipfrac"] == 0.0
        assert abs(m["policy/ratio_max"] - 1) < 1e-5 and abs(m["policy/ratio_min"] - 1) < 1e-5, m["step"]
    assert "policy/correction_weight_mean" not in train[0]  # --old_logprobs trainer


@pytest.mark.slow
@pytest.mark.xdist_group("rloo_engine")
def test_engine_logprobs_with_truncated_importance_weights_at_async_2():
    """The README's `rloo_async.py --old_logprobs engine --async_level 2` example."""
    argv = [PYTHON, "rloo_async.py", "--old_logprobs", "engine", "--async_level", "2", *SMALL_RUN]
    args, train, _ = check_run(shared_run(argv), "rloo_async.py")
    assert args["old_logprobs"] == "engine" and args["num_steps"] == 16
    diffs = [m["policy/engine_logprob_diff"] for m in train]
    print("engine vs trainer |logprob diff| per token:", [f"{d:.1e}" for d in diffs])
    print("tis weight mean:", [f"{m['policy/correction_weight_mean']:.4f}" for m in train])
    # Step 0 (lag 0): engine and trainer hold the same float32 weights, so only numerics differ: a few float32 ulps
    # of logprobs of magnitude < 10 (docs/algorithms.md measured 3e-7 per token).
    assert diffs[0] < 1e-5 and abs(train[0]["policy/engine_kl"]) < 1e-5
    # Later steps compare the engine's theta_{n-lag} with the trainer's theta_n: the policy's change over 1 or 2 Adam
    # updates of lr <= 1e-4 shows, measured 1.1e-3 (the last steps, lr decayed) to 1.2e-2 per token: a hundred times
    # the numerics at least, and far below the nats that logprobs paired with the wrong tokens would give.
    assert min(diffs[1:]) > 1e-4 and max(diffs) < 0.05
    # The weights are min(exp(S), cap) per completion, S = sum_t (log pi_old - log mu) over its tokens: |w - 1| <= cap
    # |S| (below 1 it is at most |S|; up to the cap, exp(S) - 1 <= S exp(S); at it, cap - 1 <= cap log cap <= cap S),
    # so their mean is within cap x mean_i sum_t |log pi_old - log mu| <= cap x response_length x
    # policy/engine_logprob_diff of 1; and a weight is capped only where |S| > log cap, so at most a fraction
    # response_length x policy/engine_logprob_diff / log cap of them (Markov). Weights computed from other logprobs
    # than the ones compared break these.
    cap, length = args["tis_cap"], args["response_length"]
    for m in train:
        bound = length * m["policy/engine_logprob_diff"]
        assert abs(m["policy/correction_weight_mean"] - 1) <= cap * bound + 1e-6, m["step"]
        assert m["policy/correction_truncated_frac"] <= bound / math.log(cap), m["step"]
    assert (
        train[0]["policy/correction_truncated_frac"] == 0.0
        and abs(train[0]["policy/correction_weight_mean"] - 1) < 1e-5
    )


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    assert_default_run_learns("rloo_async.py", tmp_path)


@pytest.mark.slow
@pytest.mark.xdist_group("rloo_small")
def test_a_fork_is_a_copy_with_its_own_method_section(tmp_path):
    """Forking a file into a new method, as docs/algorithms.md#forking-a-file says, in a copy of the repository: copy
    rloo_async.py to a new name, change its method section (here plain REINFORCE with the leave-one-out baseline, no
    ratio clipping), add it to dev/copies.py's one list. The copies command finds its shared text the source's; a
    change to the source's shared text is then rewritten into the fork too; and the fork runs on the tiny task to the
    end, with a loss of its own (the same rollouts as RLOO's run, another loss)."""
    repository = tmp_path / "repository"
    repository.mkdir()
    for name in ("plumbing", "tasks", "dev"):
        shutil.copytree(ROOT / name, repository / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in copies.ALGORITHM_FILES:
        shutil.copy(ROOT / name, repository / name)
    source = (ROOT / "rloo_async.py").read_text()
    method = copies.split(source, "rloo_async.py")[0]
    clipped = "    objective = torch.min(unclipped, clipped)\n"
    assert method.count(clipped) == 1  # the change is in the method's section, above the banner
    (repository / "reinforce_async.py").write_text(
        source.replace(clipped, "    objective = advantages * logps  # REINFORCE\n")
    )
    listed = f"ALGORITHM_FILES = {copies.ALGORITHM_FILES!r}"
    tool = repository / "dev" / "copies.py"
    assert tool.read_text().count(listed.replace("'", '"')) == 1
    tool.write_text(tool.read_text().replace('ppo_async.py"]', 'ppo_async.py", "reinforce_async.py"]'))
    check = run_script([PYTHON, "dev/copies.py", "--check"], cwd=repository)
    assert "rloo_async.py, ppo_async.py, reinforce_async.py is online_dpo_async.py's" in check.stdout
    dpo = repository / "online_dpo_async.py"
    dpo.write_text(dpo.read_text().replace("# == Data: prompts, batches", "# == Data: the prompts, the batches"))
    rewritten = run_script([PYTHON, "dev/copies.py"], cwd=repository).stdout.splitlines()
    assert [line.split(":")[0] for line in rewritten] == ["rloo_async.py", "ppo_async.py", "reinforce_async.py"]
    assert "# == Data: the prompts, the batches" in (repository / "reinforce_async.py").read_text()
    run_script([PYTHON, "reinforce_async.py", *SMALL_RUN, "--output_dir", str(tmp_path / "run")], cwd=repository)
    _, train, _ = check_run(tmp_path / "run", "rloo_async.py")
    _, original, _ = check_run(shared_run([PYTHON, "rloo_async.py", *SMALL_RUN]), "rloo_async.py")
    assert train[0]["loss/policy"] != original[0]["loss/policy"]
    assert train[0]["objective/scores"] == original[0]["objective/scores"]  # the same rollouts: only the loss changed
