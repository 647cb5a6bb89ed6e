"""Readability numbers for the article's path: code lines of a function, and the minivllm lines a
script loads. Used by tests/test_readable_core.py and the README's reading order.

A *code line* is a line of a function's source that is not blank, not a comment and not part of its
docstring: what a reader stepping through it has to read.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve(qualname: str, file: str) -> Any:
    """``"Scheduler.schedule"`` in ``"core/sched/scheduler.py"`` -> the function object."""
    module = importlib.import_module("minivllm." + file[:-3].replace("/", "."))
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)


def code_lines(func: Any) -> int:
    source = textwrap.dedent(inspect.getsource(func))
    node = ast.parse(source).body[0]
    skip: set[int] = set()
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                             ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    # The body only: the decorators and the signature are not counted.
    first = min(n.lineno for n in body if n.lineno not in skip) if body else 0
    count = 0
    for i, line in enumerate(source.splitlines(), start=1):
        text = line.strip()
        if i < first or i in skip or not text or text.startswith("#"):
            continue
        count += 1
    return count


def code_text(func: Any) -> str:
    """The function's source without its docstring and comment lines (what the name rules read)."""
    source = textwrap.dedent(inspect.getsource(func))
    node = ast.parse(source).body[0]
    body = getattr(node, "body", [])
    skip: set[int] = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                             ast.Constant):
        skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = [l for i, l in enumerate(source.splitlines(), start=1)
             if i not in skip and not l.strip().startswith("#")]
    return "\n".join(l.split("  #")[0] for l in lines)


_LOADED = """
import runpy, sys, os
sys.argv = [{module!r}]
runpy.run_module({module!r}, run_name="__main__")
pkg = os.path.dirname(sys.modules["minivllm"].__file__)
files = sorted(m.__file__ for n, m in list(sys.modules.items())
               if n.split(".")[0] == "minivllm" and getattr(m, "__file__", None))
import json
print("LOADED " + json.dumps({{os.path.relpath(f, pkg): sum(1 for _ in open(f)) for f in files}}))
"""


def loaded_lines(module: str, env: "dict[str, str] | None" = None, cwd: str = ROOT,
                 timeout: float = 900) -> dict[str, int]:
    """Run ``python -m module`` in a fresh process; -> {file under minivllm/: its line count} for
    every minivllm module it imported."""
    out = subprocess.run([sys.executable, "-c", _LOADED.format(module=module)], cwd=cwd,
                         env={**os.environ, **(env or {})}, capture_output=True, text=True,
                         timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("LOADED "):
            return json.loads(line[len("LOADED "):])
    raise RuntimeError(f"{module} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def package_lines(root: str = os.path.join(ROOT, "minivllm")) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f)) as fh:
                    total += sum(1 for _ in fh)
    return total
