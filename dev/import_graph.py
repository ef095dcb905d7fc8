"""The picture of the repository's folders as they depend on each other, drawn from the code: an arrow from
a folder to another where a Python file of the first imports one of the second (solid, with the number of
importing files), or names one of its scripts to run it (dashed). Writes docs/import_graph.svg, which the
README's Layout shows; a test checks that the committed picture is what this script draws.

    python dev/import_graph.py            # rewrite docs/import_graph.svg
    python dev/import_graph.py --check    # exit 1 if the committed picture is not current
"""

import argparse
import ast
import sys
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "import_graph.svg"
METHOD = "the algorithm files"  # the three files at the top level, one algorithm each
# What each folder holds, under its name in the picture.
HOLDS = {
    METHOD: "online_dpo_async.py, rloo_async.py, ppo_async.py",
    "plumbing/": "not the method: flags, run folder, processes, engine",
    "tasks/": "the tiny task; the pipeline that prepares a real one",
    "benchmark/": "the paper's experiments; the measurements",
    "tests/": "pytest, CPU, offline",
    "dev/": "the project's tools: the shared text's copies",
}
BOX_W, BOX_H, ROW_H, BEND = 300, 52, 120, 190


def folder_of(path: Path) -> str:
    """The folder a Python file belongs to in the picture: its top-level folder, or the algorithm files."""
    relative = path.relative_to(ROOT)
    return f"{relative.parts[0]}/" if len(relative.parts) > 1 else METHOD


def python_files() -> list[Path]:
    return sorted(
        path
        for path in ROOT.rglob("*.py")
        if not {".venv", ".vllm_gpu", ".git", ".gpu", "runs"} & set(path.relative_to(ROOT).parts)
    )


def dependencies() -> tuple[dict, dict]:
    """(imports, runs): (folder, folder) -> the files of the first that import a module of the second, or name
    one of its scripts in a string (a command they run)."""
    files = python_files()
    modules = {path.stem: folder_of(path) for path in files}  # the folders put their files on sys.path by name
    modules["plumbing"] = "plumbing/"
    scripts = {str(path.relative_to(ROOT)): folder_of(path) for path in files}
    scripts |= {path.name: folder_of(path) for path in files if folder_of(path) == METHOD}
    imports, runs = {}, {}
    for path in files:
        source = folder_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named = [modules.get(alias.name.split(".")[0]) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = [modules.get(node.module.split(".")[0])]
            else:
                named = []
            for target in named:
                if target is not None and target != source:
                    imports.setdefault((source, target), set()).add(path)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for target in {scripts.get(word) for word in node.value.split()} - {None, source}:
                    runs.setdefault((source, target), set()).add(path)
    runs = {edge: files for edge, files in runs.items() if edge not in imports}
    return imports, runs


def layers(folders: list[str], imports: dict) -> dict[str, int]:
    """Each folder's row: 0 for one that imports none of the others, else one above the highest it imports."""
    row = {}

    def depth(folder: str, seen: tuple = ()) -> int:
        if folder not in row:
            below = [b for (a, b) in imports if a == folder and b not in seen]
            row[folder] = 1 + max((depth(b, (*seen, folder)) for b in below), default=-1)
        return row[folder]

    for folder in folders:
        depth(folder)
    return row


def draw(imports: dict, runs: dict) -> str:
    """The SVG text: a row per layer (the folders that import nothing at the bottom), solid arrows for
    imports, dashed for scripts run; an arrow over more than one row bends aside, past the boxes between, and
    one up (a folder that runs a script of one that imports it) bends right."""
    folders = [folder for folder in HOLDS if any(folder in edge for edge in (*imports, *runs))]
    row = layers(folders, imports)
    top = max(row.values())
    by_row = {r: [f for f in folders if row[f] == r] for r in range(top + 1)}
    middle = 40 + BEND + BOX_W / 2  # the column of the first folder of each row; the others to its right
    widest = max(len(members) for members in by_row.values())
    width = middle + (widest - 1) * (BOX_W + 40) + BOX_W / 2 + BEND / 2 + 40
    centre = {}
    for r, members in by_row.items():
        for i, folder in enumerate(members):
            x = middle + i * (BOX_W + 40)
            centre[folder] = (x, 40 + (top - r) * ROW_H + BOX_H / 2)
    height = 40 + top * ROW_H + BOX_H + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif">',
        '<defs><marker id="head" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" markerHeight="8" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#444"/></marker></defs>',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
    ]
    edges = [(edge, len(files), False) for edge, files in sorted(imports.items())]
    edges += [(edge, len(files), True) for edge, files in sorted(runs.items())]
    for (source, target), count, dashed in edges:
        (x1, y1), (x2, y2) = centre[source], centre[target]
        span = row[source] - row[target]
        if span > 0:  # down: from the source's bottom to the target's top
            y1, y2 = y1 + BOX_H / 2, y2 - BOX_H / 2
            side = -1 if x2 <= middle else 1
            bend = side * BEND if span > 1 else 0
        else:  # up, to the right of the arrows down
            x1, x2 = x1 + BOX_W / 4, x2 + BOX_W / 4
            y1, y2 = y1 - BOX_H / 2, y2 + BOX_H / 2
            bend = BEND / 4
        cx, cy = (x1 + x2) / 2 + 2 * bend, (y1 + y2) / 2
        style = ' stroke-dasharray="6 4"' if dashed else ""
        parts.append(
            f'<path d="M {x1:.0f} {y1:.0f} Q {cx:.0f} {cy:.0f} {x2:.0f} {y2:.0f}" fill="none" stroke="#444" '
            f'stroke-width="1.5"{style} marker-end="url(#head)"/>'
        )
        # the label beside the curve's middle, outwards; an arrow up's inwards, clear of the arrows down
        x, y = (x1 + x2) / 2 + bend, cy + 4
        outwards = bend >= 0 and span > 0
        label = f"runs {count}" if dashed else f"{count}"
        parts.append(
            f'<text x="{x + (6 if outwards else -6):.0f}" y="{y:.0f}" font-size="12" fill="#444" '
            f'text-anchor="{"start" if outwards else "end"}">{escape(label, quote=False)}</text>'
        )
    for folder in folders:
        x, y = centre[folder]
        parts.append(
            f'<rect x="{x - BOX_W / 2:.0f}" y="{y - BOX_H / 2:.0f}" width="{BOX_W}" height="{BOX_H}" rx="6" '
            'fill="#eef3fb" stroke="#335"/>'
        )
        parts.append(
            f'<text x="{x:.0f}" y="{y - 4:.0f}" font-size="15" text-anchor="middle">'
            f"{escape(folder, quote=False)}</text>"
        )
        parts.append(
            f'<text x="{x:.0f}" y="{y + 14:.0f}" font-size="11" fill="#555" text-anchor="middle">'
            f"{escape(HOLDS[folder], quote=False)}</text>"
        )
    parts.append(
        f'<text x="10" y="{height - 12:.0f}" font-size="11" fill="#555">arrow: imports (number of importing '
        "files); dashed: runs its scripts (dev/import_graph.py draws this from the code)</text>"
    )
    return "\n".join(parts) + "\n</svg>\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/import_graph.svg is not current")
    args = parser.parse_args()
    picture = draw(*dependencies())
    if args.check:
        if not OUT.exists() or OUT.read_text() != picture:
            sys.exit(f"error: {OUT.relative_to(ROOT)} is not current: run python dev/import_graph.py")
        return
    temporary = OUT.with_suffix(".svg.tmp")
    temporary.write_text(picture)
    temporary.replace(OUT)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
