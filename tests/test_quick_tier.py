"""The quick tier (tests/quick.py) names only tests that exist, and covers each component: a
collect-only run under ``-m quick`` fails on a stale name (tests/conftest.py)."""
import os
import subprocess
import sys

from quick import QUICK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_tier_names_existing_tests():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "quick",
                          "--collect-only", *sorted(f"tests/{m}" for m in QUICK)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    collected = [line for line in out.stdout.splitlines() if "::" in line]
    assert {line.split("::")[0] for line in collected} == {f"tests/{m}" for m in QUICK}
    assert len(collected) > 200
