"""Isolated grading: every autograded test cell's checks run again outside the student's kernel.
A learning aid of the course (vLLM has no counterpart); it serves every exercise's article step.

nbgrader runs a submission top to bottom in the student's own kernel, hidden tests included, so a
cell of the student's can change what the test cells call: ``exercises.CHECKS.update(...)``, a
check function replaced in ``sys.modules``, the comparison helpers a check uses (``spec._fail``,
``spec._call``) or the guard against the package's own implementation (``no_forbidden_calls``)
patched to do nothing. ``IsolatedChecks`` is an autograde preprocessor that runs right after
nbgrader's ``Execute`` (notebooks/course/nbgrader_config.py puts it there) and grades each test
cell again, in a fresh Python process:

1. The student's definitions: every code cell that is not a locked test cell, in order, parsed with
   ``ast``; only its top-level ``import``, ``def``, ``class`` and assignments of a literal to a
   plain name are kept. Everything else (calls, expressions, attribute or item assignments:
   where a patch lives) is dropped, and the cell's output in the autograded notebook says which
   lines were ignored. A cell that stopped with an error when the notebook ran keeps only the
   statements before the one that raised (the rest never ran). The kept code is compiled as file
   ``<student>`` (the registry's ``no_forbidden_calls`` recognises the student's frames by it) and
   run cell by cell up to each test cell, as the notebook runs top to bottom: a later definition
   wins, so the notebook's own ✓ and the grade agree.
2. The checks: the test cell's source (the autograded notebook's, restored by nbgrader from its
   gradebook, hidden tests included) is parsed for ``exercises.check_<name>(<arg>, cases="...")``;
   each is looked up by its name in the registry (``registry.EXERCISES``), which the fresh process
   reads before any student code runs. Any other statement of a test cell (a teacher's own hidden
   case) runs as written, in the student's namespace.
3. The fresh process (``sys.executable``, cwd the notebook's folder, the folder itself not on
   ``sys.path`` before the checks are imported) reads its job and a random nonce on stdin, imports
   every check module, records an integrity snapshot (every function, class and method of the
   loaded ``minivllm`` modules, of ``torch``, ``torch.Tensor``, ``numpy``, ``builtins`` and
   ``math``; the registry's tables ``EXERCISES`` and ``CHECKS``, shallowly), then runs the student's
   definitions and each exercise's checks, and after each exercise compares the snapshot: a changed
   or deleted entry fails it ("your code changed minivllm.learn.exercises.spec._fail: a solution
   may not change the checks"). It writes one line per exercise, prefixed with the nonce, on a
   descriptor of its own (the student's prints go to a buffer, file descriptor 1 to /dev/null), so
   no print can fake a pass.
4. Each exercise has its own time limit (``IsolatedChecks.timeout``). On a time-out the parent kills
   the process's group and starts a new one for the remaining exercises; no result line, a crash or
   a dead process fails that exercise with a message. A passed exercise's cell shows the check's
   ✓ line; a failed one an ``error`` output with the check's message (nbgrader scores it 0).

What it defends against: the attacks above, from any student cell, hidden or not, and from the
student's functions while a check runs them; a wrong answer the student's kernel computed
elsewhere; a student print that imitates a result. What it does not: Python gives the code it runs
the whole process, so a determined student can still introspect it (walk the frames to the nonce
and the result descriptor, patch something the snapshot does not cover: a check's data (its
table of cases), a module loaded after the snapshot, C-level state; start a thread that undoes a
patch before the comparison). A class body, a decorator and a default value run when they are defined, so they run
here too; what they change is caught by the snapshot. The process is not a sandbox: it can read
and write what the grader can.
"""
from __future__ import annotations

import ast
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Optional

from nbformat import NotebookNode

try:
    from nbgrader.preprocessors import NbGraderPreprocessor
except ImportError:                      # nbgrader is the [classroom] extra; the child needs none
    from nbconvert.preprocessors import Preprocessor as NbGraderPreprocessor
from traitlets import Integer, List, Unicode

RESULT_MAX_CHARS = 20_000       # a failure message longer than this is cut
LINE_MAX_BYTES = 1 << 20        # a longer line from the fresh process is not a result
CHECK_MODULES = ("minivllm.learn.exercises",)


# ------------------------------------------------------------------ the job: what the child runs
@dataclass
class GradedCell:
    """One graded test cell: ``ops`` run in order; the first failure fails the exercise."""
    grade_id: str
    cell: int                                      # the test cell's index in the notebook
    # {"check": name, "arg": source, "cases": ..., "line": n} or {"exec": source, "line": n}
    ops: list[dict] = field(default_factory=list)


def _python_source(source: str) -> str:
    """A cell's source as plain Python (IPython's magics become calls, which are then dropped)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return source
    try:
        return TransformerManager().transform_cell(source)
    except Exception:
        return source


def _is_literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _kept(node: ast.stmt) -> bool:
    """A top-level statement graded as the student's definition (see the module docstring)."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef,
                         ast.ClassDef)):
        return True
    if isinstance(node, ast.Assign):
        return all(isinstance(t, ast.Name) for t in node.targets) and _is_literal(node.value)
    if isinstance(node, ast.AnnAssign):
        return (isinstance(node.target, ast.Name) and node.value is not None
                and _is_literal(node.value))
    return False


def _first_line(source: str, node: ast.stmt) -> str:
    text = (ast.get_source_segment(source, node) or "").strip().splitlines() or [""]
    line = text[0]
    return line if len(line) <= 70 and len(text) == 1 else line[:67] + "..."


def raised_at(cell: NotebookNode) -> Optional[int]:
    """The line where the cell stopped with an error when the notebook ran (0: somewhere), or
    None. Read from the student's own run, this can only drop their definitions, never add any."""
    import re
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(out.get("traceback", [])))
            found = re.search(r"Cell In\[\d+\], line (\d+)", text)
            return int(found.group(1)) if found else 0
    return None


def student_statements(source: str, stop: Optional[int] = None) -> tuple[list[dict], list[str]]:
    """(kept statements as {"line", "source"}, notes on what is ignored) for one student cell;
    ``stop``: the line where the cell raised when it ran (it and what follows never ran)."""
    source = _python_source(source)
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [], [f"ignored when graded: the whole cell (it does not parse: line {e.lineno}, "
                    f"{e.msg})"]
    kept, notes = [], []
    for node in tree.body:
        if stop is not None and node.end_lineno >= stop:
            notes.append(f"ignored when graded: line {node.lineno} onwards (your notebook stopped "
                         f"at line {stop or '?'} of this cell with an error, so it never ran)")
            break
        if isinstance(node, ast.Pass) or (isinstance(node, ast.Expr)
                                          and isinstance(node.value, ast.Constant)):
            continue                                   # a docstring, `pass`, `...`: nothing
        if _kept(node):
            # Decorators come first in the source; the statement's code starts at the first one.
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            lines = source.splitlines()[start - 1:node.end_lineno]
            kept.append({"line": start, "source": "\n".join(lines)})
        else:
            notes.append(f"ignored when graded: line {node.lineno}, top-level "
                         f"{type(node).__name__.lower()} `{_first_line(source, node)}` (only "
                         "imports, def, class and literal assignments are graded)")
    return kept, notes


def _check_call(node: ast.stmt) -> Optional[tuple[str, str, str]]:
    """``exercises.check_<name>(<arg>, cases="...")`` -> (check name, arg source, cases)."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return None
    call = node.value
    func = call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "exercises" and func.attr.startswith("check_")
            and len(call.args) == 1):
        return None
    cases = "all"
    for kw in call.keywords:
        if kw.arg != "cases" or not isinstance(kw.value, ast.Constant):
            return None
        cases = kw.value.value
    return func.attr, ast.unparse(call.args[0]), cases


def checks_of(source: str) -> list[dict]:
    """A test cell's statements: its check calls, and any other statement as code to run."""
    source = _python_source(source)
    ops = []
    for node in ast.parse(source).body:
        call = _check_call(node)
        if call:
            ops.append({"check": call[0], "arg": call[1], "cases": call[2], "line": node.lineno})
        else:
            ops.append({"exec": ast.get_source_segment(source, node), "line": node.lineno})
    return ops


def _nbgrader(cell: NotebookNode) -> dict:
    return cell.metadata.get("nbgrader", {}) if "metadata" in cell else {}


def is_test_cell(cell: NotebookNode) -> bool:
    """An autograded test cell: a code cell nbgrader grades, not a student's answer."""
    meta = _nbgrader(cell)
    return cell.cell_type == "code" and bool(meta.get("grade")) and not meta.get("solution")


def build_job(nb: NotebookNode) -> tuple[list[dict], list[GradedCell], dict[int, list[str]]]:
    """(student cells [{"index", "statements"}], exercises, {cell index: notes}) of a notebook."""
    cells, exercises, notes = [], [], {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if is_test_cell(cell):
            try:
                ops = checks_of(cell.source)
            except SyntaxError as e:
                ops = [{"exec": cell.source, "line": e.lineno or 1}]
            exercises.append(GradedCell(grade_id=_nbgrader(cell)["grade_id"], cell=index, ops=ops))
        else:
            kept, ignored = student_statements(cell.source, raised_at(cell))
            cells.append({"index": index, "statements": kept})
            if ignored:
                notes[index] = ignored
    return cells, exercises, notes


# ------------------------------------------------------------------ the parent: run and collect
@dataclass
class Result:
    grade_id: str
    passed: bool
    stdout: str = ""           # the check's ✓ line(s)
    ename: str = ""
    message: str = ""


class _Child:
    """One fresh grading process; ``lines`` gets the payloads of its result lines (those that
    carry the nonce), then None at EOF. Any other output is the student's and is dropped."""

    def __init__(self, job: dict, cwd: str) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.nonce = job["nonce"]
        code = ("import os, sys\n"
                "sys.path[:] = [p for p in sys.path if p not in ('', '.', os.getcwd())]\n"
                "from minivllm.learn.exercises.fresh import child_main\n"
                "child_main()\n")
        env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in [_package_root(),
                                                         os.environ.get("PYTHONPATH")] if p)}
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, start_new_session=True)
        self.lines: "queue.Queue[Optional[dict]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, args=(json.dumps(job).encode(),),
                         daemon=True).start()

    def _write(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except OSError:     # it died before reading its job: the reader sees EOF
            pass

    def _read(self) -> None:
        prefix = (self.nonce + " ").encode()
        while True:
            raw = self.proc.stdout.readline(LINE_MAX_BYTES)
            if not raw:
                break
            if raw.startswith(prefix) and raw.endswith(b"\n"):
                try:
                    payload = json.loads(raw[len(prefix):].decode("utf-8", "replace"))
                except ValueError:
                    continue
                if isinstance(payload, dict):
                    self.lines.put(payload)
        self.lines.put(None)

    def next_payload(self, timeout: float) -> tuple[str, Optional[dict]]:
        """("ok", payload) | ("timeout", None) | ("eof", None)."""
        try:
            payload = self.lines.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return "timeout", None
        return ("eof", None) if payload is None else ("ok", payload)

    def how_it_ended(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        self.stderr.seek(0)
        tail = self.stderr.read().decode("utf-8", "replace").strip().splitlines()[-3:]
        return f"exit status {code}" + (": " + " | ".join(tail) if tail else "")

    def kill(self) -> None:
        """Kill the whole process group (the student's code may have started processes)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.stderr.close()


def _package_root() -> str:
    """The folder that holds the ``minivllm`` package this process imported."""
    import minivllm
    return os.path.dirname(os.path.dirname(os.path.abspath(minivllm.__file__)))


def run_isolated(cells: list[dict], exercises: list[GradedCell], cwd: str, timeout: float,
                 startup_timeout: float = 180.0,
                 check_modules: tuple[str, ...] = CHECK_MODULES) -> list[Result]:
    """Every exercise's result, from as few fresh processes as time-outs and crashes allow."""
    results: list[Result] = []
    todo = list(exercises)
    while todo:
        nonce = secrets.token_hex(16)
        job = {"nonce": nonce, "check_modules": list(check_modules), "cells": cells,
               "exercises": [{"grade_id": e.grade_id, "cell": e.cell, "ops": e.ops} for e in todo]}
        child = _Child(job, cwd)
        try:
            status, payload = child.next_payload(startup_timeout)
            if status != "ok" or not payload.get("ready"):
                why = ("did not start within the time limit" if status == "timeout"
                       else f"died before the checks ran ({child.how_it_ended()})")
                results += [Result(e.grade_id, False, ename="GradingError",
                                   message=f"the grading process {why}") for e in todo]
                return results
            while todo:
                exercise = todo.pop(0)
                status, payload = child.next_payload(timeout)
                if status == "ok":
                    results.append(_result(exercise, payload))
                    continue
                if status == "timeout":
                    message = (f"{exercise.grade_id} ran past the {timeout:g} s time limit (the "
                               "checks ran again in a fresh process): an endless loop?")
                    results.append(Result(exercise.grade_id, False, ename="TimeoutError",
                                          message=message))
                else:
                    message = (f"the process running {exercise.grade_id}'s checks died "
                               f"({child.how_it_ended()})")
                    results.append(Result(exercise.grade_id, False, ename="GradingError",
                                          message=message))
                break           # a fresh process for the exercises left
        finally:
            child.kill()
    return results


def _result(exercise: GradedCell, payload: dict) -> Result:
    """The result line's payload as a Result (only the fields a result has, as text)."""
    if payload.get("grade_id") != exercise.grade_id:
        return Result(exercise.grade_id, False, ename="GradingError",
                      message=f"the grading process answered for {payload.get('grade_id')!r} "
                              f"where {exercise.grade_id!r} was due")
    return Result(exercise.grade_id, payload.get("passed") is True,
                  stdout=str(payload.get("stdout", ""))[:RESULT_MAX_CHARS],
                  ename=str(payload.get("ename", "")), message=str(payload.get("message", "")))


class IsolatedChecks(NbGraderPreprocessor):
    """Autograde preprocessor, right after ``Execute``: each test cell's outputs become the result
    of its checks run again outside the student's kernel (see the module docstring)."""

    timeout = Integer(60, help="Seconds per exercise in the fresh process.").tag(config=True)
    startup_timeout = Integer(
        180, help="Seconds the fresh process may take to import the checks.").tag(config=True)
    check_modules = List(
        Unicode(), list(CHECK_MODULES),
        help="Modules that register the checks with @exercise, imported before the student's "
             "code runs (minivllm.learn.exercises imports every check module).").tag(config=True)

    def preprocess(self, nb: NotebookNode, resources: dict) -> tuple[NotebookNode, dict]:
        cells, exercises, notes = build_job(nb)
        for index, lines in notes.items():
            nb.cells[index].outputs.append(NotebookNode(
                output_type="stream", name="stdout", text="\n".join(lines) + "\n"))
        if not exercises:
            return nb, resources
        cwd = (resources.get("metadata") or {}).get("path") or os.getcwd()
        results = run_isolated(cells, exercises, cwd, self.timeout, self.startup_timeout,
                               tuple(self.check_modules))
        for exercise, result in zip(exercises, results):
            cell = nb.cells[exercise.cell]
            kernel_failed = any(o.output_type == "error" or (o.output_type == "stream"
                                                              and o.name == "stderr")
                                for o in cell.outputs)
            cell.outputs = [_output(result, kernel_failed)]
            self.log.info("%s: %s (checked in a fresh process)", result.grade_id,
                          "passed" if result.passed else "failed")
        return nb, resources


def _output(result: Result, kernel_failed: bool) -> NotebookNode:
    if result.passed:
        text = result.stdout or f"\u2713 {result.grade_id}: passed\n"
        return NotebookNode(output_type="stream", name="stdout", text=text)
    message = result.message[:RESULT_MAX_CHARS]
    traceback = [f"\x1b[0;31m{result.ename}\x1b[0m: {message}"]
    if not kernel_failed:
        traceback.append("(This cell passed when your notebook ran; graded again on your "
                         "definitions alone, in a fresh process, it failed as above.)")
    return NotebookNode(output_type="error", ename=result.ename, evalue=message,
                        traceback=traceback)
