"""``python -m minivllm.bench {throughput,spec,pd,gpu,serve,profile,roofline,vllm,fleet} [options]
[--markdown[=SECTION]]``: benchmarks that print side-by-side tables; ``--markdown`` also writes
them into RESULTS.md.

A benchmark measures steady state: every engine it starts (in this process or a cell's
subprocess) times all its linear routes at load, however long that takes, unless
``MINIVLLM_TUNING_BUDGET_S`` is set (an interactive ``LLM()`` stops after 1.5 s and leaves the rest
on ``F.linear`` until a later process times it)."""
import importlib
import os
import sys
from typing import Optional

BENCHMARKS = {"throughput": "minivllm.bench.throughput", "spec": "minivllm.bench.spec",
              "pd": "minivllm.bench.pd", "gpu": "minivllm.bench.gpu",
              "serve": "minivllm.bench.serve", "profile": "minivllm.bench.profile",
              "roofline": "minivllm.bench.roofline", "vllm": "minivllm.bench.vllm",
              "fleet": "minivllm.bench.fleet"}


def main(argv: Optional[list[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: python -m minivllm.bench {{{','.join(BENCHMARKS)}}} [options]"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage + "\n\n" + __doc__)
        return
    if not argv or argv[0] not in BENCHMARKS:
        raise SystemExit(usage)
    os.environ.setdefault("MINIVLLM_TUNING_BUDGET_S", "inf")
    run = importlib.import_module(BENCHMARKS[argv[0]]).main
    if any(a == "--markdown" or a.startswith("--markdown=") for a in argv[1:]):
        from minivllm.bench.results import capture_markdown   # also writes bench/RESULTS.md
        return capture_markdown(argv[0], argv[1:], run)
    run(argv[1:])

if __name__ == "__main__":
    main()
