"""A run across machines (`accelerate launch --num_machines 2`), as two machines on this host: end to end, resumed."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from conftest import ALL_CORES, ROOT, check_run, free_port, training_lines_without_timings


def two_machines(flags: list[str], timeout: float = 300) -> tuple[str, str]:
    """`accelerate launch --num_machines 2 --machine_rank R --main_process_ip 127.0.0.1 ...` for R = 0 and 1, one
    training process each (gloo, as on CPUs), started together as two machines are; each on every core, as a user
    runs it, in a session of its own, which is killed whole if it outlives `timeout` (a machine whose peer failed
    waits for it). Returns what each machine printed (stdout and stderr)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/cpu_2proc.yaml"]
    launch += ["--num_machines", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    machines = [
        subprocess.Popen(
            [*launch, "--machine_rank", str(rank), "online_dpo_async.py", *flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "ACCELERATE_USE_CPU": "1"},
            preexec_fn=lambda: os.sched_setaffinity(0, ALL_CORES),
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    deadline = time.monotonic() + timeout
    try:
        outputs = [machine.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for machine in machines]
    finally:
        for machine in machines:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(machine.pid, signal.SIGKILL)
    for rank, (machine, output) in enumerate(zip(machines, outputs)):
        assert machine.returncode == 0, f"machine {rank} failed ({machine.returncode}):\n{output[-6000:]}"
    return outputs[0], outputs[1]


# What torch's launcher on machine 1 may print after a clean run: its exit barrier raced with machine 0's launcher,
# which holds the rendezvous store and had already closed it (torch.distributed.elastic's exit barrier; the exit
# status stays 0). It is the launcher's, not the run's, and a user sees it too.
LAUNCHERS_EXIT_BARRIER_REPORT = re.compile(
    r"\[W\d{4} [\d:.]+ TCPStore\.cpp:\d+\] |Exception raised from recvBytes |frame #\d+: |<omitting python frames>$"
    r"|E\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/agent/server/api\.py:\d+\] |$"
)


def ours(output: str) -> list[str]:
    """The lines a machine printed, less the launcher's report of a raced exit barrier."""
    return [line for line in output.splitlines() if not LAUNCHERS_EXIT_BARRIER_REPORT.match(line)]


@pytest.mark.slow
def test_two_machines_train_and_resume_with_the_engine_and_the_run_folder_on_rank_0(tmp_path):
    """Two machines of one training process each, rank 0's machine running the engine: 4 steps of 2 x 8 prompts,
    checkpointed at step 2. The run's folder, its logs and its checkpoints are global rank 0's (rank 1, the first
    process of its machine, writes none of them, and prints nothing): each step is logged once, and each checkpoint
    holds accelerate's RNG state of both processes, which the folder on a filesystem both machines see receives.
    The run resumed from its step-2 checkpoint on two machines again ends as the run that was not stopped: the same
    metrics, bit-identical weights."""
    flags = ["--total_episodes", "128", "--local_micro_batch_size", "8", "--eval_freq", "2"]
    flags += ["--num_eval_prompts", "16", "--save_freq", "2"]
    first, second = two_machines([*flags, "--output_dir", str(tmp_path / "run")])
    assert "engine: on the CPU; weight snapshots of 2.53 MiB each" in first.splitlines()
    assert "2 training processes; a collective waits 1:00:00 for them at most" in first.splitlines()
    assert ours(second) == []
    args, train, evals = check_run(tmp_path / "run", "online_dpo_async.py")
    assert (args["world_size"], args["batch_size"], len(train), len(evals)) == (2, 16, 4, 3)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    assert sorted(p.name for p in checkpoint.glob("random_states_*.pkl")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "args.json",
        "checkpoints",
        "eval_completions",
        "metrics.jsonl",
        "policy",
        "tensorboard",
    ]
    # the same run, as if stopped during step 3: no final policy; the resume drops what it logged after step 2
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    shutil.rmtree(resumed / "policy")
    first, second = two_machines([*flags, "--output_dir", str(resumed), "--resume"])
    assert f"resuming from {resumed / 'checkpoints' / 'step_000002'} (step 2)" in first.splitlines()
    assert ours(second) == []
    assert training_lines_without_timings(resumed) == training_lines_without_timings(tmp_path / "run")
    weights = [load_file(folder / "policy" / "model.safetensors") for folder in (tmp_path / "run", resumed)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
