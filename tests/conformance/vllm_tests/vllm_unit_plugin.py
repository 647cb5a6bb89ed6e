"""pytest plugin for the run of vLLM 0.32's unit tests against minivllm (loaded by run.py).

- Puts the adapter's ``vllm`` package first on ``sys.path`` (it is on it only in this run's
  process: the conformance suite's other tests run the real vLLM, in its own venv).
- Marks every test of ``EXPECTED_FAILURES`` as a strict xfail with its category and reason: an
  unexpected failure fails the run, and so does an unexpected pass.
- At the end, checks the table against the run: every entry names a collected test, and a test
  that skipped itself (vLLM's own skip marks: CUDA, ...) is listed as needing a GPU.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from expected_failures import EXPECTED_FAILURES, GPU  # noqa: E402

_collected: set[str] = set()
_skipped: dict[str, str] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    from vllm import _missing
    _missing.COLLECTING = True
    try:
        yield
    finally:
        _missing.COLLECTING = False


def pytest_collection_modifyitems(config, items):
    for item in items:
        _collected.add(item.nodeid)
        entry = EXPECTED_FAILURES.get(item.nodeid)
        if entry is not None:
            category, reason = entry
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"{category}: {reason}"))


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped[report.nodeid] = str(report.longrepr[-1] if isinstance(report.longrepr, tuple)
                                      else report.longrepr)


def table_problems() -> list[str]:
    problems = [f"in EXPECTED_FAILURES but not collected: {t}"
                for t in sorted(set(EXPECTED_FAILURES) - _collected)]
    for nodeid, why in sorted(_skipped.items()):
        if EXPECTED_FAILURES.get(nodeid, ("",))[0] != GPU:
            problems.append(f"skipped but not listed as needing a GPU: {nodeid} ({why})")
    return problems


def pytest_sessionfinish(session, exitstatus):
    if not _collected or session.config.getoption("collectonly") or session.config.args_filtered:
        return
    problems = table_problems()
    if problems:
        print("\nEXPECTED_FAILURES is stale:\n  " + "\n  ".join(problems), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser):
    parser.addoption("--subset", action="store_true",
                     help="a subset of the modules runs: skip the table's staleness check")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.args_filtered = bool(config.getoption("subset") or config.getoption("keyword")
                                or config.getoption("markexpr"))
