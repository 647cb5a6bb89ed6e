"""The whole suite on every core: ``python tests/suite.py [pytest args]`` (the README's test command).

Two pytest runs, one after the other:
1. **Side by side.** Every test not marked ``serial``, on ``-n`` workers (pytest-xdist; one per core,
   at most 2 unless ``MINIVLLM_TEST_WORKERS`` says otherwise), each group on one worker (``--dist
   loadscope`` with tests/conftest.py's scopes: a module, or the whole conformance suite), the groups that are long by what
   they do handed out first (``--no-loadscope-reorder`` keeps that order). Each worker runs torch on **one**
   intra-op thread (``OMP_NUM_THREADS=1``): with two threads per worker on two cores the workers
   fight for the cores and the run is slower than serial.
2. **Alone.** The tests marked ``serial`` (``SERIAL`` in tests/conftest.py: a Ray cluster), with the
   machine to themselves and torch's default threads.

Arguments go to both runs (paths, ``-k``, ``-x``, ...); ``-m EXPR`` is combined with each run's own
marker, so ``python tests/suite.py -m quick`` runs the quick tier the same way. The exit status is
pytest's: 0 when both runs passed (a run with no test selected counts as passed when the other ran
some). ``python -m pytest -q`` still runs everything in one process, serially.
"""
from __future__ import annotations

import os
import subprocess
import sys

NO_TESTS = 5   # pytest.ExitCode.NO_TESTS_COLLECTED


def split_marker(args: list[str]) -> tuple[str | None, list[str]]:
    """``-m EXPR`` (or ``-mEXPR``, ``-m=EXPR``) out of ``args``: (EXPR or None, the rest)."""
    marker, rest, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a == "-m" and i + 1 < len(args):
            marker, i = args[i + 1], i + 2
            continue
        if a.startswith("-m") and len(a) > 2:
            marker = a[2:].lstrip("=")
        else:
            rest.append(a)
        i += 1
    return marker, rest


def workers() -> int:
    n = os.environ.get("MINIVLLM_TEST_WORKERS")
    return int(n) if n else max(1, min(2, os.cpu_count() or 1))


def main(argv: list[str]) -> int:
    marker, rest = split_marker(argv)

    def expr(own: str) -> str:
        return f"({marker}) and {own}" if marker else own

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pytest = [sys.executable, "-m", "pytest", "-q"]
    side_by_side = pytest + ["-n", str(workers()), "--dist", "loadscope", "--no-loadscope-reorder",
                             "-m", expr("not serial"), *rest]
    alone = pytest + ["-m", expr("serial"), *rest]
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    print("== side by side:", " ".join(side_by_side[1:]), flush=True)
    first = subprocess.call(side_by_side, cwd=root, env=one_thread)
    print("== alone:", " ".join(alone[1:]), flush=True)
    second = subprocess.call(alone, cwd=root)
    codes = {first, second}
    if codes == {NO_TESTS}:
        return NO_TESTS
    codes.discard(NO_TESTS)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
