"""``python -m minivllm.bench {throughput,spec,pd,gpu,serve,vllm} [options]``: benchmarks that print side-by-side tables."""
import importlib
import sys

BENCHMARKS = {"throughput": "minivllm.bench.throughput", "spec": "minivllm.bench.spec",
              "pd": "minivllm.bench.pd", "gpu": "minivllm.bench.gpu",
              "serve": "minivllm.bench.serve", "vllm": "minivllm.bench.vllm"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m minivllm.bench {{{','.join(BENCHMARKS)}}} [options]")
    importlib.import_module(BENCHMARKS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
