"""The import contracts in pyproject.toml ([tool.importlinter]), checked by ``lint-imports``
(import-linter):

- the article's core never imports the extras (serving, disagg, bench, train, viz, exercises, the
  Redis and ZMQ connectors) or vLLM 0.32's overlays, directly or through another module;
- the layers (engine -> worker -> core -> KV transfer -> spec decode -> sampling -> model ->
  attention -> basics): no import runs back up;
- no import circles between sibling modules or packages."""
from __future__ import annotations

import os
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
