"""The import contracts in pyproject.toml ([tool.importlinter]), checked by ``lint-imports``
(import-linter):

- the article's core never imports the extras (serving, disagg, bench, train, the learning aids,
  the Redis and ZMQ connectors) or vLLM 0.32's overlays, directly or through another module;
- the engine and the server (every engine package and the basics) never import the learning aids
  (``minivllm.learn``: the tour, viz, exercises, notebooks, then-and-now);
- the engine (``minivllm.engine``, ``minivllm.core``, ``minivllm.worker``) never imports its
  simulator (``minivllm.sim``), which it builds only by name (``ParallelConfig.worker_cls``);
- the layers (learning aids -> engine -> worker -> core -> KV transfer -> sampling -> spec decode ->
  model -> attention -> basics): no import runs back up, not even one for annotations only;
- no import circles between sibling modules or packages, counting every import (those under
  ``TYPE_CHECKING`` and inside functions too); and none between any two modules
  (``code_stats.import_circles``): a module beside its host takes what it needs as arguments."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import code_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contract_is_kept():
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    assert os.path.exists(exe) or shutil.which("lint-imports"), "pip install import-linter"
    out = subprocess.run([exe if os.path.exists(exe) else "lint-imports"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "5 kept, 0 broken" in out.stdout


def test_the_contracts_count_annotation_imports():
    """The layers and the sibling rule hold with TYPE_CHECKING imports counted: no annotation names
    a module of a higher layer or closes a circle."""
    with open(os.path.join(ROOT, "pyproject.toml")) as fh:
        text = fh.read()
    assert "exclude_type_checking_imports = false" in text
    assert "exclude_type_checking_imports = true" not in text


def test_no_import_circle_counting_every_import():
    circles = code_stats.import_circles()
    assert not circles, f"modules that import one another (every import counted): {circles}"


def test_import_circles_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert code_stats.import_circles(graph) == [["a", "b", "c"]]
    assert code_stats.import_circles({"a": {"b"}, "b": set()}) == []
