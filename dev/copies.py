"""The text the algorithm files share, written from one source.

Each algorithm file holds its whole method, so that it reads alone; the part of it below its banner (sizes,
tasks, data, models, rewards, evaluation, the async schedule, the generation thread) is the same text in every
one, the source's: the first file of ALGORITHM_FILES. Edit it there, then

    python dev/copies.py           # rewrites every other file's part below its banner from the source's
    python dev/copies.py --check   # changes nothing; fails, naming them, if any differs (the drift test)

The pattern of transformers' "Copied from" comments and `make fix-copies` (its utils/check_copies.py). A new
method is a copy of an algorithm file with its method section changed, added to ALGORITHM_FILES
(docs/algorithms.md#forking-a-file).
"""

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The algorithm files, the source of the shared text first: the one list of them (the tests read it here).
ALGORITHM_FILES = ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"]
BANNER = "below: the same text in every algorithm file"


def split(text: str, name: str) -> tuple[str, str]:
    """A file's text cut at its banner, a comment line naming BANNER: (its own part, the shared part, banner
    line first)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith("#") and BANNER in line]
    if len(starts) != 1:
        raise SystemExit(f"error: {name} has {len(starts)} banner lines ('# ... {BANNER} ...'), not one")
    return "".join(lines[: starts[0]]), "".join(lines[starts[0] :])


def shared_text(root: Path = ROOT, files: list[str] = ALGORITHM_FILES) -> str:
    """The source's shared part."""
    return split((root / files[0]).read_text(), files[0])[1]


def differing(root: Path = ROOT, files: list[str] = ALGORITHM_FILES) -> dict[str, int]:
    """The files whose shared part is not the source's -> how many of their lines differ."""
    source = shared_text(root, files).splitlines()
    out = {}
    for name in files[1:]:
        copy = split((root / name).read_text(), name)[1].splitlines()
        changed = [line for line in difflib.ndiff(copy, source) if line[:1] in "+-"]
        if changed:
            out[name] = len(changed)
    return out


def rewrite(root: Path = ROOT, files: list[str] = ALGORITHM_FILES) -> dict[str, int]:
    """Rewrites each file's shared part from the source's (a temporary file, then renamed); returns what
    `differing` said of them before."""
    source, changed = shared_text(root, files), differing(root, files)
    for name in changed:
        own, _ = split((root / name).read_text(), name)
        temporary = root / f".{name}.copying"
        temporary.write_text(own + source)
        temporary.replace(root / name)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a copy differs")
    check = parser.parse_args().check
    changed = differing() if check else rewrite()
    for name, lines in changed.items():
        verb = "differs from" if check else "rewritten from"
        print(f"{name}: its shared text {verb} {ALGORITHM_FILES[0]}'s ({lines} lines)")
    if not changed:
        print(f"the shared text of {', '.join(ALGORITHM_FILES[1:])} is {ALGORITHM_FILES[0]}'s")
    if check and changed:
        source = ALGORITHM_FILES[0]
        print(f"edit the shared text in {source}, then run: python dev/copies.py", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
