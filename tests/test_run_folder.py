"""The run folder's promises (docs/checkpoints.md), the plumbing's (plumbing/run_folder.py), which the three files
share: a checkpoint is complete only with its manifest, and --resume continues from the newest intact one, naming
a damaged one; a cut-off last line of metrics.jsonl is dropped; rank 0 locks the folder, and a second run or a
second --resume is refused naming the process that holds it, a dead process's lock taken over; an unwritable
folder, one without the space the run's own estimate needs, and --resume of a folder that holds no run are refused
in one line before any model loads; a full disk mid-run stops in one line and leaves no temporary file.

The small filesystems are real: a tmpfs mounted in a user and mount namespace of the test's own (`unshare -Urm`,
no privilege needed); where the machine does not allow one, those tests are skipped."""

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, SMALL_RUN, TINY
from safetensors.torch import save_file

import online_dpo_async as dpo
from plumbing.checkpoints import _checkpoint_damage, _write_manifest, checkpoint_to_resume
from plumbing.flags import UsageError
from plumbing.run_folder import (
    _FolderLock,
    _check_space,
    _checkpoint_bytes,
    _disk_full,
    _keep_metrics_before,
    _metrics_lines,
    _parameter_count,
)

# Private plumbing names (leading underscore) on purpose: this file tests the run folder's parts one by one, by
# hand (the lock, the space check, the manifest, resume), which a run reaches only through a fault.

HOST = socket.gethostname()


# ------------------------------------------------------------------------------------------ checkpoints
def write_checkpoint(output_dir: Path, step: int) -> Path:
    """A checkpoint folder laid out as save_checkpoint leaves one: weights, an optimizer file, a subfolder (as
    DeepSpeed writes), format.json and, last, the manifest."""
    path = output_dir / "checkpoints" / f"step_{step:06d}"
    (path / "pytorch_model").mkdir(parents=True)
    save_file({"weight": torch.arange(1000, dtype=torch.float32) * step}, path / "model.safetensors")
    torch.save({"state": {0: torch.ones(50) * step}}, path / "optimizer.bin")
    torch.save({"shard": torch.zeros(20)}, path / "pytorch_model" / "mp_rank_00_model_states.pt")
    (path / "format.json").write_text(json.dumps({"format": 4}))
    _write_manifest(str(path))
    return path


def resumable(output_dir: Path) -> dict:
    """The flags of a run in `output_dir` that --resume continues, and its args.json."""
    flags = vars(dpo.Args(exp_name="online_dpo_async", output_dir=str(output_dir), resume=True))
    (output_dir / "args.json").write_text(json.dumps({**flags, "world_size": 1}))
    return flags


def test_a_checkpoints_manifest_lists_each_file_with_its_size_and_hash(tmp_path):
    """_write_manifest against hashlib over each file's bytes, read by hand: every file under the checkpoint, the
    manifest itself aside."""
    path = write_checkpoint(tmp_path, 4)
    manifest = json.loads((path / "manifest.json").read_text())
    files = [p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert len(files) == 4
    assert manifest == {
        "files": {
            str(p.relative_to(path)): {
                "bytes": len(p.read_bytes()),
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            }
            for p in files
        }
    }
    assert _checkpoint_damage(path) is None


# (what is done to the newest checkpoint, what --resume says of it)
DAMAGES = [
    ("truncate model.safetensors", "model.safetensors has 100 bytes, not the {size} written"),
    ("flip a byte of model.safetensors", "model.safetensors is not the file written: its sha256 differs"),
    ("delete optimizer.bin", "optimizer.bin is missing"),
    ("delete pytorch_model/mp_rank_00_model_states.pt", "pytorch_model/mp_rank_00_model_states.pt is missing"),
    ("delete manifest.json", "manifest.json is missing: it is written last, and the checkpoint was not finished"),
    ("truncate manifest.json", "manifest.json does not parse"),
]


def damage(path: Path, what: str) -> None:
    action, name = what.split(" ", 1) if not what.startswith("flip") else ("flip", what.split(" of ")[1])
    file = path / name
    if action == "truncate":
        os.truncate(file, 100)
    elif action == "delete":
        file.unlink()
    else:
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 1
        file.write_bytes(bytes(data))


@pytest.mark.parametrize("what, said", DAMAGES)
def test_resume_names_a_damaged_checkpoint_and_continues_from_the_newest_intact_one(what, said, tmp_path, capsys):
    flags = resumable(tmp_path)
    older, newest = write_checkpoint(tmp_path, 4), write_checkpoint(tmp_path, 8)
    size = (newest / "model.safetensors").stat().st_size
    assert checkpoint_to_resume(str(tmp_path), flags, True, world_size=1) == str(newest)
    assert capsys.readouterr().out == ""
    damage(newest, what)
    assert checkpoint_to_resume(str(tmp_path), flags, True, world_size=1) == str(older)
    assert capsys.readouterr().out.splitlines() == [
        f"--resume: {newest} is damaged ({said.format(size=size)}; delete it): continuing from the newest intact one, "
        f"{older}"
    ]


def test_with_no_intact_checkpoint_resume_says_how_to_start_over(tmp_path):
    flags = resumable(tmp_path)
    first, second = write_checkpoint(tmp_path, 4), write_checkpoint(tmp_path, 8)
    damage(first, "delete optimizer.bin")
    damage(second, "truncate manifest.json")
    with pytest.raises(UsageError) as error:
        checkpoint_to_resume(str(tmp_path), flags, True, world_size=1)
    assert str(error.value) == (
        f"--resume: no intact checkpoint: {second} is damaged (manifest.json does not parse; delete it); {first} is "
        f"damaged (optimizer.bin is missing; delete it); to start the run over, delete {tmp_path / 'checkpoints'} "
        "too and --resume starts at step 0"
    )
    shutil.rmtree(tmp_path / "checkpoints")
    assert checkpoint_to_resume(str(tmp_path), flags, True, world_size=1) is None  # as it says: step 0


# (what a copy, a disk or a hand left as the newest checkpoint, what --resume says of it)
UNFINISHED = [
    ("an empty folder", "it is empty: made, never written"),
    ("a copy cut short: two files", "it has neither a whole format.json nor manifest.json: not finished, or copied in part"),
    ("format.json cut off, no manifest", "it has neither a whole format.json nor manifest.json: not finished, or copied in part"),
    ("format.json, no manifest", "manifest.json is missing: it is written last, and the checkpoint was not finished"),
    ("a file", "it is a file, not a checkpoint's folder"),
]  # fmt: skip


@pytest.mark.parametrize("what, said", UNFINISHED)
def test_an_empty_or_half_copied_newest_checkpoint_is_named_and_skipped(what, said, tmp_path, capsys):
    """A checkpoint folder that no finished save left: named with what it holds, and the run continues from the newest
    intact one, not refused as another version's."""
    flags = resumable(tmp_path)
    older = write_checkpoint(tmp_path, 4)
    newest = tmp_path / "checkpoints" / "step_000008"
    if what == "a file":
        newest.write_text("step 8\n")
    else:
        newest.mkdir()
    if what.startswith("a copy"):
        shutil.copy(older / "model.safetensors", newest)
        shutil.copy(older / "optimizer.bin", newest)
    if what.startswith("format.json"):
        (newest / "format.json").write_text('{"format": 4}' if what == "format.json, no manifest" else '{"for')
    assert checkpoint_to_resume(str(tmp_path), flags, True, world_size=1) == str(older)
    assert capsys.readouterr().out.splitlines() == [
        f"--resume: {newest} is damaged ({said}; delete it): continuing from the newest intact one, {older}"
    ]


def test_checkpoints_of_older_formats_are_refused_not_skipped(tmp_path):
    """Format 3 and before had no manifest: such a checkpoint is another version's, refused as before, not taken
    for a damaged one of this version."""
    flags = resumable(tmp_path)
    write_checkpoint(tmp_path, 4)
    old = tmp_path / "checkpoints" / "step_000008"
    old.mkdir()
    (old / "format.json").write_text('{"format": 3}')
    with pytest.raises(UsageError, match=rf"^--resume: {old} is not a checkpoint of this version \(format 4\)"):
        checkpoint_to_resume(str(tmp_path), flags, True, world_size=1)


def test_a_real_checkpoint_has_a_manifest_written_last_and_no_temporary_folder(tmp_path):
    """plumbing.checkpoints.save_checkpoint with accelerate's save_state, as the three files call it: the manifest
    lists every file written (with a policy version the generator still owes), and --resume finds it intact."""
    from accelerate import Accelerator

    from plumbing.checkpoints import Progress, save_checkpoint

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress(seed=1)
    accelerator.register_for_checkpointing(progress)
    progress.step = 6
    owed = {5: [("weight", torch.ones(3, 4))]}
    path = Path(save_checkpoint(accelerator, str(tmp_path), progress, owed, keep=2, trained_only={}))
    assert path == tmp_path / "checkpoints" / "step_000006"
    listed = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(listed) == on_disk and {"model.safetensors", "version_000005.safetensors", "format.json"} <= set(
        listed
    )
    assert _checkpoint_damage(path) is None
    assert list((tmp_path / "checkpoints").iterdir()) == [path]


def run_folder(output_dir: Path, resume: bool = True):
    """plumbing.RunFolder as the three files make it, before any model loads: rank 0's checks of the folder (one
    process), its lock released at once."""
    import plumbing

    args = dpo.Args(exp_name="online_dpo_async", output_dir=str(output_dir), resume=resume, save_freq=4)
    processes = plumbing.Processes(args, local_micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=None)
    folder = plumbing.RunFolder(args, processes, trained=[args.sft_model_path], async_level=1)
    folder.close()
    return folder


def test_files_a_kill_left_half_written_are_never_read_and_removed_on_resume(tmp_path, capsys):
    """A run killed while it wrote its step-8 checkpoint, args.json and an evaluation's completions leaves their
    temporary files (each written under *.tmp, then renamed): no resume reads them (the step-8 checkpoint, whole but
    for its manifest, is not taken for one), and a --resume removes them before it goes on, in one line."""
    flags = resumable(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "episode": 8}) + "\n")
    older = write_checkpoint(tmp_path, 4)
    shutil.copytree(older, tmp_path / "checkpoints" / "step_000008.tmp")
    (tmp_path / "checkpoints" / "step_000008.tmp" / "manifest.json").unlink()
    (tmp_path / "args.json.tmp").write_text(json.dumps(flags)[:50])
    (tmp_path / "eval_completions").mkdir()
    (tmp_path / "eval_completions" / "step_000008.jsonl.tmp").write_text('{"step": 8, "prom')
    assert checkpoint_to_resume(str(tmp_path), flags, True, world_size=1) == str(older)
    folder = run_folder(tmp_path)
    assert folder.checkpoint == str(older)
    assert capsys.readouterr().out.splitlines() == [
        "--resume: removed args.json.tmp, checkpoints/step_000008.tmp, eval_completions/step_000008.jsonl.tmp, left "
        "half-written by a run killed while writing it"
    ]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.tmp")) == []
    assert (tmp_path / "metrics.jsonl").exists() and (older / "manifest.json").exists()  # the rest as it was


def test_a_full_disk_removes_what_it_left_half_written_and_names_the_checkpoint_to_resume_from(tmp_path):
    """RunFolder.writing, around every write of the run: an error of a full disk (ENOSPC) removes the temporary files
    (a checkpoint half-written, args.json's), so that the space is free for the --resume it names."""
    folder = run_folder(tmp_path, resume=False)
    folder.last_checkpoint = str(tmp_path / "checkpoints" / "step_000004")
    (tmp_path / "checkpoints" / "step_000008.tmp").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000008.tmp" / "model.safetensors").write_bytes(b"\0" * 100)
    (tmp_path / "args.json.tmp").write_text("{")
    with pytest.raises(UsageError) as stopped, folder.writing("checkpoints/step_000008"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(stopped.value) == (
        f"no space left on the device of --output_dir {tmp_path} (writing checkpoints/step_000008): free some, and "
        f"--resume continues from {tmp_path}/checkpoints/step_000004"
    )
    assert list(tmp_path.rglob("*.tmp")) == []
    with pytest.raises(ValueError), folder.writing("metrics.jsonl"):  # any other error: as it was, nothing removed
        (tmp_path / "policy.tmp").mkdir()
        raise ValueError("not a disk's")
    assert (tmp_path / "policy.tmp").exists()


# ------------------------------------------------------------------------------------------ args.json
@pytest.mark.parametrize(
    "content, problem",
    [
        ("cut", "does not parse (line {line}: Unterminated string starting at)"),
        ("[]", "is a JSON array, not an object of flags"),
        ("folder", "cannot be read (Is a directory)"),
    ],
)
def test_a_damaged_args_json_is_named_before_any_model_loads(content, problem, tmp_path):
    flags = resumable(tmp_path)
    write_checkpoint(tmp_path, 4)
    text = json.dumps(flags, indent=2)
    (tmp_path / "args.json").unlink()
    if content == "cut":
        (tmp_path / "args.json").write_text(text[: text.index('"seed"') + 3])
    elif content == "folder":
        (tmp_path / "args.json").mkdir()
    else:
        (tmp_path / "args.json").write_text(content)
    line = text[: text.index('"seed"')].count("\n") + 1
    with pytest.raises(UsageError) as error:
        checkpoint_to_resume(str(tmp_path), flags, True, world_size=1)
    assert str(error.value) == (
        f"--resume: {tmp_path / 'args.json'} {problem.format(line=line)}: it holds the run's flags, which a resume must "
        "match; restore it from a copy, or start the run again in another --output_dir"
    )


def test_a_run_without_its_args_json_gets_the_same_line_with_resume_and_without(tmp_path):
    """Its logs or checkpoints say it holds a run, whose flags are lost: "leave out --resume" and then "pass --resume"
    would send the user in a circle. A folder that holds nothing of a run is no run to --resume (RunFolder.claim)."""
    flags = resumable(tmp_path)
    (tmp_path / "args.json").unlink()
    line = (
        f"--output_dir {tmp_path} holds a run (its metrics or checkpoints) but not its args.json, which holds the flags "
        "a resume must match: restore args.json to --resume it, or choose another --output_dir"
    )
    for holds in ("metrics", "checkpoint"):
        if holds == "metrics":
            (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "episode": 8}) + "\n")
        else:
            (tmp_path / "metrics.jsonl").unlink()
            write_checkpoint(tmp_path, 4)
        for resume in (True, False):
            with pytest.raises(UsageError) as error:
                checkpoint_to_resume(str(tmp_path), {**flags, "resume": resume}, resume, world_size=1)
            assert str(error.value) == line
    shutil.rmtree(tmp_path / "checkpoints")
    with pytest.raises(UsageError, match=r"holds no run \(no args.json\): check the folder, or leave out --resume"):
        run_folder(tmp_path)


# ------------------------------------------------------------------------------------------ metrics.jsonl
def test_a_cut_off_last_line_of_the_metrics_is_dropped_and_an_earlier_bad_line_refused(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "episode": 16 * (s + 1), "async/lag": 1}) for s in range(3)]
    metrics.write_text("\n".join(lines) + "\n" + lines[2][:20])  # a kill or a full disk in the middle of a line
    assert _metrics_lines(str(metrics)) == (lines, lines[2][:20])
    _keep_metrics_before(str(metrics), start_step=2, evals_logged=set())
    assert metrics.read_text() == lines[0] + "\n" + lines[1] + "\n"
    metrics.write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
    with pytest.raises(UsageError) as error:
        _metrics_lines(str(metrics))
    assert str(error.value) == (
        f"--resume: {metrics} line 2 is not JSON (Expecting property name enclosed in double quotes): mend or delete it"
    )
    assert _metrics_lines(str(tmp_path / "none.jsonl")) == ([], None)
    metrics.write_text("".join(line + "\n" for line in lines))  # whole: every line kept, the last too
    assert _metrics_lines(str(metrics)) == (lines, None)


def test_a_resume_keeps_a_whole_last_line_and_exactly_the_evaluations_its_checkpoint_logged(tmp_path):
    """A run stopped after logging steps 0 to 5, resumed from its step-4 checkpoint, whose Progress had logged the
    evaluations of versions 0 and 4: the evaluation of version 2, logged after that checkpoint was written (an
    evaluation arrives late), is dropped though its version is before step 4, as the resumed run logs it again; the
    whole last line, step 3's, is kept (only a line cut off is dropped)."""
    steps = [{"step": step, "episode": 8 * (step + 1), "async/lag": 1} for step in range(4)]
    evaluations = {v: {"step": v, "episode": 8 * v, "eval/win_rate": 0.5} for v in (0, 2, 4)}
    lines = [steps[0], evaluations[0], steps[1], steps[2], evaluations[2], evaluations[4], steps[3]]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _keep_metrics_before(str(metrics), start_step=4, evals_logged={0, 4})
    kept = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert kept == [steps[0], evaluations[0], steps[1], steps[2], evaluations[4], steps[3]]


@pytest.mark.parametrize(
    "line, what",
    [
        ('["step", 1]', "a JSON array"),
        ('{"note": "restarted by hand"}', "an object without an integer step"),
        ('{"step": "1", "episode": 32}', "an object without an integer step"),
        ("7", "a JSON number"),
    ],
)
def test_a_metrics_line_that_is_json_but_not_a_metrics_record_is_refused_naming_it(line, what, tmp_path):
    """Where it stands, the last line too: a resume keeps the lines before its checkpoint by their step, and a line
    that has none would be a KeyError after the engine started."""
    metrics = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": s, "episode": 16 * (s + 1)}) for s in range(3)]
    for number in (2, 4):
        metrics.write_text("\n".join([*records[: number - 1], line, *records[number - 1 :]][:number]) + "\n")
        with pytest.raises(UsageError) as error:
            _metrics_lines(str(metrics))
        assert str(error.value) == (
            f"--resume: {metrics} line {number} is not a metrics record (a JSON object with its step), it is {what}: "
            "mend or delete it"
        )
    metrics.unlink()
    metrics.mkdir()
    with pytest.raises(
        UsageError, match=rf"^--resume: {metrics} cannot be read \(Is a directory\): mend or delete it$"
    ):
        _metrics_lines(str(metrics))


# ------------------------------------------------------------------------------------------ the lock
def test_the_folder_lock_is_held_refused_released_and_taken_over_from_a_dead_process(tmp_path, capsys):
    folder = tmp_path / "made" / "run"
    lock = _FolderLock(str(folder))
    assert json.loads((folder / "run.lock").read_text()) == {"pid": os.getpid(), "host": HOST}
    with pytest.raises(UsageError) as error:  # another open of the file: flock's locks are per open file
        _FolderLock(str(folder))
    assert str(error.value) == (
        f"--output_dir {folder} is in use by process {os.getpid()} on {HOST}, which holds {folder / 'run.lock'}: "
        "wait for that run to end, or choose another --output_dir"
    )
    lock.release()
    assert not (tmp_path / "made").exists()  # the folders it made go with it, while empty
    # a lock file left by a process that is gone: its lock died with it
    folder.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (folder / "run.lock").write_text(json.dumps({"pid": gone.pid, "host": "elsewhere"}))
    lock = _FolderLock(str(folder))
    assert capsys.readouterr().out == (
        f"--output_dir {folder}: {folder / 'run.lock'} was left by process {gone.pid} on elsewhere, which is gone: "
        "taking it over\n"
    )
    assert json.loads((folder / "run.lock").read_text()) == {"pid": os.getpid(), "host": HOST}
    (folder / "metrics.jsonl").write_text("")
    lock.release()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["made", "metrics.jsonl", "run"]  # a folder in use stays


def shell(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_second_resume_in_a_folder_in_use_and_a_resume_of_no_run_are_refused_from_the_shell(tmp_path):
    """Exit 1 and one line, before any model loads, and nothing written: a --resume of a run whose folder another
    process holds (this test's, as a run holds it: _FolderLock; a second fresh run meets the same lock first, as the
    test above shows), naming the folder and the process; and --resume of a folder that holds no run (a mistyped
    --output_dir), which is not made."""
    run = tmp_path / "run"
    run.mkdir()
    resumable(run)
    lock = _FolderLock(str(run))
    try:
        before = sorted(p.name for p in tmp_path.rglob("*"))
        proc = shell([sys.executable, "rloo_async.py", "--output_dir", str(run), "--resume"])
        assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
            f"error: --output_dir {run} is in use by process {os.getpid()} on {HOST}, which holds "
            f"{run / 'run.lock'}: wait for that run to end, or choose another --output_dir"
        ]
        assert sorted(p.name for p in tmp_path.rglob("*")) == before
    finally:
        lock.release()
    typo = tmp_path / "rnu"
    proc = shell([sys.executable, "ppo_async.py", "--output_dir", str(typo), "--resume"])
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: --resume: --output_dir {typo} holds no run (no args.json): check the folder, or leave out --resume "
        "to start a new run"
    ]
    assert not typo.exists()


# ------------------------------------------------------------------------------------------ space
def test_the_space_a_run_needs_by_hand():
    """_checkpoint_bytes: fp32 weights and AdamW's two moments of each trained model (12 bytes a parameter, 16 under
    DeepSpeed), and the async_level + 1 policy versions a checkpoint may owe at the engine's dtype. The parameters
    are counted from the configs, no weight read: those of the models as transformers loads them."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert _checkpoint_bytes([1000, 500], engine_bytes=2, async_level=2, deepspeed=False) == 1500 * 12 + 1000 * 2 * 3
    assert _checkpoint_bytes([1000, 500], engine_bytes=2, async_level=2, deepspeed=True) == 1500 * 16 + 1000 * 2 * 3
    assert _checkpoint_bytes([1000], engine_bytes=4, async_level=0, deepspeed=False) == 1000 * 12 + 1000 * 4
    policy = AutoModelForCausalLM.from_pretrained(TINY / "sft")
    reward = AutoModelForSequenceClassification.from_pretrained(TINY / "reward")
    assert _parameter_count(str(TINY / "sft"), False) == sum(p.numel() for p in policy.parameters()) == 662_144
    assert _parameter_count(str(TINY / "reward"), False) == sum(p.numel() for p in reward.parameters()) == 331_264
    assert _parameter_count(str(TINY / "nowhere"), False) == 0  # the model checks name the path
    _check_space(str(ROOT), checkpoint=2**20, count=4, final_policy=2**20)
    with pytest.raises(UsageError, match=r"^--output_dir \S+ has [\d.]+ GiB free, and this run would write about"):
        _check_space(str(ROOT), checkpoint=2**60, count=1, final_policy=0)


def test_a_full_disk_is_told_from_its_error_or_from_the_space_left(tmp_path):
    """_disk_full: an OSError with ENOSPC or EDQUOT in the chain; a message that says so (safetensors'); any other
    error only where no space is left (torch.save loses the error number: `unexpected pos 576 vs 534`)."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from inner
    except RuntimeError as chained:
        assert _disk_full(chained, str(tmp_path))
    assert _disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), str(tmp_path))
    safetensors = "Error while serializing: I/O error: No space left on device (os error 28)"
    assert _disk_full(RuntimeError(safetensors), str(tmp_path))
    assert not _disk_full(
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"), str(tmp_path)
    )
    assert not _disk_full(OSError(errno.EACCES, "Permission denied"), str(tmp_path))


def namespaces_allowed() -> bool:
    try:
        return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


small_filesystems = pytest.mark.skipif(
    not namespaces_allowed(), reason="no user namespaces here (unshare -Urm) to mount a small filesystem in"
)


def in_a_small_filesystem(mount: Path, options: str, script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`script` (sh) run where `mount` is a tmpfs of its own, mounted with `options`, which goes with it."""
    mount.mkdir(parents=True, exist_ok=True)
    command = f"mount -t tmpfs -o {options} none {mount} && {script}"
    return shell(["unshare", "-Urm", "sh", "-c", command], timeout=timeout)


@small_filesystems
@pytest.mark.parametrize(
    "name, options, line",
    [
        (
            "online_dpo_async.py",
            "ro,size=1m",
            "error: --output_dir {run} is not writable (Read-only file system): choose another --output_dir",
        ),
        (
            "rloo_async.py",
            "size=20m",
            # the policy's 662,144 parameters: checkpoints of 12 bytes each and two owed versions of 4 (12.6 MiB),
            # 3 kept and one being written, and the final policy (2.5 MiB), by hand
            "error: --output_dir {run} has 20.0 MiB free, and this run would write about 53.0 MiB there: 4 "
            "checkpoint(s) of 12.6 MiB at once (--keep_checkpoints and the one being written) and its final policy, "
            "2.5 MiB; free some space, choose another --output_dir, or lower --keep_checkpoints",
        ),
    ],
)
def test_an_unwritable_or_too_small_output_dir_is_refused_before_any_model_loads(name, options, line, tmp_path):
    mount, python = tmp_path / "disk", shlex.quote(sys.executable)
    script = f"cd {ROOT} && {python} {name} --save_freq 10 --output_dir {mount}/run; echo exit $?; ls -A {mount}"
    proc = in_a_small_filesystem(mount, options, script)
    assert proc.stderr.strip().splitlines() == [line.format(run=mount / "run")], proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["exit 1"]  # and nothing was left in the filesystem


@small_filesystems
@pytest.mark.slow
def test_a_full_disk_mid_run_stops_in_one_line_and_leaves_no_temporary_file(tmp_path):
    """A run whose filesystem another process fills after its third step: the next checkpoint fails, and the run
    stops with one line naming the path and the flag, no traceback, its temporary files removed; the checkpoint
    before it is intact, and the one a --resume continues from. While the run went on, run.lock held the
    trainer's pid; the run's own estimate of a checkpoint bounds the one it wrote."""
    mount, out = tmp_path / "disk", tmp_path / "out"
    out.mkdir()
    run = mount / "run"
    argv = f"{shlex.quote(sys.executable)} online_dpo_async.py {' '.join(SMALL_RUN)} --save_freq 2 --output_dir {run}"
    script = f"""
cd {ROOT}
{argv} > {out}/output.log 2>&1 &
pid=$!
until [ "$(grep -c async/lag {run}/metrics.jsonl 2>/dev/null)" -ge 3 ] 2>/dev/null; do kill -0 $pid || break; sleep 0.05; done
echo $pid > {out}/trainer; cp {run}/run.lock {out}/run.lock
head -c $(( $(df -B1 --output=avail {mount} | tail -1) - 30000 )) /dev/zero > {mount}/filler 2>/dev/null
wait $pid; echo $? > {out}/exit
rm {mount}/filler; find {mount} > {out}/listing; cp -a {run} {out}/run
"""
    proc = in_a_small_filesystem(mount, "size=80m", script, timeout=600)
    output = (out / "output.log").read_text()
    print(output[-3000:], proc.stderr[-2000:])
    assert (out / "exit").read_text() == "1\n" and "Traceback" not in output
    last = output.strip().splitlines()[-1]
    match = re.fullmatch(
        rf"error: no space left on the device of --output_dir {run} \(writing checkpoints/step_(\d{{6}})\): free some, "
        rf"and --resume continues from {run}/checkpoints/step_(\d{{6}})",
        last,
    )
    assert match and int(match[1]) == int(match[2]) + 2, last
    assert [line for line in (out / "listing").read_text().splitlines() if ".tmp" in line] == []
    copy = out / "run"
    newest = copy / "checkpoints" / f"step_{match[2]}"
    assert sorted(p.name for p in (copy / "checkpoints").iterdir())[-1] == newest.name
    assert _checkpoint_damage(newest) is None
    previous = json.loads((copy / "args.json").read_text())
    flags = {flag: previous[flag] for flag in vars(dpo.Args())} | {"resume": True}
    assert checkpoint_to_resume(str(copy), flags, True, world_size=1) == str(newest)
    assert json.loads((out / "run.lock").read_text()) == {"pid": int((out / "trainer").read_text()), "host": HOST}
    written = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    assert written <= _checkpoint_bytes([662_144], engine_bytes=4, async_level=1, deepspeed=False)
