"""Every package file a notebook names exists, and defines the function or class named beside it.

A notebook names code as `` `Name` (`path.py`) ``, `` `Name` in `path.py` `` or just `` `path.py` ``.
Paths are looked up in the repository, then under ``minivllm/`` (the notebooks often drop that
prefix). vLLM's own paths are left out: ``v1/...`` and ``vllm/...``, a path with "vLLM" in the 100
characters before it, and a bare file name that is not in the package's top folder.
"""
from __future__ import annotations

import json
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(REPO, "notebooks")
SPAN = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w./-]+\.py$")
NAME = re.compile(r"^[A-Za-z_][\w.]*(\(\))?$")
BETWEEN = re.compile(r"^\s*(\(|in|\(in|from|of|,)\s*$")     # `Name` (`path.py`), `Name` in `path.py`


def _resolve(path: str, before: str = ""):
    """The file a notebook path means, None for vLLM's own paths, "" when it does not exist."""
    if path.startswith(("v1/", "vllm/", "vllm_")) or "vLLM" in before[-100:]:
        return None
    if "/" not in path and not os.path.isfile(os.path.join(REPO, "minivllm", path)):
        return None
    for root in (REPO, os.path.join(REPO, "minivllm"), os.path.join(REPO, "minivllm", "model_executor")):
        full = os.path.join(root, path)
        if os.path.isfile(full):
            return full
    return ""


def _defines(source: str, name: str) -> bool:
    last = name.removesuffix("()").split(".")[-1]
    return re.search(rf"^\s*(async\s+def|def|class)\s+{re.escape(last)}\b|^\s*{re.escape(last)}\s*[:=]",
                     source, re.M) is not None


def references(text: str):
    """(path, name or None, the text before the path) for every backticked .py path in ``text``."""
    spans = list(SPAN.finditer(text))
    for i, m in enumerate(spans):
        if not PATH.match(m.group(1)):
            continue
        name = None
        if i and NAME.match(spans[i - 1].group(1)) and not PATH.match(spans[i - 1].group(1)) and \
                BETWEEN.match(text[spans[i - 1].end():m.start()]):
            name = spans[i - 1].group(1)
        yield m.group(1), name, text[:m.start()]


def notebook_references():
    for name in sorted(os.listdir(NB_DIR)):
        if name.endswith(".ipynb"):
            nb = json.load(open(os.path.join(NB_DIR, name)))
            for i, cell in enumerate(nb["cells"]):
                if cell["cell_type"] == "markdown":
                    for path, obj, before in references("".join(cell["source"])):
                        yield f"{name} cell {i}", path, obj, before


def test_the_reference_finder_reads_the_forms_the_notebooks_use():
    text = ("Put a breakpoint in `Scheduler._update_waiting_for_remote_kv`\n  (`core/sched/scheduler.py`)"
            " and in `sample_recovered_tokens_torch` in `minivllm/sample/rejection_sampler.py`; "
            "see `v1/worker/gpu_model_runner.py`, `x + y` (`trace.py`).")
    assert [r[:2] for r in references(text)] == [("core/sched/scheduler.py", "Scheduler._update_waiting_for_remote_kv"),
                                      ("minivllm/sample/rejection_sampler.py", "sample_recovered_tokens_torch"),
                                      ("v1/worker/gpu_model_runner.py", None), ("trace.py", None)]
    assert _resolve("v1/worker/gpu_model_runner.py") is None and _resolve("gpu_model_runner.py") is None
    assert _resolve("x/y.py", "as vLLM's ") is None and _resolve("core/sched/nowhere.py") == ""
    assert _resolve("trace.py").endswith("minivllm/trace.py")
    scheduler = open(os.path.join(REPO, "minivllm/core/sched/scheduler.py")).read()
    assert _defines(scheduler, "Scheduler.schedule") and not _defines(scheduler, "Scheduler.nowhere_defined")


def test_every_package_path_a_notebook_names_exists_and_defines_the_name_beside_it():
    problems = []
    for where, path, name, before in notebook_references():
        full = _resolve(path, before)
        if full is None:
            continue
        if not full:
            problems.append(f"{where}: `{path}` does not exist")
        elif name and not _defines(open(full).read(), name):
            problems.append(f"{where}: `{path}` does not define `{name}`")
    assert not problems, "\n".join(problems)
