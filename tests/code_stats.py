"""Readability numbers for the article's path: code lines of a function, and the minivllm lines a
script loads. Used by tests/test_readable_core.py and the README's reading order.

A *code line* is a line of a function's source that is not blank, not a comment and not part of its
docstring: what a reader stepping through it has to read.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from minivllm.utils import resolve_obj_by_qualname

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve(qualname: str, file: str) -> Any:
    """``"Scheduler.schedule"`` in ``"core/sched/scheduler.py"`` -> the function object."""
    module = "minivllm." + file[:-3].replace("/", ".")
    return inspect.unwrap(resolve_obj_by_qualname(f"{module}.{qualname}"))


def _source_lines(func: Any, signature: bool) -> list[str]:
    """``func``'s body lines after its docstring; with ``signature``, its decorators and ``def``
    lines first."""
    source = textwrap.dedent(inspect.getsource(func))
    body = ast.parse(source).body[0].body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)
    rest = body[1:] if doc else body
    lines = source.splitlines()
    code = lines[rest[0].lineno - 1:] if rest else []
    return lines[:body[0].lineno - 1] + code if signature else code


def code_lines(func: Any) -> int:
    """Code lines of the body only: the decorators and the signature are not counted."""
    return sum(1 for line in _source_lines(func, signature=False)
               if line.strip() and not line.strip().startswith("#"))


def code_text(func: Any) -> str:
    """The function's source without its docstring and comment lines (what the name rules read)."""
    return "\n".join(line.split("  #")[0] for line in _source_lines(func, signature=True)
                     if not line.strip().startswith("#"))


_REPORT = """
import json as _json, os as _os, sys as _sys
_pkg = _os.path.dirname(_sys.modules["minivllm"].__file__)
_files = sorted(m.__file__ for n, m in list(_sys.modules.items())
                if n.split(".")[0] == "minivllm" and getattr(m, "__file__", None))
print("LOADED " + _json.dumps({_os.path.relpath(f, _pkg): sum(1 for _ in open(f)) for f in _files}))
"""


def loaded_lines(script: str, env: "dict[str, str] | None" = None, cwd: str = ROOT,
                 timeout: float = 900) -> dict[str, int]:
    """Run the Python source ``script`` in a fresh process; -> {file under minivllm/: its line
    count} for every minivllm module it imported."""
    out = subprocess.run([sys.executable, "-c", script + _REPORT], cwd=cwd,
                         env={**os.environ, **(env or {})}, capture_output=True, text=True,
                         timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("LOADED "):
            return json.loads(line[len("LOADED "):])
    raise RuntimeError(f"the script failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def package_lines(root: str = os.path.join(ROOT, "minivllm")) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f)) as fh:
                    total += sum(1 for _ in fh)
    return total
