"""Runs that survive faults. The fault handling, signals, watchdog and checkpoint format are the plumbing's
(plumbing/), and the code that calls them is the same text in the three files (tests/test_shared_code.py) but for
main(): each behaviour is run on one file, and each file runs the faults whose wiring is its own (its loss, its
resume state). Faults are injected from outside the method's code, by tests/fault_launcher.py.
A fault injected in generation or in reward scoring, a NaN loss or a NaN score stops the run cleanly; a signal while
the engine starts stops it at once; the engine dies with a trainer killed by SIGKILL; a run stopped mid-way (SIGKILL
to the process group, Ctrl-C, SIGTERM), then by its engine freezing or dying, resumes to the same result as one that
was not; the deadlines of the calls to the engine."""

import ast
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import plumbing
from conftest import (
    ROOT,
    SMALL_RUN,
    TINY,
    accelerate_launch,
    assert_resumed_run_matches,
    free_port,
    read_metrics,
    run_script,
    run_with_fault,
    shared_run,
    shared_stderr,
)

SCRIPTS = ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"]
SMALL = ["--total_episodes", "512", "--local_micro_batch_size", "8", "--eval_freq", "4", "--num_eval_prompts", "32"]
# A fault must stop the run within seconds, not hang: vLLM's client can wait 10 minutes for a dead engine. The bound
# leaves room for a busy machine (about 2 s on a quiet one).
PROMPTLY = 15


@pytest.mark.slow
@pytest.mark.parametrize("script, fault", [("online_dpo_async.py", "generation:3"), ("rloo_async.py", "scoring:3")])
def test_a_fault_surfaces_promptly_and_shuts_the_engine_down(script, fault, tmp_path):
    """An exception in the generation thread, or on the trainer's side (reward scoring): the run ends with the
    traceback and a non-zero exit, and every process it started is gone."""
    code, output, seconds, children = run_with_fault(script, fault, SMALL, tmp_path)
    print(f"{script} {fault}: exit {code} {seconds:.1f} s after the fault")
    assert code not in (0, None) and "Traceback" in output and "injected test fault in" in output, output[-3000:]
    # after the traceback, one line saying what failed (the generation thread's failure is the trainer's error)
    last = output.strip().splitlines()[-1]
    where = "the generation thread failed: RuntimeError: " if fault.startswith("generation") else ""
    assert last.startswith(f"error: {where}injected test fault in "), last
    assert seconds < PROMPTLY, output[-3000:]
    assert children, "the engine should have been started"
    assert not psutil.wait_procs(children, timeout=10)[1], "processes left behind"
    assert not (tmp_path / "policy").exists()


@pytest.mark.slow
@pytest.mark.parametrize("script, value", list(zip(SCRIPTS, ["nan", "inf", "-inf"])))
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(script, value, tmp_path):
    """Each file's loss, made NaN, +inf or -inf at step 5 (the launcher wraps the file's loss function): the run stops
    before the step is logged or checkpointed, naming the last good checkpoint, and its processes are gone."""
    code, output, _, children = run_with_fault(script, f"{value}_loss:5", [*SMALL, "--save_freq", "2"], tmp_path)
    assert code not in (0, None) and f"loss is {value} at step 5" in output, output[-3000:]
    assert output.strip().splitlines()[-1].startswith(f"error: loss is {value} at step 5"), output[-3000:]
    assert f"the last good one is {tmp_path}/checkpoints/step_000004" in output
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    train, _ = read_metrics(tmp_path)
    assert [m["step"] for m in train] == [0, 1, 2, 3, 4]  # the NaN step is not logged as if it were fine
    assert not psutil.wait_procs(children, timeout=10)[1]


def test_nan_or_inf_scores_are_refused_naming_the_step_and_the_source():
    """The plumbing's check, which every file runs right after scoring (Processes.check_scores, on the scores of
    every process) and before any pairing or advantage."""
    check_scores = plumbing.distributed.check_scores
    check_scores(torch.tensor([0.5, -3.0, 0.0, 1e30]), "reward model --reward_model_path rm", 7)  # finite: goes on
    for bad, shown in [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf")]:
        with pytest.raises(RuntimeError) as error:
            check_scores(torch.tensor([0.5, bad, 0.0, 1.0]), "reward model --reward_model_path rm", 7)
        assert (
            str(error.value)
            == f"reward model --reward_model_path rm gave nan/inf scores at step 7 (1 of 4 completions: {shown})"
        )
    with pytest.raises(RuntimeError) as error:
        check_scores(torch.tensor([float("nan")] * 5 + [1.0]), "GSM8k's verifier", 0)
    assert (
        str(error.value)
        == "GSM8k's verifier gave nan/inf scores at step 0 (5 of 6 completions: nan, nan, nan, nan, ...)"
    )


def test_the_method_code_holds_no_fault_hooks():
    """Faults are injected from outside (tests/fault_launcher.py): no file of the method or the plumbing reads a
    test's environment variable or names a fault."""
    for path in [*(ROOT / s for s in SCRIPTS), *sorted((ROOT / "plumbing").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        names |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        texts = [
            node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
        ]
        assert not [name for name in names if re.search(r"(^|_)(fault|inject)", name, re.I)], path
        assert not [text for text in texts if "ASYNC_RLHF_TEST" in text or "injected test fault" in text], path


@pytest.mark.slow
def test_non_finite_scores_stop_the_run_at_their_step_before_it_trains(tmp_path):
    """One whole run (PPO; the check is the same text in the three files): three scores of step 3 made NaN, +inf and
    -inf."""
    code, output, _, children = run_with_fault("ppo_async.py", "nonfinite_scores:3", SMALL, tmp_path)
    num_completions = json.loads((tmp_path / "args.json").read_text())["episodes_per_step"]
    message = f"reward model --reward_model_path {TINY / 'reward'} gave nan/inf scores at step 3 (3 of {num_completions} completions: nan, inf, -inf)"
    assert code not in (0, None) and f"RuntimeError: {message}" in output, output[-3000:]
    assert output.strip().splitlines()[-1] == f"error: {message}"  # after the traceback, the one line that matters
    train, _ = read_metrics(tmp_path)
    assert [m["step"] for m in train] == [0, 1, 2]  # step 3 is neither trained nor logged
    assert not (tmp_path / "policy").exists()
    assert not psutil.wait_procs(children, timeout=10)[1]


@pytest.mark.slow
def test_a_wrong_copy_into_the_push_s_bucket_stops_the_run_naming_the_version_and_the_tensor(tmp_path):
    """One whole run (online DPO; the push is the plumbing's): the push of policy version 2 finds a wrong value in its
    bucket, planted by the test-only launcher after the copy from the host snapshot, which the bucket and the engine
    then agree on. The engine's parameters differ from the fingerprint the trainer took of its own: the run stops in
    one line naming the version and the tensor (the head: the last of the snapshot, which one run of the 1 GiB bucket
    holds whole), with every process gone. (A run never copied, the other fault of the copy: tests/test_engine.py.)"""
    code, output, _, children = run_with_fault("online_dpo_async.py", "wrong_copy:2", SMALL, tmp_path)
    assert "injected test fault: a wrong value planted in lm_head.weight of version 2's bucket" in output, output[
        -3000:
    ]
    last = output.strip().splitlines()[-1]
    assert code not in (0, None) and re.match(
        "error: the generation thread failed: RuntimeError: the engine does not hold policy version 2 after its push: "
        r"1 of \d+ differ from the trainer's fingerprint, first lm_head.weight: sum",
        last,
    ), output[-3000:]
    train, _ = read_metrics(tmp_path)
    # async level 1: version 2 is pushed for the rollouts of step 3, after step 2 trained on version 1's
    assert [m["step"] for m in train] == [0, 1, 2]
    assert not (tmp_path / "policy").exists()
    assert not psutil.wait_procs(children, timeout=10)[1]


# async_level 2: a checkpoint must carry the two older policy versions the generator still owes batches from.
RESUMABLE = [*SMALL, "--save_freq", "5", "--async_level", "2"]
# PPO's own resume state in play: the value model, the adaptive KL coefficient, the engine's logprobs
PPO_RESUMABLE = [*SMALL_RUN, "--save_freq", "5", "--async_level", "2", "--adaptive_kl", "--kl_target", "0.1"]
PPO_RESUMABLE += ["--old_logprobs", "engine"]
# Each file stops another way: SIGKILL to the trainer and its engine at once (a machine going away: the run resumes
# from its last --save_freq checkpoint), Ctrl-C and SIGTERM (pre-emption) to the trainer alone (it finishes the step,
# writes a checkpoint and exits 128 + the signal). Then each is resumed once with its engine failing (a fault of
# tests/fault_launcher.py): online DPO's worker stopped (SIGSTOP) at the weight push of version 14, RLOO's scheduler
# stopped during rollout 14's generation, the worker of PPO's second engine killed there. That run stops before the step whose rollout
# does not come (14 + async_level for a push) with its own checkpoint, which the last resume goes on from.
# PPO's stopped run and the resume whose engine fails have two engines (--vllm_num_engines 2; the one killed: the
# last alone); its last resume has one, as the uninterrupted run, and ends as it does.
TWO_ENGINES = ["--vllm_num_engines", "2"]
STOPS = [
    ("online_dpo_async.py", RESUMABLE, signal.SIGKILL, 12, ("freeze_push:14", 16), []),
    ("rloo_async.py", RESUMABLE, signal.SIGINT, 7, ("freeze_generation:14", 14), []),
    ("ppo_async.py", PPO_RESUMABLE, signal.SIGTERM, 7, ("kill_engine:14", 14), TWO_ENGINES),
]
# a resume test and the tests that read its reference run (the run that was not stopped) share an xdist worker
STOPS = [pytest.param(*stop, marks=pytest.mark.xdist_group(f"resume_{stop[0]}")) for stop in STOPS]


# Calls to the engine take well under a second here: a frozen one's deadline is this flag's.
FROZEN_ENGINE_MINUTES = 0.2


def assert_a_failed_engine_stops_the_run(script: str, flags: list[str], fault: str, stop_step: int, run: Path):
    """The run in `run` resumed with its engine failing (`fault`): it stops within the deadline of the call that had
    no answer (a frozen engine) or at once (a dead one), with the checkpoint of the step it waited for and one last
    line that says what failed and where to resume from; no traceback of its own (an engine that dies of an error
    prints its own), and no process left behind: the engine's, the watchdog."""
    timeout = ["--engine_timeout_minutes", str(FROZEN_ENGINE_MINUTES)]
    code, output, seconds, children = run_with_fault(script, fault, [*flags, *timeout, "--resume"], run)
    checkpoint = run / "checkpoints" / f"step_{stop_step:06d}"
    print(f"{script} {fault}: exit {code} {seconds:.1f} s after the fault")
    last, resume = output.strip().splitlines()[-1], f"; resume from {checkpoint} with --resume"
    assert code == 1 and last.endswith(resume) and checkpoint.is_dir(), output[-3000:]
    assert f"stopped before step {stop_step}{resume}" in output
    index = int(fault.split(":")[1])
    if fault.startswith("kill"):  # the worker the launcher killed, which the trainer sees die
        pid = re.search(r"SIGKILL to VLLM::Worker \(pid (\d+)\)", output)[1]
        engine = "engine 1 of 2" if fault.startswith("kill_engine") else "the engine"  # the last of two, alone
        assert last.startswith(f"error: {engine} died: its process VLLM::Worker (pid {pid})"), last
        # none of the trainer's tracebacks (vLLM's scheduler prints its own as its worker dies: "cancelled")
        assert "plumbing/" not in output and "See stack trace (above)" not in output, output[-6000:]
        assert seconds < PROMPTLY
    else:
        what = f"the weight push of policy version {index}" if "push" in fault else f"the rollout of step {index}"
        frozen = re.fullmatch(
            rf"error: the engine froze: {what} had no answer in [\d.]+ s, its deadline ([\d.]+) s \((.+)\)",
            last.removesuffix(resume),
        )
        assert frozen, last
        deadline, why = float(frozen[1]), frozen[2]
        if why.startswith("--engine_timeout_minutes"):  # the flag's, ...
            assert deadline == pytest.approx(60 * FROZEN_ENGINE_MINUTES) and why.endswith(f" {FROZEN_ENGINE_MINUTES}")
        else:  # ... or ten times the slowest call of its kind this run made, if longer
            slowest = float(re.fullmatch(r"10 x the slowest .+ so far, ([\d.]+) s, more than .*", why)[1])
            assert deadline == pytest.approx(10 * slowest, abs=0.1) and deadline > 60 * FROZEN_ENGINE_MINUTES
        assert deadline - 1 < seconds < deadline + PROMPTLY and "Traceback" not in output, output[-3000:]
    assert not psutil.wait_procs(children, timeout=10)[1], "processes left behind"
    return output


class Damage:
    """What a machine may leave besides a kill, done to the stopped run's folder: the newest checkpoint's weights
    cut short, and the last line of metrics.jsonl cut off in its middle; and what was there (the lock the killed
    run left, the weights' size, the length of what is left of the line)."""

    def __call__(self, run: Path) -> None:
        self.lock = json.loads((run / "run.lock").read_text())
        weights = run / "checkpoints" / "step_000010" / "model.safetensors"
        self.size = weights.stat().st_size
        os.truncate(weights, 1000)
        lines = (run / "metrics.jsonl").read_text().splitlines()
        self.cut = len(lines[-1]) // 2
        (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines[:-1]) + lines[-1][: self.cut])


@pytest.mark.slow
@pytest.mark.parametrize("script, flags, sig, after, failure, engines", STOPS)
def test_a_run_stopped_mid_way_resumes_exactly(script, flags, sig, after, failure, engines, tmp_path):
    """A run stopped after `after` steps and resumed with --resume, where its engine fails (`failure`: the fault
    and the step the run stops before) and which is resumed again, ends with the same metrics.jsonl (wall-clock
    figures aside) and the same final policy as the run that was not stopped. The one killed with SIGKILL left its
    lock, which the first resume takes over, and is damaged before it (Damage): its newest checkpoint is named
    and skipped, the resume continues from the one before, and the cut-off metrics line is dropped, each said in a
    line (docs/checkpoints.md)."""
    damage = Damage() if sig == signal.SIGKILL else None
    said = []  # what the resume whose engine fails printed

    def damaged_and_engine_fails(run: Path) -> None:
        if damage is not None:
            damage(run)
        said.append(assert_a_failed_engine_stops_the_run(script, [*flags, *engines], *failure, run))

    run, reference, output, stopped, _ = assert_resumed_run_matches(
        script, flags, tmp_path, stop_after=after, sig=sig, before_resume=damaged_and_engine_fails, engines=engines
    )
    names = [int(name.removeprefix("step_")) for name in stopped]
    if sig == signal.SIGKILL:  # the --save_freq checkpoints before the kill
        assert names == [5, 10], stopped
        checkpoints, lock = run / "checkpoints", run / "run.lock"
        assert damage.lock["host"] == socket.gethostname()
        assert said[0].splitlines()[:6] == [
            f"--output_dir {run}: {lock} was left by process {damage.lock['pid']} on {damage.lock['host']}, which is "
            "gone: taking it over",
            f"--resume: {checkpoints / 'step_000010'} is damaged (model.safetensors has 1000 bytes, not the "
            f"{damage.size} written; delete it): continuing from the newest intact one, {checkpoints / 'step_000005'}",
            f"--resume: the last line of metrics.jsonl was cut off ({damage.cut} characters): dropped",
            f"train: 32768 prompts from {TINY / 'data' / 'train.jsonl'}",  # once, each split's prompts and files
            f"test: the first 32 of 512 prompts from {TINY / 'data' / 'test.jsonl'}",
            f"resuming from {checkpoints / 'step_000005'} (step 5)",
        ], said[0][:3000]
    else:  # the --save_freq one, then the one written at the step boundary on the signal
        assert names[0] == 5 and after <= names[1] < 10 and len(names) == 2, stopped
        assert f"resume from {run / 'checkpoints' / stopped[1]} with --resume" in output
    # the resumed run goes on writing every 5 steps and keeps the newest --keep_checkpoints (3): the stopped run's go
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    num_steps = json.loads((run / "args.json").read_text())["num_steps"]
    assert checkpoints == [f"step_{s:06d}" for s in range(5, num_steps, 5)][-3:]
    for name in checkpoints:  # each holds the step of its name
        progress = torch.load(run / "checkpoints" / name / "custom_checkpoint_1.pkl", weights_only=False)
        assert f"step_{progress['step']:06d}" == name
    # every file of the run may be read as the umask allows (safetensors alone would write 0600)
    mask = os.umask(0)
    os.umask(mask)
    modes = {f: f.stat().st_mode & 0o777 for f in run.rglob("*") if f.is_file()}
    assert {f.relative_to(run) for f, mode in modes.items() if mode != 0o666 & ~mask} == set()
    assert any(f.name == "model.safetensors" for f in modes) and len(modes) > 20
    if script == "ppo_async.py":
        last = checkpoints[-1]
        assert (reference / "checkpoints" / last).is_dir()
        # accelerate's save_state: the registered objects are the scheduler (0), the progress (1), the KL coefficient (2)
        ours, theirs = (r / "checkpoints" / last for r in (run, reference))
        # the prepared model is PolicyAndValue: its weights are the policy's and the value model's
        resumed, expected = (load_file(c / "model.safetensors") for c in (ours, theirs))
        assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)
        assert {k.split(".")[0] for k in expected} == {
            "policy",
            "value_model",
        } and "value_model.score.weight" in expected
        resumed, expected = (torch.load(c / "optimizer.bin", weights_only=True) for c in (ours, theirs))
        assert (
            resumed["param_groups"] == expected["param_groups"] and resumed["state"].keys() == expected["state"].keys()
        )
        for i, state in expected["state"].items():
            assert all(torch.equal(resumed["state"][i][k], v) for k, v in state.items()), i
        coefs = [torch.load(c / "custom_checkpoint_2.pkl", weights_only=False)["kl_coef"] for c in (ours, theirs)]
        assert coefs[0] == coefs[1] != 0.05  # the controller moved it, and the resume carried it on
        # the final policy/ is the causal LM alone (what transformers and vLLM load), without the value model
        policy = load_file(reference / "policy" / "model.safetensors")
        assert not any(k.startswith(("policy.", "value_model.", "score.")) for k in policy)


@pytest.mark.slow
@pytest.mark.parametrize("script, flags", [pytest.param(*p.values[:2], marks=p.marks) for p in STOPS])
def test_a_finished_run_released_its_shared_memory(script, flags):
    """The runs that were not stopped, at their normal exit: no "leaked shared_memory" warning from Python's resource
    tracker (the engine's message queues were unlinked)."""
    finished = shared_run([sys.executable, script, *flags])
    assert "leaked shared_memory" not in shared_stderr(finished), shared_stderr(finished)[-3000:]


@pytest.mark.slow
@pytest.mark.xdist_group("resume_online_dpo_async.py")
def test_resuming_a_finished_run_says_so_and_loads_nothing(tmp_path):
    """--resume on a run that saved its final policy: one line naming the folder, exit 0, nothing loaded or trained
    again (plumbing.checkpoints.checkpoint_to_resume, which every file's RunFolder calls)."""
    finished = shared_run([sys.executable, "online_dpo_async.py", *RESUMABLE])
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    metrics = (run / "metrics.jsonl").read_text()
    proc = run_script([sys.executable, "online_dpo_async.py", *RESUMABLE, "--output_dir", str(run), "--resume"])
    assert proc.stdout.strip().splitlines() == [
        f"--resume: the run in {run} is finished (its final policy is {run / 'policy'}): nothing to do"
    ]
    assert "Loading weights" not in proc.stderr, proc.stderr[-3000:]
    assert (run / "metrics.jsonl").read_text() == metrics


def alive(processes: list[tuple[int, float]]) -> list[int]:
    """Which of these (pid, create time) are still running (a zombie is not)."""
    running = []
    for pid, create_time in processes:
        try:
            process = psutil.Process(pid)
            if process.create_time() == create_time and process.status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def kill_all(processes: list[tuple[int, float]]) -> None:
    for pid in alive(processes):
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


# (script, signal, sent to the process group as a Ctrl-C at the terminal or to the trainer alone, the engine process seen starting)
STARTUP_SIGNALS = [
    ("online_dpo_async.py", signal.SIGINT, True, "VLLM::EngineCore"),
    ("rloo_async.py", signal.SIGINT, False, "VLLM::Worker"),
    ("ppo_async.py", signal.SIGTERM, False, "VLLM::EngineCore"),
    # kill -9 of the trainer alone: its watchdog, started before the engine, ends the engine it was starting
    ("online_dpo_async.py", signal.SIGKILL, False, "VLLM::Worker"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script, sig, to_group, starting", STARTUP_SIGNALS)
def test_a_signal_while_the_engine_starts_stops_the_run_at_once(script, sig, to_group, starting, tmp_path):
    """vLLM's start-up swallows a KeyboardInterrupt and then waits 10 minutes for an engine that a Ctrl-C
    killed: the trainer stops the start-up itself, exits 128 + signal within 5 s, leaves no process behind,
    and it leaves no run folder behind (it is written once the engine is up). kill -9 (no exit of its own): the
    watchdog kills the engine. Nothing the processes mapped in /dev/shm is left."""
    run, log = tmp_path / "run", tmp_path / "output.log"
    with open(log, "w") as output:
        proc = subprocess.Popen(
            [sys.executable, script, *SMALL, "--output_dir", str(run)],
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seen = {}
    try:
        deadline = time.time() + 300
        while starting not in seen.values():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            for process in psutil.Process(proc.pid).children(recursive=True):
                try:
                    seen[(process.pid, process.create_time())] = process.name()
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.05)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        shared_memory = plumbing.watchdog.shared_memory_files(family)
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        sent = time.time()
        code = proc.wait(timeout=60)
        print(f"{script}: exit {code} {time.time() - sent:.1f} s after {sig.name} with {starting} starting")
        assert code == (-sig if sig == signal.SIGKILL else 128 + sig), log.read_text()[-4000:]
        assert time.time() - sent < PROMPTLY, log.read_text()[-4000:]
        remaining = time.time() + 10
        while alive(list(seen)) and time.time() < remaining:
            time.sleep(0.1)
        assert not alive(list(seen)), f"left behind: {[seen[p] for p in seen if p[0] in alive(list(seen))]}"
        assert [path for path in shared_memory if os.path.exists(path)] == []
        output = log.read_text()
        assert "TimeoutError" not in output and (to_group or "Traceback" not in output), output[-4000:]
        # what the engine's processes mapped is released at once: the resource tracker has nothing to say after it
        assert sig == signal.SIGKILL or "leaked" not in output, output[-4000:]
        # no run folder: the lock's, made before any model loaded, goes with it; kill -9 leaves the lock's file,
        # which the next run in the folder takes over (a folder that holds only it holds no run)
        left = sorted(p.name for p in run.iterdir()) if run.exists() else []
        assert left == (["run.lock"] if sig == signal.SIGKILL else []), left
    finally:
        proc.kill()
        kill_all(list(seen))


@pytest.mark.slow
def test_the_engine_dies_with_a_trainer_killed_by_sigkill(tmp_path):
    """kill -9 of the trainer alone, mid-run, with two engines: its watchdog (plumbing.watchdog, which every file's
    engine start calls) kills every engine's processes, which would otherwise live on (re-parented to init), and
    removes the weights folder and the engines' message queues in shared memory."""
    from plumbing.watchdog import shared_memory_files

    script = "online_dpo_async.py"
    run = tmp_path / "run"
    with open(tmp_path / "output.log", "w") as output:
        proc = subprocess.Popen(
            [sys.executable, script, *SMALL, *TWO_ENGINES, "--output_dir", str(run)],
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    engine = []
    try:
        metrics, deadline = run / "metrics.jsonl", time.time() + 300
        while not (metrics.exists() and metrics.read_text().count("async/lag") >= 2):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "output.log").read_text()[-4000:]
            time.sleep(0.05)
        for process in psutil.Process(proc.pid).children(recursive=True):
            try:
                if process.name().startswith("VLLM::"):
                    engine.append((process.pid, process.create_time()))
            except psutil.NoSuchProcess:
                pass
        ram = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        folders = list(Path(ram).glob(f"policy-weights-{proc.pid}-*"))
        # each engine's scheduler process and its worker
        assert len(engine) >= 4 and len(folders) == 1, (engine, folders)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        queues = [path for path in shared_memory_files(family) if "/psm_" in path]
        assert queues, "the engines' message queues"
        proc.kill()
        proc.wait()
        deadline = time.time() + 10
        left = lambda: [path for path in queues if os.path.exists(path)]  # noqa: E731
        while (alive(engine) or folders[0].exists() or left()) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(engine), "an engine outlived its trainer"
        assert not folders[0].exists() and left() == []
    finally:
        proc.kill()
        kill_all(engine)


def test_weights_folders_of_dead_trainers_are_removed(tmp_path):
    """A trainer killed together with its watchdog leaves its weights folder in RAM: the next run removes the
    folders whose trainer (the pid in the name) is gone, and only those."""
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    names = [
        f"policy-weights-{finished.pid}-ab_c12",
        f"policy-weights-{os.getpid()}-xyz3",
        "policy-weights-k2j_x9",
        "other-1-a",
    ]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"weights")
    assert plumbing.watchdog.remove_stale_weights_folders(str(tmp_path)) == [str(tmp_path / names[0])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_orphaned_message_queues_and_semaphores_are_released_and_only_those(tmp_path):
    """What a run killed with its resource trackers leaves in RAM: the next run's engine start unlinks the message
    queues and semaphores that no process maps, once unchanged for `min_age`; a mapped one (a semaphore mapped under
    the temporary name glibc created it with included), a new one and files of other kinds stay. The watchdog unlinks
    the files its trainer and engine mapped (the resume test kills a whole process group)."""
    import mmap

    old = time.time() - 120
    for name in ["psm_orphan", "sem.mp-orphan", "psm_mapped", "sem.Xy12ab", "psm_new", "other"]:
        (tmp_path / name).write_bytes(b"\0" * 4096)
        if name != "psm_new":
            os.utime(tmp_path / name, (old, old))
    with (
        open(tmp_path / "psm_mapped", "r+b") as queue,
        mmap.mmap(queue.fileno(), 4096),
        open(tmp_path / "sem.Xy12ab", "r+b") as semaphore,
        mmap.mmap(semaphore.fileno(), 4096),
    ):
        os.link(tmp_path / "sem.Xy12ab", tmp_path / "sem.mp-mapped")  # as sem_open does: the maps name sem.Xy12ab
        os.unlink(tmp_path / "sem.Xy12ab")
        os.utime(tmp_path / "sem.mp-mapped", (old, old))
        assert plumbing.watchdog.shared_memory_files([psutil.Process()], str(tmp_path)) == [
            str(tmp_path / "psm_mapped"),
            str(tmp_path / "sem.mp-mapped"),
        ]
        released = plumbing.watchdog.release_orphaned_shared_memory(folder=str(tmp_path), min_age=60)
        assert sorted(released) == [str(tmp_path / "psm_orphan"), str(tmp_path / "sem.mp-orphan")]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "psm_mapped", "psm_new", "sem.mp-mapped"]
        # a watchdog names the files: those go whatever their age, if unmapped
        named = [str(tmp_path / name) for name in ("psm_new", "psm_mapped", "sem.mp-mapped", "other")]
        assert plumbing.watchdog.release_orphaned_shared_memory(named, folder=str(tmp_path)) == [named[0], named[3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["psm_mapped", "sem.mp-mapped"]
    assert plumbing.watchdog.release_orphaned_shared_memory(named, folder=str(tmp_path)) == named[1:3]  # unmapped now


def test_each_call_to_the_engine_has_a_deadline_from_the_runs_own_pace():
    """plumbing.stops.Deadlines by hand: the engine's start and the first call of a kind (it may compile) get the
    flag's minutes and 5 more on a CPU, 30 more on a GPU, and the first is not the kind's pace; the second the flag's;
    a later one 10 times the slowest of its kind but the first, at least the flag's; each kind its own. The run states
    them as the engine starts."""
    cpu = plumbing.stops.Deadlines(timeout_minutes=1.0, on_gpu=False)
    assert cpu.first == 360.0
    assert cpu.deadline("rollout") == (
        360.0,
        "the first rollout may compile: --engine_timeout_minutes 1 + 5 minutes on a CPU",
    )
    assert cpu.start_failed("engine 1 of 2") == (
        "engine 1 of 2 did not start in 6 minutes (its start may compile: --engine_timeout_minutes 1 + 5 minutes on a "
        "CPU): stopped it"
    )
    assert cpu.stated() == (
        "engine deadlines: its start and the first weight push, rollout and evaluation 6 minutes each "
        "(--engine_timeout_minutes 1 + 5 for vLLM's first compile on a CPU); a later call 1, or 10 times the slowest of "
        "its kind so far if longer"
    )
    cpu.answered("rollout", 120.0)  # compiling: not the pace
    assert cpu.deadline("rollout") == (60.0, "--engine_timeout_minutes 1")
    for seconds in (4.0, 7.5, 5.0):
        cpu.answered("rollout", seconds)
    expected = "10 x the slowest rollout so far, 7.50 s, more than --engine_timeout_minutes 1"
    assert cpu.deadline("rollout") == (75.0, expected)
    assert cpu.deadline("weight push")[0] == 360.0 and cpu.deadline("evaluation")[0] == 360.0
    cpu.answered("weight push", 30.0)
    cpu.answered("weight push", 0.05)
    assert cpu.deadline("weight push") == (60.0, "--engine_timeout_minutes 1")  # 0.5 s: the flag's is longer
    gpu = plumbing.stops.Deadlines(timeout_minutes=5.0, on_gpu=True)
    expected = (2100.0, "the first evaluation may compile: --engine_timeout_minutes 5 + 30 minutes on a GPU")
    assert gpu.deadline("evaluation") == expected
    assert (
        plumbing.stops.Deadlines(timeout_minutes=0.5, on_gpu=True).first == 1830.0
    )  # the flag's counts, however short
    # a call in flight is overdue once past its deadline; one that raised is not the pace
    with cpu.call("weight push", 7):
        call = cpu.open
        assert (
            call.deadline == 60.0 and cpu.overdue(call.start + 59.9) is None and cpu.overdue(call.start + 60.1) is call
        )
        assert call.describe(call.start + 61.25) == (
            "the weight push of policy version 7 had no answer in 61.2 s, its deadline 60.0 s (--engine_timeout_minutes 1)"
        )
    assert cpu.open is None and cpu.done["weight push"] == 3 and cpu.slowest["weight push"] < 1
    with pytest.raises(RuntimeError), cpu.call("evaluation", 4):
        raise RuntimeError("the engine said no")
    assert cpu.open is None and "evaluation" not in cpu.done


def sleeping_engine(count: int) -> tuple[plumbing.Engine, list[subprocess.Popen]]:
    """An Engine whose 'processes' are `count` sleeping children, named as vLLM's, resumable from a checkpoint (a
    Channel over it waits as the trainer does)."""
    from types import SimpleNamespace

    engine = plumbing.Engine.around(llms=[], buckets=[])
    children = [subprocess.Popen(["sleep", "60"]) for _ in range(count)]
    engine.engine_processes = [psutil.Process(child.pid) for child in children]
    engine.names = {child.pid: name for child, name in zip(children, ["VLLM::EngineCore", "VLLM::Worker"])}
    engine.folder = SimpleNamespace(last_checkpoint="runs/r/checkpoints/step_000007")
    return engine, children


def test_a_frozen_or_dead_engine_is_killed_and_stops_the_trainers_wait_naming_the_checkpoint():
    """What the trainer does while it waits on the engine (plumbing.Channel.get, every half second): a call past its
    deadline, or an engine process that died, kills the engine's processes and ends the wait; a wait that cannot
    write a checkpoint (the final evaluations) ends the run with the line naming the newest one."""
    import queue

    engine, children = sleeping_engine(2)
    engine.deadlines.open = plumbing.stops.Call("rollout", 12, time.monotonic() - 90, 75.0, "10 x the slowest")
    channel = plumbing.Channel(engine)
    with pytest.raises(SystemExit) as stopped:
        channel.get(queue.Queue())
    assert re.fullmatch(
        r"error: the engine froze: the rollout of step 12 had no answer in 9\d\.\d s, its deadline 75\.0 s \(10 x the "
        r"slowest\); resume from runs/r/checkpoints/step_000007 with --resume",
        str(stopped.value.code),
    ), stopped.value.code
    assert [child.wait(timeout=10) for child in children] == [-signal.SIGKILL] * 2 and channel.stopping.is_set()

    engine, children = sleeping_engine(2)
    children[1].kill()
    children[1].wait()  # reaped: gone, as a killed worker its scheduler reaps
    engine.folder.last_checkpoint = None
    with pytest.raises(SystemExit) as stopped:
        plumbing.Channel(engine).get(queue.Queue())
    assert stopped.value.code == (
        f"error: the engine died: its process VLLM::Worker (pid {children[1].pid}) ended (a crash prints its traceback "
        "above; none: it was killed, e.g. by the out-of-memory killer); no checkpoint: start it again"
    )
    assert children[0].wait(timeout=10) == -signal.SIGKILL


def test_a_failure_of_the_generation_thread_is_raised_once_with_its_traceback():
    """The thread keeps its exception without printing it; the trainer's wait raises it as the cause of its own
    error, so the traceback is printed once (plumbing.run), and the engine, alive, is left to stop."""
    import queue

    engine, children = sleeping_engine(1)
    channel = plumbing.Channel(engine)
    try:
        raise ValueError("token id 10000 is out of vocabulary")
    except ValueError as error:
        channel.thread_error = error
    with pytest.raises(RuntimeError) as raised:
        channel.get(queue.Queue())
    assert str(raised.value) == "the generation thread failed: ValueError: token id 10000 is out of vocabulary"
    assert raised.value.__cause__ is channel.thread_error and engine.failure is None
    assert children[0].poll() is None
    children[0].kill()


def test_the_engines_start_has_a_deadline():
    """plumbing.stops.StopSignals.start_deadline, around the engine's start in Engine.start: a start that takes
    longer than the flag's minutes and the compile's (a stopped process here; both made short) ends the run at once
    with one line and status 1, killing what it started, as SIGTERM does while starting. In a process of its own: it
    kills its process's children. (StopSignals and Deadlines are the engine's own: the start's deadline is what is tested.)"""
    program = """
import subprocess, sys, time
import plumbing.stops
from plumbing.stops import Deadlines, StopSignals

plumbing.stops._COMPILE_MINUTES["CPU"] = 0.03  # 1.8 s, and the flag's 1.2 s: 3 s
deadlines = Deadlines(timeout_minutes=0.02, on_gpu=False)
signals = StopSignals()
engine = subprocess.Popen(["sleep", "60"])
print(engine.pid, flush=True)
with signals.start_deadline(deadlines.first, "error: " + deadlines.start_failed("engine 1 of 2") + "; no checkpoint"):
    time.sleep(60)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", program], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    engine = int(proc.stdout.readline())
    started = time.time()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and 2.5 < time.time() - started < 3 + PROMPTLY, stderr
    assert stderr.strip().splitlines()[-1] == (
        "error: engine 1 of 2 did not start in 0.05 minutes (its start may compile: --engine_timeout_minutes 0.02 + "
        "0.03 minutes on a CPU): stopped it; no checkpoint"
    )
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE


class RecordingLLM:
    """A stand-in for one of several vLLM engines (Engine.around drives it as it drives vLLM's LLM): its generate
    answers each prompt with `n` completions that record which engine made them, from which prompt and with which
    seed; `hold`: it waits for that event first (a frozen engine, until the test lets it go)."""

    def __init__(self, index: int, hold=None):
        self.index, self.hold = index, hold

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        if self.hold is not None:
            self.hold.wait(timeout=60)
        return [
            SimpleNamespace(
                outputs=[
                    SimpleNamespace(token_ids=[prompt["prompt_token_ids"][0], param.seed, self.index], logprobs=None)
                    for _ in range(param.n)
                ]
            )
            for prompt, param in zip(prompts, params)
        ]


def test_several_engines_give_back_completions_in_prompt_order_each_prompt_with_its_own_seed():
    """Engine.generate over 3 engines (fakes), through the files' `generate` (the same text in the three): 7 prompts
    cut into contiguous parts of 3, 2 and 2, each engine generating its part, and the completions put back in the
    prompts' order, each with its prompt's own seed whichever engine made it; 2 prompts leave the third engine idle."""
    import online_dpo_async as dpo

    engine = plumbing.Engine.around([RecordingLLM(i) for i in range(3)], buckets=[None] * 3)
    prompts, seeds = [[100 + i, 7] for i in range(7)], [1000 + 3 * i for i in range(7)]
    responses, _ = dpo.generate(engine, ("rollout", 0), prompts, 2, 1.0, 8, eos=2, seeds=seeds)
    assert responses == [
        [100 + i, 1000 + 3 * i, engine] for i, engine in enumerate([0, 0, 0, 1, 1, 2, 2]) for _ in "ab"
    ]
    responses, _ = dpo.generate(engine, ("rollout", 1), prompts[:2], 1, 1.0, 8, eos=2, seeds=seeds[:2])
    assert responses == [[100, 1000, 0], [101, 1003, 1]]
    assert engine.busy == set()


def test_the_engine_that_froze_is_named_of_how_many():
    """A rollout over two engines past its deadline (the flag's, 0.3 s, as for a call after the first): the line
    names the engine that has not answered, not "the engines"; with both frozen, both. The trainer's look
    (Engine.failed), which the generation thread, stuck in the engine, cannot take."""
    import threading

    from vllm import SamplingParams

    for frozen in ([1], [0, 1]):
        hold = threading.Event()
        llms = [RecordingLLM(i, hold if i in frozen else None) for i in range(2)]
        engine = plumbing.Engine.around(llms, buckets=[None] * 2)
        engine.deadlines = plumbing.stops.Deadlines(timeout_minutes=0.005, on_gpu=False)
        engine.deadlines.done["rollout"] = 1  # not the first: no compile's allowance

        def rollout():
            prompts = [{"prompt_token_ids": [5 + i]} for i in range(4)]
            engine.generate(prompts, [SamplingParams(seed=i) for i in range(4)], call=("rollout", 12))

        generating = threading.Thread(target=rollout, daemon=True)
        generating.start()
        time.sleep(0.6)
        line = engine.failed()
        which = "engine 1 of 2" if frozen == [1] else "engines 0 and 1 of 2"
        assert re.fullmatch(
            rf"{which} froze: the rollout of step 12 had no answer in 0\.\d s, its deadline 0\.3 s "
            r"\(--engine_timeout_minutes 0\.005\)",
            line,
        ), line
        hold.set()
        generating.join(timeout=10)


def test_a_signal_while_the_final_evaluations_are_owed_stops_at_once_saying_no_checkpoint_can_be_written():
    """After the last step rank 0 waits for the final evaluations (Channel.arrived_evaluations), where no checkpoint can
    be written: a SIGTERM there, the engine frozen, stops the wait within the half second it polls, with 128 + 15 and
    one line that says so and names the newest checkpoint; the engine failing there ends it with the failure's line."""
    import threading
    from types import SimpleNamespace

    engine, children = sleeping_engine(1)
    engine.processes = SimpleNamespace(is_main=True, zero_stage=0)
    engine.signals = SimpleNamespace(received=[])
    threading.Timer(0.3, lambda: engine.signals.received.append(signal.SIGTERM)).start()
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped, contextlib.redirect_stderr(io.StringIO()) as said:
        plumbing.Channel(engine).arrived_evaluations(wait=True)
    assert stopped.value.code == 128 + signal.SIGTERM and time.monotonic() - started < 1.5
    assert said.getvalue() == (
        "SIGTERM: no checkpoint can be written while the final evaluations are owed, after the last step: stopping "
        "now; resume from runs/r/checkpoints/step_000007 with --resume\n"
    )
    engine.signals.received.clear()
    children[0].kill()
    children[0].wait()
    with pytest.raises(SystemExit) as stopped:
        plumbing.Channel(engine).arrived_evaluations(wait=True)
    assert stopped.value.code == (
        f"error: the engine died: its process VLLM::EngineCore (pid {children[0].pid}) ended (a crash prints its "
        "traceback above; none: it was killed, e.g. by the out-of-memory killer); resume from "
        "runs/r/checkpoints/step_000007 with --resume"
    )


SIGNALS_PROGRAM = """
import os, signal, sys, time
from plumbing.stops import StopSignals

if sys.argv[1] == "launcher":
    os.environ["TORCHELASTIC_RUN_ID"] = "test"  # as accelerate's launcher (torchrun's agent) sets it
signals = StopSignals(speaks=sys.argv[2] == "0")
signals.starting = False  # the engine is up
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
os.kill(os.getpid(), signal.SIGTERM)  # a launcher's copy, or a second signal
time.sleep(0.2)
print(signals.received, flush=True)
time.sleep(2.5)
os.kill(os.getpid(), signal.SIGTERM)  # a second signal
time.sleep(5)
print("not stopped", flush=True)
"""


@pytest.mark.parametrize("under, rank", [("launcher", "0"), ("launcher", "1"), ("none", "0")])
def test_a_launchers_copy_of_a_signal_is_not_a_second_one_and_only_rank_0_speaks(under, rank):
    """SIGTERM to a job reaches each training process, and accelerate's launcher, which forwards it to each again: that
    copy, within 2 s, is not the second signal that exits at once (it would, and the checkpoint the first promised
    would not be written); a second signal after it still exits at once. Without a launcher, a second is one at once.
    Only rank 0 says what it will do. (StopSignals is the engine's own: the signals' handling is what is tested.)"""
    proc = subprocess.run(
        [sys.executable, "-c", SIGNALS_PROGRAM, under, rank], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGTERM
    assert proc.stdout.splitlines() == ([f"[{signal.SIGTERM.value}]"] if under == "launcher" else [])
    said = "\nSIGTERM: writing a checkpoint at the end of this step, then exiting\n"
    assert proc.stderr == (said if rank == "0" else "")


# ------------------------------------------------------------------------------------------ a training process lost
def test_a_lost_training_process_is_named_of_how_many_and_said_by_one_process():
    """plumbing.Processes.lost, by hand, with the processes' places (machine, pid) as each process gathers them at
    start: an error of a collective that another process left names the dead ones on this machine (gone, or a zombie
    not yet reaped), said by rank 0, or by the first process alive when rank 0 is among them; one on another machine,
    or none dead, "stopped answering"; any other error is not a lost process."""
    from types import SimpleNamespace

    here = socket.gethostname()
    gone, zombie, alive = (subprocess.Popen(["sleep", seconds]) for seconds in ("0", "0", "60"))
    gone.wait()
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    closed = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:20401: Connection reset by "
        "peer. This is typically caused by a remote worker hanging or bugs in the application."
    )

    def lost(places, rank, error=closed):
        processes = SimpleNamespace(places=places, accelerator=SimpleNamespace(process_index=rank))
        return plumbing.Processes.lost(processes, error)

    places = [(here, os.getpid()), (here, gone.pid), (here, alive.pid)]
    assert lost(places, 0) == (f"training process 1 (pid {gone.pid}) of 3 died", True)
    assert lost(places, 2) == (f"training process 1 (pid {gone.pid}) of 3 died", False)
    places = [(here, zombie.pid), (here, alive.pid), (here, gone.pid), (here, os.getpid())]
    named = f"training processes 0 (pid {zombie.pid}), 2 (pid {gone.pid}) of 4 died"
    assert [lost(places, rank) for rank in (1, 3)] == [(named, True), (named, False)]
    started = time.monotonic()
    assert lost([(here, os.getpid()), ("elsewhere", gone.pid)], 0) == (
        "a training process of 2 stopped answering (Read error [127.0.0.1]:20401: Connection reset by peer)",
        True,
    )
    assert 3 <= time.monotonic() - started < 10  # it looked for a dying one for 3 s
    assert lost(places, 0, RuntimeError("CUDA out of memory")) is None
    assert lost([(here, os.getpid())], 0) is None  # one process: no other to lose
    alive.kill()
    zombie.wait()


def lose_rank_1(rank: int, port: int, out: str) -> None:
    """One of two training processes (gloo, as `accelerate launch --num_processes 2` on a CPU sets them up): rank 1
    dies at once after the start, as the out-of-memory killer leaves a process; rank 0, in the training loop (the
    engine's context), waits in its next collective, and writes what the run's last line is."""
    from types import SimpleNamespace

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_CPU="true")
    args = plumbing.RunArgs(dtype="float32", collective_timeout_minutes=1)
    processes = plumbing.Processes(args, local_micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=None)
    if rank == 1:
        os._exit(9)
    engine = plumbing.Engine.around(llms=[], buckets=[])
    engine.processes = processes
    engine.folder = SimpleNamespace(last_checkpoint="runs/r/checkpoints/step_000008")
    try:
        with plumbing.Channel(engine):
            time.sleep(1)
            processes.broadcast("the next rollout")
    except SystemExit as stopped:
        Path(out).write_text(json.dumps({"code": stopped.code, "cause": repr(stopped.__cause__)}))


def test_a_training_process_that_dies_leaves_one_line_from_rank_0_naming_it_and_the_checkpoint():
    """Real gloo: rank 1 of 2 gone, rank 0's broadcast fails with gloo's "Connection closed by peer", which ends the
    run with one line (no traceback of the collective, whose error it replaces) naming the process and the checkpoint
    to resume from."""
    import multiprocessing

    context, port = multiprocessing.get_context("spawn"), free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.json")
        ranks = [context.Process(target=lose_rank_1, args=(rank, port, out)) for rank in (0, 1)]
        for process in ranks:
            process.start()
        ranks[1].join(timeout=120)
        ranks[0].join(timeout=120)
        assert [process.exitcode for process in ranks] == [0, 9]
        said = json.loads(Path(out).read_text())
    assert said == {
        "code": f"error: training process 1 (pid {ranks[1].pid}) of 2 died; resume from runs/r/checkpoints/step_000008 "
        "with --resume",
        "cause": "None",
    }


# The launcher sends SIGTERM to rank 0's whole process group, the engine's processes in it, which stop as vLLM has
# them stop, and say so in their own ways; those reports are taken out before looking for a traceback of ours, unless
# they pass through our code (plumbing/, which runs in the engine's worker too):
# - its worker raises SystemExit from its SIGTERM handler (vllm/v1/executor/multiproc_executor.py, worker_main); when
#   the signal finds the worker inside an object's finalizer, Python prints "Exception ignored in: ..." and that
#   traceback;
# - its engine core, when the worker stops before the core's own SIGTERM handler has run, logs what failed with it, as
#   the race goes: the worker "died unexpectedly" (exit code 0 or None), the step's or a call's traceback, "RuntimeError:
#   cancelled" (vllm/v1/engine/core.py); every line of its log starts "(EngineCore pid=N) ";
# - and when the core lives on long enough to re-raise that error, multiprocessing prints it again ("Process
#   EngineCore:" and its traceback).
VLLM_WORKER_SIGTERM = re.compile(
    r"Exception ignored in: [^\n]*\nTraceback \(most recent call last\):\n(?:  [^\n]*\n)+SystemExit: *\n"
)
VLLM_ENGINE_CORE_LOG = re.compile(r"(?:\(EngineCore pid=\d+\) [^\n]*\n)+")
VLLM_ENGINE_CORE_RAISED = re.compile(
    r"Process EngineCore:\nTraceback \(most recent call last\):\n(?:  [^\n]*\n)+\S[^\n]*\n"
)


def without_vllms_reports_of_the_sigterm(output: str) -> str:
    def gone_unless_ours(block: re.Match) -> str:
        return block.group() if "plumbing/" in block.group() else ""

    def kept_unless_vllms_handler(block: re.Match) -> str:
        vllms = "vllm/v1/executor/multiproc_executor.py" in block.group() and "in signal_handler" in block.group()
        return "" if vllms else block.group()

    output = VLLM_WORKER_SIGTERM.sub(kept_unless_vllms_handler, output)
    return VLLM_ENGINE_CORE_RAISED.sub(gone_unless_ours, VLLM_ENGINE_CORE_LOG.sub(gone_unless_ours, output))


def test_without_vllms_reports_of_the_sigterm_takes_out_only_those_blocks():
    """The worker's block as CI printed it (a finalizer of vLLM's CPU GEMM handler met by the worker's SIGTERM) goes;
    the same shape from another file, or another exception, stays. The engine core's log and its error re-raised, as
    runs printed them, go, whatever the error; either stays where our code is in it, and a traceback of rank 0's own
    between them stays."""
    worker = (
        "Exception ignored in: <function CPUDNNLGEMMHandler.__del__ at 0x7f51a67f9440>\n"
        "Traceback (most recent call last):\n"
        '  File "/x/site-packages/vllm/_custom_ops.py", line 3728, in __del__\n'
        "    self.dtor(self.handler_tensor.item())\n"
        '  File "/x/site-packages/vllm/v1/executor/multiproc_executor.py", line 878, in signal_handler\n'
        "    raise SystemExit()\n"
        "SystemExit: \n"
    )
    assert without_vllms_reports_of_the_sigterm(f"steps: 6/32\n{worker}\nerror: x\n") == "steps: 6/32\n\nerror: x\n"
    ours = worker.replace("vllm/v1/executor/multiproc_executor.py", "plumbing/channel.py")
    assert without_vllms_reports_of_the_sigterm(ours) == ours
    other = worker.replace("SystemExit: \n", "ConnectionError: closed\n")
    assert without_vllms_reports_of_the_sigterm(other) == other

    core = "(EngineCore pid=9803) ERROR 12-02 16:43:26 "
    logged = (
        f"{core}[multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: 0), shutting down "
        "executor.\n"
        f"{core}[dump_input.py:72] Dumping input data for V1 LLM engine (v0.32.0) with config: model='tiny'\n"
        f"{core}[core.py:1512] EngineCore encountered a fatal error.\n"
        f"{core}[core.py:1512] Traceback (most recent call last):\n"
        f'{core}[core.py:1512]   File "/x/site-packages/vllm/v1/engine/core.py", line 1496, in run_engine_core\n'
        f'{core}[core.py:1512]     raise RuntimeError("cancelled")\n'
        f"{core}[core.py:1512] RuntimeError: cancelled\n"
    )
    raised = (
        "Process EngineCore:\n"
        "Traceback (most recent call last):\n"
        '  File "/x/python3.11/multiprocessing/process.py", line 314, in _bootstrap\n'
        "    self.run()\n"
        '  File "/x/site-packages/vllm/v1/engine/core.py", line 1514, in run_engine_core\n'
        "    raise e\n"
        "RuntimeError: cancelled\n"
    )
    after = "error: training process 1 (pid 9710) of 2 died\n"
    assert without_vllms_reports_of_the_sigterm(f"steps: 6/32\n{logged}{after}") == f"steps: 6/32\n{after}"
    assert without_vllms_reports_of_the_sigterm(f"{logged}{raised}{after}") == after
    ours = logged.replace("/x/site-packages/vllm/v1/engine/core.py", "/x/plumbing/engine.py")
    assert without_vllms_reports_of_the_sigterm(f"{ours}{after}") == f"{ours}{after}"
    ours = raised.replace("/x/site-packages/vllm/v1/engine/core.py", "/x/plumbing/engine.py")
    assert without_vllms_reports_of_the_sigterm(f"{ours}{after}") == f"{ours}{after}"
    rank_0s = raised.replace("Process EngineCore:\n", "")
    assert without_vllms_reports_of_the_sigterm(f"{logged}{rank_0s}{logged}") == rank_0s


def run_and_act(argv: list[str], log: Path, act, env: dict | None = None) -> tuple[int, float, list[int]]:
    """Run `argv` from the repository root, in a session of its own, its output in `log`, calling `act(proc)` every
    0.1 s while it runs (up to 400 s); returns its exit code, the time it exited and the processes it started that
    are still alive 15 s after. Whatever happens, the session and every process it started are killed after."""
    with open(log, "w") as output:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    family = {}
    try:
        deadline = time.time() + 400
        while proc.poll() is None and time.time() < deadline:
            with contextlib.suppress(psutil.Error):
                for process in psutil.Process(proc.pid).children(recursive=True):
                    family[(process.pid, process.create_time())] = process.name()
            act(proc)
            time.sleep(0.1)
        code, exited = proc.wait(timeout=60), time.time()
        while alive(list(family)) and time.time() < exited + 15:
            time.sleep(0.2)
        return code, exited, alive(list(family))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        kill_all(list(family))


@pytest.mark.slow
def test_a_training_process_killed_mid_run_leaves_rank_0_s_line_naming_it_and_the_newest_checkpoint(tmp_path):
    """Two training processes (configs/cpu_2proc.yaml), checkpointed every 4 steps; rank 1 killed (SIGKILL, as the
    out-of-memory killer does) once step 6 is logged. Rank 0's last line names it, of 2, and the run folder's newest
    checkpoint, with no traceback of its own about the closed connection; no process is left. (What the
    launcher prints after it, its summary of the failed ranks, is accelerate's.)"""
    run, log = tmp_path / "run", tmp_path / "output.log"
    launch = accelerate_launch("--config_file", "configs/cpu_2proc.yaml")
    flags = [*SMALL[:2], "--local_micro_batch_size", "4", *SMALL[4:], "--save_freq", "4", "--output_dir", str(run)]
    killed = []

    def kill_rank_1(proc) -> None:
        metrics = run / "metrics.jsonl"
        if not killed and metrics.exists() and metrics.read_text().count('"async/lag"') >= 6:
            ranks = [p for p in psutil.Process(proc.pid).children() if "online_dpo_async.py" in p.cmdline()]
            killed.append(next(p for p in ranks if p.environ().get("RANK") == "1"))
            killed[0].kill()

    launched = [*launch, "online_dpo_async.py", *flags]
    code, _, left = run_and_act(launched, log, kill_rank_1, {"ACCELERATE_USE_CPU": "1"})
    output = log.read_text()
    assert code != 0 and killed, output[-4000:]
    ours = [line for line in output.splitlines() if line.startswith("error: ")]
    newest = sorted((run / "checkpoints").iterdir())[-1]  # step 4's, or 8's if step 7 ended before the kill
    # the launcher sends rank 0 SIGTERM as it sees rank 1 gone, often before rank 0's collective fails
    signalled = ": the checkpoint the stop signal asked for cannot be written without it"
    assert len(ours) == 1 and re.fullmatch(
        rf"error: training process 1 \(pid {killed[0].pid}\) of 2 died({signalled})?; resume from {newest} with "
        "--resume",
        ours[0],
    ), output[-4000:]
    before_launcher = without_vllms_reports_of_the_sigterm(output[: output.index(ours[0])])
    assert "Traceback" not in before_launcher and "Connection" not in before_launcher, output[-4000:]
    assert newest.name in ("step_000004", "step_000008") and left == []


@pytest.mark.slow
def test_a_sigterm_while_the_final_evaluation_waits_on_a_frozen_engine_stops_at_once(tmp_path):
    """The engine frozen (SIGSTOP) in the final evaluation, after the last step, where no checkpoint can be written;
    SIGTERM 2 s later: the run stops within PROMPTLY (the wait polls every half second), not at the evaluation's
    deadline (5 minutes), with 143 and a last line that says no checkpoint can be written and names the newest one;
    no process is left."""
    run, log = tmp_path / "run", tmp_path / "output.log"
    argv = [sys.executable, "tests/fault_launcher.py", "freeze_evaluation:16", "online_dpo_async.py", *SMALL_RUN]
    sent = []

    def stop_once_frozen(proc) -> None:
        if not sent and "injected test fault in the engine" in log.read_text():
            time.sleep(2)
            proc.send_signal(signal.SIGTERM)
            sent.append(time.time())

    code, exited, left = run_and_act([*argv, "--save_freq", "4", "--output_dir", str(run)], log, stop_once_frozen)
    output = log.read_text()
    assert sent and code == 128 + signal.SIGTERM and exited - sent[0] < PROMPTLY, output[-4000:]
    assert output.strip().splitlines()[-1] == (
        "SIGTERM: no checkpoint can be written while the final evaluations are owed, after the last step: stopping "
        f"now; resume from {run}/checkpoints/step_000012 with --resume"
    )
    assert "Traceback" not in output and left == []
