"""Runs vLLM 0.32's own unit tests for the components minivllm mirrors, whole, against minivllm.

``python tests/conformance/vllm_tests/run.py [pytest args]`` (the tests come from
``bash tests/conformance/setup_vllm.sh``). The run is a pytest process of its own, in minivllm's
venv, with this folder first on ``sys.path``: ``vllm`` there is the adapter, not vLLM.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_TESTS = Path(os.environ.get("MINIVLLM_VLLM_TESTS") or HERE.parent / ".vllm_tests")
MODULES = (
    "tests/v1/spec_decode/test_ngram.py",
    "tests/v1/sample/test_rejection_sampler.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_example_connector.py",
)


def command(*pytest_args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-c", str(HERE / "vllm_unit.ini"),
            "--rootdir", str(VLLM_TESTS), "--confcutdir", str(VLLM_TESTS / "tests" / "v1"),
            *pytest_args, *(a for a in MODULES if not any(p.endswith(".py") or "::" in p
                                                          for p in pytest_args))]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(VLLM_TESTS)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        "PYTHONHASHSEED": "0"}


def run(*pytest_args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command(*pytest_args), cwd=VLLM_TESTS, env=env(), timeout=timeout,
                          capture_output=True, text=True)


if __name__ == "__main__":
    sys.exit(subprocess.run(command(*sys.argv[1:]), cwd=VLLM_TESTS, env=env()).returncode)
