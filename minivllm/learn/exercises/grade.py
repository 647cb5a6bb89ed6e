"""Grade a class's exercise notebooks: ``python -m minivllm.exercises grade NB.ipynb [...] [--csv F]``.

For each notebook, in a fresh Jupyter kernel (cwd: the notebook's folder): run its plain code cells
(imports, helpers) and its exercise cells (tagged ``exercise``), but not its check cells (the
student may have edited those); then run minivllm's own check (``CHECKS``) on every exercise the
notebook defines or its check cells name. Every cell and every check has a time limit; one that
raises, runs past it (the kernel is interrupted, or restarted and the definitions replayed) or
prints more than ``--max-output`` bytes fails that exercise only. The table, notebook x exercise,
says ``pass`` or ``FAIL`` with the check's first line (the failing case); the details follow.
``--only N`` (an exercise's number in its notebook, or its name; repeatable) checks those alone:
the others are ``not attempted``, neither passed nor failed.
"""
from __future__ import annotations

import ast
import os
import queue
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

CHECK_CALL = re.compile(r"exercises\.check_\w+\(\s*(\w+)\s*\)")


NOT_ATTEMPTED = "not attempted"


@dataclass
class Result:
    passed: bool
    detail: str = ""       # why it failed: the check's message (case, input, expected, got)
    attempted: bool = True  # False: left out by --only (neither passed nor failed)


def selected(exercises: list[str], only: Optional[list[str]]) -> set[str]:
    """The exercise names ``only`` picks: numbers count the notebook's exercise cells from 1."""
    if not only:
        return set(exercises)
    picked = set()
    for item in only:
        if item.isdigit() and 1 <= int(item) <= len(exercises):
            picked.add(exercises[int(item) - 1])
        elif item in exercises:
            picked.add(item)
    return picked


def defined_name(source: str) -> Optional[str]:
    """The first top-level function or class an exercise cell defines."""
    try:
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                return node.name
    except SyntaxError:
        pass
    m = re.search(r"^(?:def|class)\s+(\w+)", source, re.M)
    return m.group(1) if m else None


def split_cells(nb: Any) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(plain code cells, [(exercise name, source)], names the check cells check)."""
    plain, exercises, checked = [], [], []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if "exercise" in cell.metadata.get("tags", []):
            exercises.append((defined_name(cell.source) or "<unnamed exercise>", cell.source))
        elif CHECK_CALL.search(cell.source):
            checked += CHECK_CALL.findall(cell.source)
        elif cell.source.strip():
            plain.append(cell.source)
    return plain, exercises, checked


class Kernel:
    """One Jupyter kernel; ``run(code, timeout)`` -> (status, text): ok | error | timeout | output."""

    def __init__(self, cwd: str, max_output: int) -> None:
        from jupyter_client import KernelManager
        self.cwd, self.max_output = cwd, max_output
        self.km = KernelManager(kernel_name="python3")
        self.start()

    def start(self) -> None:
        env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.km.start_kernel(cwd=self.cwd, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def restart(self) -> None:
        self.kc.stop_channels()
        self.km.restart_kernel(now=True)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float) -> tuple[str, str]:
        msg_id = self.kc.execute(code, store_history=False, allow_stdin=False)
        deadline, out, nbytes, status = time.monotonic() + timeout, [], 0, "ok"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if not self._interrupt(msg_id):
                    self.restart()
                return "timeout", f"ran past the {timeout:.0f} s time limit"
            try:
                msg = self.kc.get_iopub_msg(timeout=max(remaining, 0.05))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                nbytes += len(content["text"])
                if len(out) < 200:
                    out.append(content["text"])
                if nbytes > self.max_output:
                    if not self._interrupt(msg_id):
                        self.restart()
                    return "output", f"printed more than {self.max_output} bytes"
            elif kind == "error":
                status = "error"
                out.append(f"{content['ename']}: {content['evalue']}")
            elif kind == "status" and content["execution_state"] == "idle":
                return status, "".join(out) if status == "ok" else out[-1]

    def _interrupt(self, msg_id: str, wait: float = 10.0) -> bool:
        """Interrupt the running cell and wait for the kernel to go idle again."""
        self.km.interrupt_kernel()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                continue
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                return True
        return False

    def close(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)


def grade_notebook(path: str, timeout: float = 60.0, max_output: int = 100_000,
                   only: Optional[list[str]] = None) -> dict[str, Result]:
    import nbformat
    from minivllm.learn.exercises import CHECKS
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:          # not a notebook at all: every exercise of it is unknown
        return {"<notebook>": Result(False, f"cannot read {path}: {type(e).__name__}: {e}")}
    plain, exercises, checked = split_cells(nb)
    results: dict[str, Result] = {}
    names = [n for n, _ in exercises]
    if only:
        chosen = selected(names, only)
        results = {n: Result(False, NOT_ATTEMPTED, attempted=False) for n in names if n not in chosen}
        checked = [n for n in checked if n in chosen]
    for name in checked:
        if name not in names and name not in results:
            results[name] = Result(False, f"no exercise cell defines {name}")
    kernel = Kernel(os.path.dirname(os.path.abspath(path)), max_output)
    try:
        replay: list[str] = []
        for source in plain:     # imports and helpers; a broken one shows up in the checks
            if kernel.run(source, max(timeout, 120.0))[0] == "ok":
                replay.append(source)
        defined = []
        for name, source in exercises:
            status, text = kernel.run(source, timeout)
            if status != "ok":
                results[name] = Result(False, f"the exercise cell {'raised ' if status == 'error' else ''}{text}")
                if status != "error":         # it may have left the kernel restarted: replay
                    _replay(kernel, replay, timeout)
            else:
                replay.append(source)
                defined.append(name)
        for name in defined:
            if name in results:                   # left out by --only
                continue
            if name not in CHECKS:
                results[name] = Result(False, f"no check for an exercise named {name} "
                                              f"(known: {', '.join(CHECKS)})")
                continue
            code = f"from minivllm.learn.exercises import CHECKS as _checks\n_checks[{name!r}]({name})"
            status, text = kernel.run(code, timeout)
            if status == "ok":
                results[name] = Result(True)
            else:
                results[name] = Result(False, text)
                if status != "error":
                    _replay(kernel, replay, timeout)
    finally:
        kernel.close()
    return results


def _replay(kernel: Kernel, sources: list[str], timeout: float) -> None:
    """After an interrupt that may have restarted the kernel: define everything that worked again."""
    for source in sources:
        kernel.run(source, max(timeout, 120.0))


def table(grades: dict[str, dict[str, Result]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the notebook x exercise table (full details in the cells)."""
    from minivllm.learn.exercises import CHECKS
    seen = {n for r in grades.values() for n in r}
    columns = [n for n in CHECKS if n in seen] + sorted(seen - set(CHECKS))
    rows = []
    for path, results in grades.items():
        row = [os.path.basename(path)]
        for name in columns:
            r = results.get(name)
            row.append("-" if r is None else "pass" if r.passed else NOT_ATTEMPTED
                       if not r.attempted else
                       "FAIL: " + " | ".join(ln.strip() for ln in r.detail.splitlines() if ln.strip()))
        rows.append(row)
    return ["notebook", *columns], rows
