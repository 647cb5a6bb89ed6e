"""The import contracts in pyproject.toml ([tool.importlinter]), checked by ``lint-imports``
(import-linter):

- the article's core never imports the extras (serving, disagg, bench, train, viz, exercises, the
  Redis and ZMQ connectors) or vLLM 0.32's overlays, directly or through another module;
- the layers (engine -> worker -> core -> KV transfer -> spec decode -> sampling -> model ->
  attention -> basics): no import runs back up, not even one for annotations only;
- no import circles between sibling modules or packages."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_contract_is_kept():
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    assert os.path.exists(exe) or shutil.which("lint-imports"), "pip install import-linter"
    out = subprocess.run([exe if os.path.exists(exe) else "lint-imports"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "3 kept, 0 broken" in out.stdout


def test_no_import_runs_up_even_for_annotations(tmp_path):
    """The layers hold with TYPE_CHECKING imports counted too: no annotation names a module of a
    higher layer. (The sibling rule still leaves out annotation-only imports: a module beside its
    host class, loaded only when asked for, may name that class in its annotations.)"""
    config = tmp_path / "pyproject.toml"
    with open(os.path.join(ROOT, "pyproject.toml")) as fh:
        text = fh.read()
    assert "exclude_type_checking_imports = true" in text
    config.write_text(text.replace("exclude_type_checking_imports = true",
                                   "exclude_type_checking_imports = false"))
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    out = subprocess.run([exe if os.path.exists(exe) else "lint-imports", str(config),
                          "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    verdict = re.search(r"^Layers:.*? (KEPT|BROKEN)$", out.stdout, re.S | re.M)
    assert verdict is not None and verdict.group(1) == "KEPT", out.stdout[-3000:]
