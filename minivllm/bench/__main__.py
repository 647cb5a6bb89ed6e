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

BENCHMARKS = {"throughput": "minivllm.bench.throughput", "spec": "minivllm.bench.spec",
              "pd": "minivllm.bench.pd", "gpu": "minivllm.bench.gpu",
              "serve": "minivllm.bench.serve", "profile": "minivllm.bench.profile",
              "roofline": "minivllm.bench.roofline", "vllm": "minivllm.bench.vllm",
              "fleet": "minivllm.bench.fleet"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m minivllm.bench {{{','.join(BENCHMARKS)}}} [options]")
    os.environ.setdefault("MINIVLLM_TUNING_BUDGET_S", "inf")
    run = importlib.import_module(BENCHMARKS[sys.argv[1]]).main
    if any(a == "--markdown" or a.startswith("--markdown=") for a in sys.argv[2:]):
        from minivllm.bench.results import capture_markdown   # also writes bench/RESULTS.md
        return capture_markdown(sys.argv[1], sys.argv[2:], run)
    run(sys.argv[2:])


if __name__ == "__main__":
    main()
