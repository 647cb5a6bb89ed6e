"""The learning aids live in ``minivllm/learn/``, and their old names keep working (the commands and
imports of DESIGN's public API): each old module re-exports the new home's names, and ``python -m``
at the old name runs the new home's ``main``."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

OLD_AND_NEW = [
    ("minivllm.tour", "minivllm.learn.tour", ("run", "main", "Tour", "TOURS", "pd_stops", "short")),
    ("minivllm.then_and_now", "minivllm.learn.then_and_now", ("THEN_AND_NOW", "describe", "diff", "main")),
    ("minivllm.notebooks", "minivllm.learn.notebooks", ("KERNEL_ENV", "EXERCISE_NOTEBOOKS",
                                                        "lesson_notebooks", "stale_cells", "main")),
    ("minivllm.viz", "minivllm.learn.viz", None),             # None: the new home's __all__
    ("minivllm.exercises", "minivllm.learn.exercises", None),
]


@pytest.mark.parametrize("old,new,names", OLD_AND_NEW, ids=[o for o, _, _ in OLD_AND_NEW])
def test_the_old_name_is_the_new_home(old, new, names):
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names or new_module.__all__:
        assert getattr(old_module, name) is getattr(new_module, name), name


@pytest.mark.parametrize("argv,printed", [
    (["minivllm.tour", "--help"], "usage: python -m minivllm.tour"),
    (["minivllm.exercises", "grade", "--help"], "usage: python -m minivllm.exercises grade"),
    (["minivllm.notebooks", "--help"], "usage: python -m minivllm.notebooks"),
    (["minivllm.then_and_now", "pd"], "pd.enter"),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_the_old_command_runs_the_new_home(argv, printed):
    proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert printed in proc.stdout, proc.stdout[:2000]
