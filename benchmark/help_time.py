"""How long `python <algorithm file> --help` takes, each algorithm file, whole processes timed from outside: min,
median and max wall seconds over --runs runs after one warm-up. With --against REF, the same files at the git
commit REF (a temporary worktree) are timed too, the two in turn (REF, HEAD, REF, HEAD ...), with the ratio pair by
pair, so that a comparison holds on a noisy machine (docs/flags.md#the-help).

    python benchmark/help_time.py                      # the files as they are
    python benchmark/help_time.py --against ca6f118    # beside an older commit
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dev.copies import ALGORITHM_FILES  # noqa: E402


def help_seconds(folder: Path, name: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, name, "--help"], cwd=folder, capture_output=True, check=True)
    return time.perf_counter() - start


def summary(seconds: list[float]) -> str:
    return f"{min(seconds):.2f} / {statistics.median(seconds):.2f} / {max(seconds):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="counted runs of each command (after one warm-up)")
    parser.add_argument("--against", help="a git commit whose files are timed beside these")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        other = None
        if args.against:
            other = Path(scratch) / "other"
            subprocess.run(["git", "worktree", "add", "--detach", str(other), args.against], cwd=ROOT, check=True)
        try:
            print(
                "file | this tree: min / median / max s" + (f" | at {args.against} | ratio (median)" if other else "")
            )
            for name in ALGORITHM_FILES:
                help_seconds(ROOT, name)  # the warm-up: the files' bytecode, the page cache
                if other is not None:
                    help_seconds(other, name)
                ours, theirs = [], []
                for _ in range(args.runs):
                    if other is not None:
                        theirs.append(help_seconds(other, name))
                    ours.append(help_seconds(ROOT, name))
                line = f"{name} | {summary(ours)}"
                if other is not None:
                    ratios = [a / b for a, b in zip(ours, theirs)]
                    line += f" | {summary(theirs)} | {statistics.median(ratios):.2f}"
                print(line)
        finally:
            if other is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
