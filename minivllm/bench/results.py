"""``--markdown[=SECTION]`` for every ``python -m minivllm.bench`` command: the tables the command
prints also replace one named section of ``minivllm/bench/RESULTS.md``.

A section lies between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; ``write_section``
replaces what is between them (or appends a new section), leaving every other section as it was.
``capture_markdown`` runs a benchmark's ``main`` while teeing its output, then turns what it
printed into markdown: table rows (``| a | b |`` or ``a | b`` with ``-|-`` rules) become a
markdown table, progress lines (``[3/8] ...``) are dropped, everything else goes into a fenced block.
"""
from __future__ import annotations

import io
import os
import re
import sys
import time
from contextlib import redirect_stdout
from typing import Callable

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
_PROGRESS = re.compile(r"^\[\d+/\d+\]|\.\.\.$")


def _markers(name: str) -> tuple[str, str]:
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name):
        raise ValueError(f"section name must be lower-case letters, digits, '-' or '_', got {name!r}")
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def write_section(name: str, body: str, path: str = RESULTS) -> None:
    """Replace section ``name`` of ``path`` with ``body`` (append it if the file lacks it)."""
    begin, end = _markers(name)
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n## {name}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(text)


def to_markdown(printed: str) -> str:
    """Printed benchmark output -> markdown (see the module docstring)."""
    out: list[str] = []
    plain: list[str] = []

    def flush_plain() -> None:
        if any(s.strip() for s in plain):
            out.extend(["```", *[s for s in plain if s.strip()], "```", ""])
        plain.clear()

    table_open = False
    for line in printed.splitlines():
        s = line.strip()
        is_rule = bool(s) and set(s) <= set("-|: ") and "-" in s
        is_row = "|" in s and not _PROGRESS.search(s)
        if is_row or (is_rule and table_open):
            flush_plain()
            cells = [c.strip() for c in s.strip("|").split("|")]
            if is_rule:
                cells = ["---"] * len(cells)
            out.append("| " + " | ".join(cells) + " |")
            table_open = True
            continue
        if table_open:
            out.append("")
            table_open = False
        if not _PROGRESS.search(s):
            plain.append(line)
    flush_plain()
    return "\n".join(out).strip()


class _Tee(io.TextIOBase):
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


def capture_markdown(command: str, argv: list[str], run: Callable[[list[str]], object],
                     path: str = RESULTS) -> None:
    """Run ``run(argv without --markdown)``, printing as usual, then write its section."""
    section = command
    rest = []
    for a in argv:
        if a == "--markdown":
            continue
        if a.startswith("--markdown="):
            section = a.split("=", 1)[1]
            continue
        rest.append(a)
    _markers(section)   # a bad name fails before the benchmark runs
    buf = io.StringIO()
    with redirect_stdout(_Tee(sys.stdout, buf)):
        run(rest)
    header = (f"`python -m minivllm.bench {' '.join([command, *rest])}` "
              f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs)\n\n")
    write_section(section, header + to_markdown(buf.getvalue()), path)
    print(f"wrote section '{section}' of {path}")
