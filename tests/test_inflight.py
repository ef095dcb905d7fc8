"""In-flight weight updates (--inflight_updates, issue 54): the rule that starts each event beside the rollouts in
flight, the staleness check of every token's version, the flags' refusals, and runs that learn, stop with a frozen
push mid-update and resume exactly. The decoding itself (plumbing/inflight.py) is tested in test_engine.py (a push
between two segments) and test_plumbing.py (the segments' seeds)."""

import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, SMALL_RUN, assert_resumed_run_matches, read_metrics, run_script, run_with_fault, shared_run
from test_faults_and_resume import FROZEN_ENGINE_MINUTES, PROMPTLY

import online_dpo_async as dpo
import plumbing
from plumbing.flags import RunArgs, UsageError
from plumbing.inflight import check_inflight_flags

# In the tiny task a completion has at most 12 tokens: segments of 4 put up to two versions in one completion.
INFLIGHT = ["--inflight_updates", "--inflight_segment_tokens", "4"]


def in_flight(step: int, done: list[bool]) -> dpo.InFlight:
    """A rollout in flight whose sequences are done or not as `done` says."""
    sequences = [plumbing.Sequence([1], seed=0, max_tokens=4, salt=f"r{step}", done=d) for d in done]
    return dpo.InFlight(step, 0, np.arange(1), sequences, {})


def test_an_event_starts_only_once_the_rollouts_before_its_version_were_delivered_and_a_batch_has_room():
    """may_start, at k = 1 with batches of 2 prompts x 2 completions (4 sequences): rollout m needs version m - 1,
    which the trainer publishes after training on rollout m - 2; so it waits while rollout m - 2 is in flight, and
    joins rollout m - 1 once fewer than 4 sequences decode; an evaluation of version v waits for rollout v - 1 alone;
    a rollout at a checkpoint step starts only on an empty engine."""
    args = dpo.Args(async_level=1, local_micro_batch_size=2, num_samples=2, save_freq=0)
    sizes = dpo.compute_sizes(dpo.Args(async_level=1, local_micro_batch_size=2, total_episodes=64), world_size=1)
    assert sizes.batch_size * args.num_samples == 4
    rollout_5 = dpo.Event("rollout", 5, 4)
    decoding = lambda flights: sum(not s.done for f in flights for s in f.sequences)  # noqa: E731
    three_left = [in_flight(4, [True, False, False, False])]
    assert dpo.may_start(rollout_5, three_left, decoding(three_left), args, sizes)
    four_left = [in_flight(4, [False] * 4)]
    assert not dpo.may_start(rollout_5, four_left, decoding(four_left), args, sizes)  # no room
    behind = [in_flight(3, [True, True, True, False]), in_flight(4, [True] * 4)]
    assert not dpo.may_start(rollout_5, behind, decoding(behind), args, sizes)  # version 4 needs rollout 3 delivered
    assert not dpo.may_start(dpo.Event("eval", 4, 4), behind, 1, args, sizes)
    assert dpo.may_start(dpo.Event("eval", 4, 4), four_left, 4, args, sizes)  # rollout 4 is not needed for version 4
    assert dpo.may_start(rollout_5, [], 0, args, sizes)
    checkpointed = dpo.Args(async_level=1, local_micro_batch_size=2, num_samples=2, save_freq=5)
    assert not dpo.may_start(rollout_5, three_left, decoding(three_left), checkpointed, sizes)
    assert dpo.may_start(rollout_5, [], 0, checkpointed, sizes)
    assert dpo.may_start(dpo.Event("rollout", 6, 5), [in_flight(5, [True, False])], 1, checkpointed, sizes)


def rollout(step: int, version: int, token_versions) -> dpo.Rollout:
    return dpo.Rollout(step, version, np.arange(1), [[7] * len(v) for v in token_versions], None, {}, token_versions)


def test_the_staleness_check_refuses_a_token_older_than_k_versions_or_newer_than_its_step_and_logs_the_span():
    """Step 6 at k = 2 trains on rollout 6, started by version 4: tokens of versions 4 to 6 pass and their span is
    logged (min 4, max 6, mean of the 6 tokens 29 / 6); one of version 3, or of version 7, stops the run; a rollout
    started by another version too; without token versions (in-flight updates off) nothing is logged."""
    spans = dpo.check_staleness(rollout(6, 4, [[4, 4, 5], [5, 5, 6]]), 6, 2)
    assert spans == {
        "async/token_version_min": 4,
        "async/token_version_max": 6,
        "async/token_version_mean": pytest.approx(29 / 6),
    }
    with pytest.raises(RuntimeError, match=r"step 6 got tokens of versions 3 to 5, not 4 to 6"):
        dpo.check_staleness(rollout(6, 4, [[4, 3], [5]]), 6, 2)
    with pytest.raises(RuntimeError, match=r"step 6 got tokens of versions 4 to 7, not 4 to 6"):
        dpo.check_staleness(rollout(6, 4, [[4, 7]]), 6, 2)
    with pytest.raises(RuntimeError, match=r"step 6 got rollout 6 from policy version 5"):
        dpo.check_staleness(rollout(6, 5, [[5]]), 6, 2)
    assert dpo.check_staleness(rollout(1, 0, [[0, 1]]), 1, 2)["async/token_version_max"] == 1
    assert dpo.check_staleness(rollout(6, 4, [[4]])._replace(token_versions=None), 6, 2) == {}


def test_the_in_flight_flags_are_refused_in_one_line_where_they_cannot_work():
    """Its settings without its switch; `keep` (the default) under LoRA or with several engines, where no sequence
    would keep its KV: each a UsageError naming what to change."""
    with pytest.raises(UsageError, match=r"^--inflight_segment_tokens, --inflight_kv set in-flight updates, which"):
        check_inflight_flags(RunArgs(inflight_segment_tokens=4, inflight_kv="recompute"))
    with pytest.raises(UsageError, match=r"^--inflight_kv keep under --lora_rank: .* use --inflight_kv recompute$"):
        check_inflight_flags(RunArgs(inflight_updates=True, lora_rank=8))
    with pytest.raises(UsageError, match=r"^--inflight_kv keep with --vllm_num_engines > 1: .* recompute$"):
        check_inflight_flags(RunArgs(inflight_updates=True, vllm_num_engines=2))
    check_inflight_flags(RunArgs(inflight_updates=True, lora_rank=8, vllm_num_engines=2, inflight_kv="recompute"))
    check_inflight_flags(RunArgs())


def test_a_refused_in_flight_flag_stops_the_run_before_any_model_loads(tmp_path):
    """The file's own command line: one line on stderr, exit 1, no run folder written."""
    out = tmp_path / "run"
    argv = [sys.executable, "online_dpo_async.py", "--inflight_kv", "recompute", "--output_dir", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --inflight_kv set in-flight updates, which only --inflight_updates turns on"
    )
    assert not out.exists()


# The learning run: the tiny task at a third of the default episodes, where a default run has gained 0.10.
LEARNS = [*INFLIGHT, "--total_episodes", "4096"]


@pytest.mark.slow
def test_a_run_with_in_flight_updates_learns_and_each_batch_spans_the_versions_the_contract_allows():
    """Online DPO with in-flight updates at k = 1: the win rate rises by 0.10 or more; every batch after the first
    was started by version n - 1 and ends with tokens of version n (a push lands between two segments of most
    batches), none older than n - 1."""
    run = shared_run([sys.executable, "online_dpo_async.py", *LEARNS])
    train, evals = read_metrics(run)
    print("win rate", [round(e["eval/win_rate"], 3) for e in evals])
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10
    assert all(m["async/token_version_min"] == m["async/version"] == max(0, m["step"] - 1) for m in train)
    assert all(m["async/token_version_max"] <= m["step"] for m in train)
    spanning = [m for m in train if m["async/token_version_max"] == m["step"] > m["async/token_version_min"]]
    print(f"{len(spanning)} of {len(train)} batches hold tokens of two versions")
    assert len(spanning) > len(train) // 2
    assert all(m["async/token_version_min"] < m["async/token_version_mean"] < m["step"] for m in spanning)


# A run to stop: async level 2, a checkpoint every 5 steps, 32 steps.
RESUMABLE = [*INFLIGHT, "--total_episodes", "512", "--local_micro_batch_size", "8", "--eval_freq", "4"]
RESUMABLE += ["--num_eval_prompts", "32", "--save_freq", "5", "--async_level", "2"]


@pytest.mark.slow
@pytest.mark.xdist_group("resume_inflight")
def test_a_run_with_in_flight_updates_killed_and_resumed_ends_as_the_uninterrupted_one(tmp_path):
    """SIGKILL to the trainer and its engine after 12 steps, then --resume (from step 10's checkpoint, whose
    rollout starts on an empty engine in both runs): the same metrics.jsonl (wall-clock figures aside, the token
    versions of every batch included) and the same final policy as the uninterrupted run with the same flags."""
    run, reference, _, stopped, _ = assert_resumed_run_matches(
        "online_dpo_async.py", RESUMABLE, tmp_path, stop_after=12, sig=signal.SIGKILL
    )
    assert stopped == ["step_000005", "step_000010"]
    train, _ = read_metrics(reference)
    assert any(m["async/token_version_max"] > m["async/token_version_min"] for m in train)


@pytest.mark.slow
@pytest.mark.xdist_group("resume_inflight")
def test_an_engine_frozen_in_a_push_between_two_segments_stops_the_run_within_its_deadline(tmp_path):
    """The engine's worker stopped (SIGSTOP) as the push of version 14 begins, with the sequences of the rollouts
    before it in flight: the run stops within the push's deadline, with a checkpoint of the step whose rollout did
    not come and one last line naming the push and where to resume from; no traceback."""
    timeout = ["--engine_timeout_minutes", str(FROZEN_ENGINE_MINUTES)]
    code, output, seconds, _ = run_with_fault("online_dpo_async.py", "freeze_push:14", [*RESUMABLE, *timeout], tmp_path)
    last = output.strip().splitlines()[-1]
    frozen = re.fullmatch(
        r"error: the engine froze: the weight push of policy version 14 had no answer in [\d.]+ s, its deadline "
        r"([\d.]+) s \(.+\); resume from (.+/checkpoints/step_(\d+)) with --resume",
        last,
    )
    assert code == 1 and frozen, output[-3000:]
    deadline, checkpoint, stop_step = float(frozen[1]), frozen[2], int(frozen[3])
    print(f"stopped before step {stop_step}, {seconds:.1f} s after the fault, deadline {deadline} s")
    assert 14 <= stop_step <= 16 and f"stopped before step {stop_step}; resume from {checkpoint}" in output
    assert deadline - 1 < seconds < deadline + PROMPTLY and "Traceback" not in output


@pytest.mark.slow
@pytest.mark.parametrize("script, kv", [("rloo_async.py", "keep"), ("ppo_async.py", "recompute")])
def test_at_async_level_0_every_token_s_engine_logprob_is_the_trainer_s(script, kv, tmp_path):
    """In-flight updates at k = 0 (one rollout in flight, one version): the logprobs the segments record, token by
    token, are the trainer's of its own policy at every step (policy/engine_logprob_diff, the mean |trainer's -
    engine's| over the batch's tokens, under 2e-6, float32 as the default run at k = 0), under either --inflight_kv:
    a logprob recorded for another token, in another order, or under another version would be off by far more."""
    flags = [*INFLIGHT, "--inflight_kv", kv, *SMALL_RUN, "--async_level", "0", "--old_logprobs", "engine"]
    run_script([sys.executable, script, *flags, "--output_dir", str(tmp_path)])
    train, _ = read_metrics(tmp_path)
    diffs = [m["policy/engine_logprob_diff"] for m in train]
    print(f"{script} --inflight_kv {kv}: the largest engine_logprob_diff {max(diffs):.2e} over {len(diffs)} steps")
    assert all(m["async/token_version_min"] == m["async/token_version_max"] == m["step"] for m in train)
    assert max(diffs) < 2e-6 and len(diffs) >= 16
