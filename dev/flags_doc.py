"""Write docs/flags.md's list of the flags from the code: each --help group, each flag with its values, its
default, its domain and its text, as the algorithm files' `Args` and domain tables say them.

    python dev/flags_doc.py            # rewrite the list between its markers in docs/flags.md
    python dev/flags_doc.py --check    # exit 1 if the committed list differs from the code's (a test runs it)

A flag's meaning is written once, in the comment above or beside its field (which --help shows); this page
only gathers them. A flag whose text, default or domain differs between the files gets a row per file."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dev.copies import ALGORITHM_FILES  # noqa: E402
from plumbing.flags import COMMON_DOMAINS, flag_sections  # noqa: E402
from plumbing.tidy import write_atomically  # noqa: E402

DOC = ROOT / "docs" / "flags.md"
BEGIN = "<!-- flags: written by dev/flags_doc.py from each file's Args and domains -->\n"
END = "<!-- end of flags -->"
TABLE_HEAD = "| flag | values | default | must be | what it is |"


def values(annotation) -> str:
    """The values a flag takes, as a reader types them: `int`, `auto | float32`, `float or None`."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        annotation = members[0]
    if typing.get_origin(annotation) is typing.Literal:
        shown = " \\| ".join(f"`{choice}`" for choice in typing.get_args(annotation))
    else:
        shown = annotation.__name__
    return f"{shown} or None" if optional else shown


def default(value) -> str:
    """A default as a reader types it: on/off for a switch, a path inside the repository relative to it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.startswith(str(ROOT)):
        value = Path(value).relative_to(ROOT)
    return f"`{value}`"


def rows_by_group() -> list[tuple[str, list[tuple[str, dict]]]]:
    """[(group title, [(flag, {file: (values, default, domain, text)})])], in --help's order: the groups every
    file has in their place, a file's own after the previous file's at the same place; each group's title
    without what differs per file in brackets."""
    groups: dict[str, dict[str, dict]] = {}
    places: dict[str, tuple[int, int]] = {}
    for file_index, name in enumerate(ALGORITHM_FILES):
        module = importlib.import_module(name.removesuffix(".py"))
        hints = typing.get_type_hints(module.Args)
        fields = {field.name: field for field in dataclasses.fields(module.Args)}
        domains = COMMON_DOMAINS | module.SHARED_DOMAINS | module.ALGORITHM_DOMAINS
        for place, (title, flags) in enumerate(flag_sections(module.Args)):
            title = title.split(" (")[0]
            places.setdefault(title, (place, file_index))
            group = groups.setdefault(title, {})
            for flag, text in flags:
                domain = domains.get(flag)
                group.setdefault(flag, {})[name] = (
                    values(hints[flag]),
                    default(fields[flag].default),
                    f"{domain[0]}: {domain[1]}" if domain else "",
                    text,
                )
    return [(title, list(groups[title].items())) for title in sorted(groups, key=places.__getitem__)]


def cell(text: str) -> str:
    """A table cell as GitHub shows it: a bar would end the cell, `<` open a tag, `__` start bold."""
    return text.replace("|", "\\|").replace("<", "\\<").replace("__", "\\_\\_")


def flag_list() -> str:
    lines = []
    for title, flags in rows_by_group():
        files = sorted({name for _, by_file in flags for name in by_file}, key=ALGORITHM_FILES.index)
        heading = title if len(files) == len(ALGORITHM_FILES) else f"{title} (`{files[0]}`)"
        lines += [f"### {heading}", "", TABLE_HEAD, "|---|---|---|---|---|"]
        for flag, by_file in flags:
            distinct = {}
            for name, row in by_file.items():
                distinct.setdefault(row, []).append(name)
            for (shown_values, shown_default, domain, text), names in distinct.items():
                in_every_file = len(distinct) == 1 and len(by_file) == len(files)
                where = "" if in_every_file else f" ({', '.join(f'`{n}`' for n in names)})"
                columns = [f"`--{flag}`{where}", shown_values, shown_default, cell(domain), cell(text)]
                lines.append(f"| {' | '.join(columns)} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the list differs from the code's")
    check = parser.parse_args().check
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"error: {DOC.relative_to(ROOT)} has no markers {BEGIN.strip()!r} ... {END!r}")
    before, rest = text.split(BEGIN)
    after = rest.split(END)[1]
    written = before + BEGIN + flag_list() + END + after
    if written == text:
        return 0
    if check:
        print(f"{DOC.relative_to(ROOT)}'s flag list differs from the code's: run python dev/flags_doc.py")
        return 1
    write_atomically(DOC, written)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
