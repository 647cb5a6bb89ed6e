"""Self-study: ``minivllm grade NB.ipynb [...]`` (``python -m minivllm.learn.exercises grade``), a
learning aid (vLLM has no counterpart).

A student without a course checks their own notebooks with one command. For each notebook, named by
the path given:
1. it warns about an exercise defined in more than one cell (the notebook and the grade use the
   definition that ran last before the exercise's test cell);
2. nbgrader's own student-side check, its ``Validator`` (what ``nbgrader validate`` runs), runs the
   notebook top to bottom in a fresh kernel, with a time limit per cell: the notebook's own ✓ and
   the verdict agree, a correct answer in a new cell counts, an edited test cell is reported;
3. it prints pass or FAIL per exercise (a graded test cell, named by its ``grade_id`` without
   ``_test``), with the check's message: the case, the input, expected and got, and the hint.

The released notebooks hold the visible cases only; a course's autograde adds the hidden ones
(notebooks/course/README.md). Everything else (kernels, time limits, the gradebook) is nbgrader's;
this module is the two things nbgrader does not do: the duplicate-definition warning and the
per-exercise summary with the hints. Needs nbgrader: ``pip install "minivllm[classroom]"``.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from typing import Any, Optional

from minivllm.learn.exercises.isolate import is_test_cell, checks_of


@dataclass
class Verdict:
    exercise: str           # the test cell's grade_id without "_test"
    passed: bool
    message: str = ""       # why it failed: the check's message, hint included


@dataclass
class Report:
    path: str
    verdicts: list[Verdict]
    warnings: list[str]
    executed: Any = None    # the notebook as it ran (its outputs: what the student sees too)


def _parsed(source: str) -> Optional[ast.Module]:
    from minivllm.learn.exercises.isolate import _python_source
    try:
        return ast.parse(_python_source(source))
    except SyntaxError:
        return None


def defined_twice(nb: Any) -> list[str]:
    """A warning per exercise (a name a test cell checks) that more than one cell defines."""
    checked: list[str] = []
    for cell in nb.cells:
        if cell.cell_type == "code" and is_test_cell(cell):
            try:
                checked += [op["arg"] for op in checks_of(cell.source) if "check" in op]
            except SyntaxError:
                continue
    cells_of: dict[str, list[int]] = {}
    for number, cell in enumerate(nb.cells, 1):
        if cell.cell_type != "code" or is_test_cell(cell):
            continue
        tree = _parsed(cell.source)
        for node in tree.body if tree else []:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name in checked and number not in cells_of.setdefault(node.name, []):
                    cells_of[node.name].append(number)
    return [f"{name} is defined in cells {', '.join(map(str, cells[:-1]))} and {cells[-1]} "
            "(counting every cell from 1): the one that runs last before its check is graded"
            for name, cells in cells_of.items() if len(cells) > 1]


def _failure(cell: Any, timeout: int) -> str:
    """What a failed test cell says: its error (the check's message) or its stderr."""
    from nbconvert.filters import strip_ansi
    if any(out.get("ename") == "CellTimeoutError" for out in cell.get("outputs", [])):
        return (f"ran past the {timeout} s time limit and was interrupted: an endless loop? "
                "(the notebook's next cells still ran)")
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            return strip_ansi(f"{out.ename}: {out.evalue}")
        if out.output_type == "stream" and out.name == "stderr":
            return "wrote on stderr (a graded cell that does scores 0): " + out.text.strip()
    return "partial credit: the cell's last value is a number below its points"


def check_notebook(path: str, timeout: int = 60) -> Report:
    """Run ``path`` top to bottom with nbgrader's Validator and read each test cell's verdict."""
    import nbformat
    from nbgrader import utils
    from nbgrader.validator import Validator
    from traitlets.config import Config

    executed: list[Any] = []

    class _Validator(Validator):
        def _preprocess(self, nb):           # keep the executed notebook: one verdict per cell
            nb = super()._preprocess(nb)
            executed.append(nb)
            return nb

    config = Config()
    config.Execute.timeout = timeout
    config.Validator.ignore_checksums = False
    nb = nbformat.read(path, as_version=4)
    warnings = defined_twice(nb)
    tests = [c for c in nb.cells if is_test_cell(c)]
    if not tests:
        return Report(path, [], warnings + ["no graded test cell: a released exercise notebook "
                                            "(notebooks/04_exercises.ipynb, ...) has one per "
                                            "exercise"])
    validator = _Validator(config=config)
    try:
        results = validator.validate(os.path.abspath(path))
    except Exception as e:   # a dead kernel (os._exit, a segfault), a kernel that never started
        message = f"the notebook did not run to the end: {type(e).__name__}: {e}"
        return Report(path, [Verdict(_exercise(c), False, message) for c in tests], warnings)
    if results.get("type_changed"):
        warnings.append(f"{len(results['type_changed'])} cell(s) changed type (code <-> markdown)"
                        ": change them back, nbgrader grades by the released cell types")
        return Report(path, [Verdict(_exercise(c), False, "not run: a cell changed type")
                             for c in tests], warnings)
    if results.get("changed"):
        warnings.append(f"{len(results['changed'])} test cell(s) were edited: a course's grader "
                        "restores them, so a passing edit does not count")
    verdicts = []
    for cell in executed[0].cells if executed else []:
        if not is_test_cell(cell):
            continue
        score, points = utils.determine_grade(cell)
        passed = score is not None and score >= points
        verdicts.append(Verdict(_exercise(cell), passed, "" if passed else _failure(cell, timeout)))
    return Report(path, verdicts, warnings, executed[0] if executed else None)


def _exercise(cell: Any) -> str:
    grade_id = cell.metadata["nbgrader"]["grade_id"]
    return grade_id[:-len("_test")] if grade_id.endswith("_test") else grade_id


def print_report(report: Report) -> None:
    print(report.path)
    for warning in report.warnings:
        print(f"  warning: {warning}")
    width = max([len(v.exercise) for v in report.verdicts], default=0)
    for v in report.verdicts:
        print(f"  {'pass' if v.passed else 'FAIL'}  {v.exercise:<{width}}".rstrip())
        if not v.passed:
            print("        " + v.message.strip().replace("\n", "\n        "))
    passed = sum(v.passed for v in report.verdicts)
    print(f"  {passed} of {len(report.verdicts)} exercises pass\n")
