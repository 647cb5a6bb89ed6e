"""``python -m minivllm.exercises grade NB.ipynb [NB2.ipynb ...] [--csv FILE]`` (see grade.py).

Exit status 0 only when every check of every notebook passes."""
from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.exercises",
                                     description="Grade exercise notebooks (04, 07, or a copy).")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grade", help="run every notebook's exercises and every check")
    g.add_argument("notebooks", nargs="+", help="student .ipynb files")
    g.add_argument("--csv", help="also write the table to this CSV file")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds per exercise cell and check")
    g.add_argument("--max-output", type=int, default=100_000, help="bytes an exercise may print")
    g.add_argument("--only", action="append", metavar="N",
                   help="check exercise N alone (its number in the notebook, or its name; "
                        "repeatable); the others are 'not attempted'")
    args = parser.parse_args(argv)
    missing = [p for p in args.notebooks if not os.path.isfile(p)]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    if args.timeout <= 0 or args.max_output <= 0:
        parser.error("--timeout and --max-output must be positive")
    try:
        import ipykernel, jupyter_client, nbformat  # noqa: F401,E401
    except ImportError as e:
        parser.error(f"grading needs Jupyter ({e.name} is missing): pip install -e '.[notebooks]'")
    from minivllm.learn.exercises.grade import grade_notebook, table
    grades = {}
    for i, path in enumerate(args.notebooks, 1):
        print(f"grading {path} ({i}/{len(args.notebooks)}) ...", file=sys.stderr, flush=True)
        grades[path] = grade_notebook(path, args.timeout, args.max_output, args.only)
    if args.only and not any(r.attempted for res in grades.values() for r in res.values()):
        parser.error(f"--only {' '.join(args.only)}: no such exercise in these notebooks "
                     "(a number counts a notebook's exercises from 1, or give the name)")
    header, rows = table(grades)
    short = [[c.replace("ExerciseCheckError: ", "") for c in row] for row in rows]
    short = [[c if len(c) <= 44 else c[:41] + "..." for c in row] for row in short]
    widths = [max(len(r[i]) for r in [header, *short]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *short]:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    failures = [(p, n, r) for p, res in grades.items() for n, r in res.items()
                if r.attempted and not r.passed]
    if failures:
        print("\nFailures:")
        for path, name, r in failures:
            print(f"- {os.path.basename(path)} / {name}:\n    " + r.detail.strip().replace("\n", "\n    "))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
    total = sum(r.attempted for res in grades.values() for r in res.values())
    skipped = sum(not r.attempted for res in grades.values() for r in res.values())
    print(f"\n{total - len(failures)} of {total} checks passed"
          + (f" ({skipped} not attempted)" if skipped else ""), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
