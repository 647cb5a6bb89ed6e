"""``python -m minivllm.learn.exercises COMMAND``:

- ``grade NB.ipynb [...]``: self-study, each notebook run by nbgrader's validator, pass or FAIL per
  exercise with the check's hint (grade.py; ``minivllm grade`` is the same command). Exit status 0
  only when every exercise of every notebook passes;
- ``release``: the student notebooks ``notebooks/<nb>.ipynb``, written by nbgrader's
  ``generate_assignment`` from the course's source notebooks (course.py);
- ``screenshot HTML PNG``: a PNG of an HTML page (a feedback page) by headless Chromium.

All three need nbgrader: ``pip install "minivllm[classroom]"``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional

PROG = "python -m minivllm.learn.exercises"


def _needs_nbgrader(parser: argparse.ArgumentParser) -> None:
    if importlib.util.find_spec("nbgrader") is None:
        parser.error("this command runs nbgrader, which is not installed: "
                     "pip install \"minivllm[classroom]\" (or pip install \"nbgrader>=0.9.6\")")


def main(argv: Optional[list[str]] = None, prog: str = PROG) -> int:
    parser = argparse.ArgumentParser(prog=prog, description="The classroom exercises: check a "
                                     "notebook alone, or write the student notebooks.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grade", help="check exercise notebooks alone (nbgrader's validator)",
                       description="Run each notebook top to bottom (nbgrader's validator) and "
                                   "print pass or FAIL per exercise, with the check's hint.")
    g.add_argument("notebooks", nargs="+", help="exercise notebooks (.ipynb)")
    g.add_argument("--timeout", type=int, default=60, help="seconds per cell (default 60)")
    r = sub.add_parser("release", help="write notebooks/<nb>.ipynb from the course's sources")
    r.add_argument("--course", default=None, help="the course folder (default notebooks/course)")
    r.add_argument("--out", default=None, help="where the notebooks go (default notebooks/)")
    s = sub.add_parser("screenshot", help="a PNG of an HTML page (headless Chromium)")
    s.add_argument("html")
    s.add_argument("png")
    s.add_argument("--size", default="1100,1500", help="window WIDTH,HEIGHT in pixels")
    args = parser.parse_args(argv)

    if args.command == "grade":
        missing = [p for p in args.notebooks if not os.path.isfile(p)]
        if missing:
            parser.error(f"no such notebook: {', '.join(missing)}")
        if args.timeout <= 0:
            parser.error("--timeout must be positive")
        _needs_nbgrader(parser)
        from minivllm.learn.exercises.grade import check_notebook, print_report
        reports = []
        for path in args.notebooks:
            reports.append(check_notebook(path, timeout=args.timeout))
            print_report(reports[-1])
        ok = all(v.passed for rep in reports for v in rep.verdicts) and all(
            rep.verdicts for rep in reports)
        return 0 if ok else 1
    if args.command == "release":
        _needs_nbgrader(parser)
        from minivllm.learn.exercises import course
        for path in course.release(args.course or course.COURSE_DIR,
                                   args.out or course.NOTEBOOKS_DIR):
            print(path)
        return 0
    from minivllm.learn.exercises.course import screenshot
    width, _, height = args.size.partition(",")
    screenshot(args.html, args.png, int(width), int(height))
    print(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
