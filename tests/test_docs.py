"""Every command the README shows is run (with smaller sizes) or, for GPU commands, parsed; the
flag list in the README and `--help` name every field of Args."""

import dataclasses
import importlib
import re
import shlex
import sys
import time

import pytest
from conftest import ROOT, SMALL_RUN, check_run, run_script, shared_run

import online_dpo_async as dpo

README = (ROOT / "README.md").read_text()


def block(marker: str) -> list[str]:
    """Command lines of the fenced block right after `<!-- marker -->`, comments stripped."""
    match = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)```", README, re.S)
    assert match, f"README lost its {marker} block"
    return [line.split("  #")[0].strip() for line in match.group(1).strip().splitlines()]


def to_argv(command: str) -> tuple[dict, list[str]]:
    """A README command as this test environment runs it: its env assignments and its argv."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0].endswith("python"):
        words[0] = sys.executable
    elif words[0].endswith("accelerate") and words[1] == "launch":
        words[:2] = [sys.executable, "-m", "accelerate.commands.launch"]
    return env, words


def test_quickstart_run_command_learns(tmp_path):
    """The README's first command, unchanged but for the output folder: the default tiny run."""
    command = block("run-command")[0].split("&&")[-1].strip()
    env, argv = to_argv(command)
    assert argv[1:] == ["online_dpo_async.py"]
    start = time.perf_counter()
    run_script(argv + ["--output_dir", str(tmp_path)], timeout=900, env=env)
    print(f"default run took {time.perf_counter() - start:.0f} s")
    args, train, evals = check_run(tmp_path, "online_dpo_async.py")
    print("win rate", [round(e["eval/win_rate"], 3) for e in evals], "ref perplexity", [round(e["eval/ref_perplexity"], 3) for e in evals])
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10
    assert evals[-1]["eval/gold_score"] > evals[0]["eval/gold_score"]
    for key in ("episode", "lr", "objective/scores", "objective/kl", "objective/entropy", "objective/rlhf_reward", "val/num_eos_tokens",
                "loss/policy", "time/generation", "time/training", "time/weight_sync", "time/wait_for_rollouts", "time/step",
                "throughput/episodes_per_second", "throughput/tokens_per_second"):
        assert key in train[-1], key
    assert train[-1]["episode"] == dpo.Args.total_episodes
    assert any((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "policy" / "model.safetensors").exists()


@pytest.mark.parametrize("command", block("cpu-examples"))
def test_cpu_example_commands_run(command, tmp_path):
    """Each CPU example with SMALL_RUN's sizes (the run tests of rloo_async.py and ppo_async.py share the runs of their plain examples).
    The two-process one runs as shown, without --output_dir (from an empty folder): both processes must write
    to the one runs/<run name> folder, which a checkpoint shows (each process writes its RNG state there)."""
    env, argv = to_argv(command)
    script = next(word for word in argv if word.endswith("_async.py"))
    if "cpu_2proc" not in command:
        check_run(shared_run(argv + SMALL_RUN, env), script)
        return
    argv = [str(ROOT / word) if (ROOT / word).is_file() else word for word in argv]
    run_script(argv + SMALL_RUN + ["--save_freq", "4"], env=env, cwd=tmp_path)
    (run,) = (tmp_path / "runs").iterdir()
    args, _, _ = check_run(run, script)
    assert args["world_size"] == 2 and args["batch_size"] == 16
    assert sorted(p.name for p in (run / "checkpoints" / "step_000004").glob("rng_*.json")) == ["rng_0.json", "rng_1.json"]


def test_every_training_process_gets_rank_0s_run_name(tmp_path):
    """The default --output_dir is runs/<run name>, and the name holds the time: each process must take rank 0's,
    even when its clock is already in the next second (here rank 1's is made one second ahead)."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"""import importlib, sys, time, types
sys.path.insert(0, {str(ROOT)!r})
from accelerate import Accelerator
accelerator = Accelerator()
for name in ("online_dpo_async", "rloo_async", "ppo_async"):
    module = importlib.import_module(name)
    if accelerator.process_index == 1:
        module.time = types.SimpleNamespace(time=lambda: time.time() + 1)
    print(f"{{name}} rank {{accelerator.process_index}}: {{module.name_run(module.Args())}}", flush=True)
""")
    proc = run_script([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/cpu_2proc.yaml", str(probe)],
                      env={"ACCELERATE_USE_CPU": "1"}, timeout=300)
    names = {}
    for line in proc.stdout.splitlines():
        if " rank " in line:
            script, rest = line.split(" rank ")
            names.setdefault(script, set()).add(rest.split(": ")[1])
    assert sorted(names) == ["online_dpo_async", "ppo_async", "rloo_async"] and all(len(n) == 1 for n in names.values()), proc.stdout


def test_gpu_commands_parse():
    """No GPU here: check that the configs load and the script's flags parse as written."""
    import tyro
    from accelerate.commands.config.config_args import load_config_from_file

    match = re.search(r"## GPUs\n\n```bash\n(.*?)```", README, re.S)
    lines = match.group(1).splitlines()
    one_gpu = shlex.split(lines[1].split("  #")[0].replace(" ...", ""))
    assert one_gpu[:2] == ["python", "online_dpo_async.py"] and tyro.cli(dpo.Args, args=one_gpu[2:]).vllm_placement == "auto"
    # auto: one GPU is shared with the one training process; 8 GPUs give 7 training processes and the engine its own
    assert dpo.engine_placement("auto", ["0"], 1, None).shared
    assert not dpo.engine_placement("auto", [str(i) for i in range(8)], 7, None).shared
    commands = [line for line in lines if line.startswith("accelerate launch")]
    assert len(commands) == 2
    for command in commands:
        words = shlex.split(command.replace(" ...", ""))
        config = load_config_from_file(words[words.index("--config_file") + 1])
        assert config.distributed_type in ("MULTI_GPU", "DEEPSPEED")
        flags = words[words.index("online_dpo_async.py") + 1 :]
        assert tyro.cli(dpo.Args, args=flags).async_level == 1


@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("*_async.py")))
def test_every_flag_is_documented_in_help_and_readme(script):
    module = importlib.import_module(script.removesuffix(".py"))
    proc = run_script([sys.executable, script, "--help"], timeout=120)
    flags_section = README[README.index("## Flags") : README.index("### Batch sizes")]
    for field in dataclasses.fields(module.Args):
        assert re.search(rf"--{field.name}(?!\w)", proc.stdout), f"{script} --help misses --{field.name}"
        assert f"`--{field.name}`" in flags_section, f"README flag list misses --{field.name} of {script}"
