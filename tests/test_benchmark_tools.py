"""benchmark/ helpers on hand-made inputs."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmark"))
import timing  # noqa: E402


def write_run(path, generation, weight_sync, training, step, lag=1):
    lines = [{"step": i, "episode": i, "async/lag": min(i, lag), "time/generation": generation, "time/weight_sync": weight_sync,
              "time/training": training, "time/step": step} for i in range(6)]
    lines.insert(1, {"step": 0, "episode": 0, "eval/win_rate": 0.5})  # evaluation lines are skipped
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_timing_summary_by_hand(tmp_path):
    sync = timing.summarize(write_run(tmp_path / "sync.jsonl", 0.3, 0.1, 0.5, 0.9, lag=0))
    assert (sync["G"], sync["T"], sync["step"], sync["async_level"]) == pytest.approx((0.4, 0.5, 0.9, 0))
    assert sync["efficiency"] == pytest.approx(0.5 / 0.9) and sync["push share"] == pytest.approx(0.1 / 0.9)
    overlapped = timing.summarize(write_run(tmp_path / "async.jsonl", 0.3, 0.1, 0.5, 0.5))
    assert overlapped["efficiency"] == pytest.approx(1.0)
    out = subprocess.run([sys.executable, "benchmark/timing.py", str(tmp_path / "sync.jsonl"), str(tmp_path / "async.jsonl")],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "speed-up of the second run: 1.80x (ideal for perfect overlap: 1.80x)" in out
