"""The lesson notebooks, stored executed, and the rule that keeps their stored outputs true.

    python -m minivllm.notebooks refresh          # re-run every lesson notebook, store its outputs
    python -m minivllm.notebooks refresh 02_speculative_decoding.ipynb     # one (or a few) of them
    python -m minivllm.notebooks check            # re-run and compare with what is stored (as CI)

A lesson notebook is stored with its outputs, so that a reader sees its numbers, tables and figures
on the repository's web page before running anything. The exercise notebooks (EXERCISE_NOTEBOOKS)
are stored unexecuted: their cells are the learner's.

Stored outputs come from the run CI repeats: the same kernel environment (KERNEL_ENV: one intra-op
thread, fixed hash seed, the fast mode that notebooks which still have one read). CI compares every
stored *text* output with a fresh run's by nbval's rule (its own ``compare_outputs``: streams merged
per name, images and widget model ids skipped, every text first passed through the patterns of
``notebooks/nbval_sanitize.cfg``, each listed there with its reason), after leaving progress bars
out (``is_progress_bar``). ``pytest --nbval
--nbval-sanitize-with notebooks/nbval_sanitize.cfg notebooks/01_paged_kv_cache.ipynb`` (with
KERNEL_ENV exported) checks one notebook the same way, cell by cell. A cell stored unexecuted is run
but not compared (nbval's rule for an unrun reference cell).
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK_DIR = os.path.join(REPO, "notebooks")
SANITIZE_FILE = os.path.join(NOTEBOOK_DIR, "nbval_sanitize.cfg")
EXERCISE_NOTEBOOKS = ("04_exercises.ipynb", "07_pd_exercises.ipynb",
                      "09_pd_at_scale_exercises.ipynb")
MAX_BYTES = 1_500_000          # no stored notebook over 1.5 MB
CELL_TIMEOUT = 300             # seconds per cell
# What every kernel inherits, in the stored run and in CI's: one intra-op thread (floats summed in a
# different order differ in their last bits, and two cores shared with other work make a small
# model's matmuls slower with more threads), a fixed str hash seed, and the plain ``F.linear`` for
# every layer: the linear route is otherwise chosen per machine by timing (kernel_choice.py), and
# another route sums in another order (a stored KV file's CRC32, and so its meta.json's length,
# would follow the machine's timing). MPLBACKEND is left to the kernel: its inline backend draws
# the figures.
KERNEL_ENV = {"MINIVLLM_NOTEBOOK_FAST": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "PYTHONHASHSEED": "0", "MINIVLLM_LINEAR_ROUTE": "f_linear"}


def lesson_notebooks() -> list[str]:
    """The notebooks stored executed: every notebook but the exercises."""
    return sorted(n for n in os.listdir(NOTEBOOK_DIR)
                  if n.endswith(".ipynb") and n not in EXERCISE_NOTEBOOKS)


def read(name: str):
    import nbformat
    return nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)


def execute(nb, env: Optional[dict[str, str]] = None):
    """Run every cell of ``nb`` top to bottom in a fresh "python3" kernel started in notebooks/, in
    place, and return it. The kernel gets this process's environment with ``env`` (default
    KERNEL_ENV) on top."""
    import nbclient
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT,
                                     record_timing=False,
                                     resources={"metadata": {"path": NOTEBOOK_DIR}})
    inherited = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    client.execute(env={**inherited, **(KERNEL_ENV if env is None else env)})
    return nb


def sanitize_patterns(path: str = SANITIZE_FILE) -> dict[str, str]:
    """{regex: replacement} from nbval's sanitize file format (``regex:`` / ``replace:`` lines)."""
    from nbval.plugin import get_sanitize_patterns
    with open(path) as f:
        text = f.read()
    pairs = get_sanitize_patterns(text)
    # nbval pairs a `regex:` line only with a `replace: ` line right below it (an empty replacement
    # keeps its space); any other line there drops the pattern without a word.
    if len(pairs) != len(re.findall(r"^regex: ", text, flags=re.MULTILINE)):
        raise ValueError(f"{path}: a `regex:` line lacks its `replace: ` line right below it")
    return dict(pairs)


def is_progress_bar(output) -> bool:
    """A tqdm bar drawn as a widget ("Processed prompts:  40%|####  | 13/32 ..."). It shows how far
    a long step got, not a result, and whether it appears at all depends on what the machine has
    cached: a fresh machine converts the GGUF model and builds a head's training data, each with a
    bar, where a warm one prints neither. So it is neither stored nor compared (nbval alone would
    compare it: run ``pytest --nbval`` on a warm machine)."""
    data = output.get("data", {})
    text = "".join(data.get("text/plain", ""))
    return (output.get("output_type") == "display_data"
            and "application/vnd.jupyter.widget-view+json" in data
            and re.search(r"\d+%\|.*\| *[\d.]+\w?/[\d.?]+\w?", text) is not None)


class _NbvalRule:
    """What nbval's ``IPyNbCell.compare_outputs`` reads from its pytest item, so that the very same
    rule compares a notebook nbclient ran (two notebooks at once, the outputs kept for the checks
    that follow) with the stored one."""

    def __init__(self, patterns: dict[str, str]):
        from nbval.plugin import IPyNbCell, nocolors
        # nbval's own list of what it never compares (IPyNbFile.skip_compare, without --nbdime).
        skip = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")
        self.parent = SimpleNamespace(sanitize_patterns=patterns, skip_compare=skip)
        self.colors = nocolors
        self.ihook = SimpleNamespace(pytest_assertrepr_compare=lambda **kw: [])
        self.config = None
        self.comparison_traceback: list[str] = []
        self._compare = IPyNbCell.compare_outputs
        self._format = IPyNbCell.format_output_compare
        self._sanitize = IPyNbCell.sanitize

    def sanitize(self, s):
        return self._sanitize(self, s)

    def format_output_compare(self, key, left, right):
        return self._format(self, key, left, right)

    def _unseen(self, output) -> bool:
        """A progress bar, or a stream the sanitize patterns empty (the GGUF model's first-use
        conversion, printed only on a fresh machine): nbval would still count it as an output."""
        if output.get("output_type") == "stream":
            return self.sanitize("".join(output.get("text", ""))) == ""
        return is_progress_bar(output)

    def differs(self, fresh: list, stored: list) -> Optional[str]:
        """None when the outputs agree, else nbval's account of the first difference. Progress
        bars and streams with nothing left after sanitizing are left out of both sides first."""
        from nbval.plugin import coalesce_streams
        fresh, stored = ([o for o in coalesce_streams(copy.deepcopy(outs)) if not self._unseen(o)]
                         for outs in (fresh, stored))
        if self._compare(self, fresh, stored):
            return None
        return "\n".join(self.comparison_traceback)


def stale_cells(stored, fresh, name: str = "") -> list[str]:
    """One message per code cell whose stored text output differs from ``fresh``'s, naming the
    cell (its index among code cells, as ``pytest --nbval`` counts, and its first line)."""
    rule, problems, code_index = _NbvalRule(sanitize_patterns()), [], 0
    for old, new in zip(stored.cells, fresh.cells):
        if old.cell_type != "code":
            continue
        tags = old.metadata.get("tags", [])
        if old.execution_count is not None and "nbval-ignore-output" not in tags:
            diff = rule.differs(new.get("outputs", []), old.get("outputs", []))
            if diff:
                first = old.source.splitlines()[0] if old.source else ""
                problems.append(f"{name} Cell {code_index} ({first[:60]!r}): the stored output "
                                f"differs from a fresh run\n{diff}")
        code_index += 1
    return problems


def unexecuted_code_cells(nb) -> int:
    return sum(c.cell_type == "code" and c.source.strip() != "" and c.execution_count is None
               for c in nb.cells)


def _tidy(nb) -> None:
    """What a stored notebook keeps: a stable id per cell (kept once given), no per-run metadata,
    no progress bars (``is_progress_bar``)."""
    for i, cell in enumerate(nb.cells):
        cell.setdefault("id", f"cell-{i:02d}")
        cell.metadata.pop("execution", None)
        if "outputs" in cell:
            cell.outputs = [o for o in cell.outputs if not is_progress_bar(o)]
    nb.metadata.pop("papermill", None)


def refresh(names: list[str], workers: int = 2) -> None:
    """Run each notebook of ``names`` and store it with its outputs, two at a time (each kernel
    has one thread), longest first."""
    import nbformat
    for name in names:
        if name in EXERCISE_NOTEBOOKS:
            raise SystemExit(f"{name} is an exercise notebook: it is stored unexecuted")

    def one(name: str) -> str:
        t0 = time.perf_counter()
        nb = execute(read(name))
        _tidy(nb)
        path = os.path.join(NOTEBOOK_DIR, name)
        nbformat.write(nb, path)
        size = os.path.getsize(path)
        warn = f"  (over {MAX_BYTES:,} bytes: shrink its figures)" if size > MAX_BYTES else ""
        return f"{name}: stored, {size / 1e3:.0f} kB, ran in {time.perf_counter() - t0:.0f} s{warn}"

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for line in pool.map(one, sorted(names, reverse=True)):
            print(line, flush=True)


def check(names: list[str], workers: int = 2) -> int:
    """Run each notebook and compare its text outputs with the stored ones; 1 if any is stale."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        fresh = dict(zip(names, pool.map(lambda n: execute(read(n)), names)))
    problems = [p for n in names for p in stale_cells(read(n), fresh[n], n)]
    print("\n\n".join(problems) if problems else f"{len(names)} notebooks: stored outputs agree")
    return 1 if problems else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minivllm.notebooks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["refresh", "check"])
    parser.add_argument("names", nargs="*", help="notebook file names (default: every lesson)")
    args = parser.parse_args(argv)
    names = args.names or lesson_notebooks()
    if args.command == "refresh":
        refresh(names)
        return 0
    return check(names)


if __name__ == "__main__":
    sys.exit(main())
