"""``python -m minivllm.bench serve``: online serving, one instance with chunked prefill against
1 prefill + 1 decode behind the proxy, with the same total CPU threads, on the same fixed-seed
workload (short chat requests arriving steadily, long prompts of 1-2k tokens in bursts; see
serve_client.py). Prints TTFT, TPOT, ITL p50/p99, end-to-end latency, throughput and goodput at
the stated SLOs, and draws the chat requests' inter-token latency over time for both setups
(``figures/serve_itl.png``): with one instance, every long prefill chunk lands in the same steps as
the chat requests' decodes; with P/D the decode instance never runs a long prefill.
"""
from __future__ import annotations

import argparse
import asyncio
import os
from typing import Optional

from minivllm.bench.serve_client import RequestResult, Workload, run_workload, summarize
from minivllm.disagg.launch import Cluster, free_port, start_cluster, wait_healthy

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def start_single(model: str, threads: int, server_args: list[str], seed: int = 0) -> Cluster:
    """One ``minivllm.serve`` instance (chunked prefill on), as a one-process ``Cluster``."""
    import subprocess
    import sys
    import tempfile
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cluster = Cluster(url, [], [url], "none", "", tempfile.mkdtemp(prefix="minivllm-single-"))
    log = open(os.path.join(cluster.log_dir, "single.log"), "w")
    cluster.procs["single"] = subprocess.Popen(
        [sys.executable, "-m", "minivllm.serve", "--model", model, "--port", str(port),
         "--seed", str(seed), "--num-threads", str(threads), *server_args],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
        start_new_session=True)
    try:
        wait_healthy(cluster, [url], 300)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def plot_itl(runs: dict[str, list[RequestResult]], workload: Workload, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True,
                             sharey=True, squeeze=False)
    bursts = sorted({r.sent for rs in runs.values() for r in rs if r.kind == "long"})
    for ax, (name, results) in zip(axes[:, 0], runs.items()):
        xs, ys = [], []
        for r in results:
            if r.kind == "chat" and r.error is None:
                xs += r.chunk_times[1:]
                ys += [1000 * x for x in r.itls]
        ax.scatter(xs, ys, s=4, alpha=0.6)
        for b in bursts:
            ax.axvline(b, color="tab:red", lw=0.8, alpha=0.4)
        ax.set_title(f"{name}: chat requests' inter-token latency (red: long-prompt arrivals)",
                     fontsize=9)
        ax.set_ylabel("ITL (ms)")
        ax.set_yscale("log")
    axes[-1, 0].set_xlabel("time since the start of the run (s)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(summaries: dict[str, dict], ttft_slo: float, tpot_slo: float) -> None:
    cols = [("requests", "{:d}"), ("errors", "{:d}"), ("chat_ttft_p50", "{:.3f}"),
            ("chat_ttft_p99", "{:.3f}"), ("long_ttft_p50", "{:.3f}"), ("chat_tpot_p50", "{:.3f}"),
            ("itl_p50", "{:.3f}"), ("itl_p99", "{:.3f}"), ("chat_e2e_p50", "{:.3f}"),
            ("output_tok_s", "{:.1f}"), ("goodput_req_s", "{:.3f}"), ("slo_attained", "{:.0%}")]
    print("| setup | " + " | ".join(c for c, _ in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, s in summaries.items():
        print(f"| {name} | " + " | ".join(f.format(s[c]) for c, f in cols) + " |")
    print(f"(seconds; goodput: chat requests per second with TTFT <= {ttft_slo} s and "
          f"TPOT <= {tpot_slo} s)")


def run(model: str, threads: int, workload: Workload, ttft_slo: float, tpot_slo: float,
        figure: Optional[str], server_args: list[str],
        setups: tuple[str, ...] = ("1 instance", "1P+1D")) -> dict:
    runs, summaries = {}, {}
    for name in setups:
        if name == "1 instance":
            cluster = start_single(model, threads, server_args)
        else:
            cluster = start_cluster(1, 1, model=model, num_threads=threads,
                                    server_args=server_args)
        try:
            print(f"{name}: {cluster.proxy_url} ...", flush=True)
            runs[name] = asyncio.run(run_workload(cluster.proxy_url, workload))
        finally:
            cluster.stop()
        summaries[name] = summarize(runs[name], ttft_slo, tpot_slo)
    if figure:
        plot_itl(runs, workload, figure)
    return {"runs": runs, "summaries": summaries}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 2,
                    help="CPU threads for each setup in total (P/D: split between P and D)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--chat-rate", type=float, default=0.7)
    ap.add_argument("--burst-every", type=float, default=20.0)
    ap.add_argument("--burst-size", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, nargs=2, default=[1024, 2048])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="the chunked-prefill budget per step")
    ap.add_argument("--figure", default="figures/serve_itl.png")
    args = ap.parse_args(argv)
    workload = Workload(duration_s=args.duration, chat_rate=args.chat_rate,
                        burst_every_s=args.burst_every, burst_size=args.burst_size,
                        long_tokens=tuple(args.long_tokens), seed=args.seed)
    server_args = ["--max-model-len", str(args.long_tokens[1] + 256),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    out = run(args.model, args.num_threads, workload, args.ttft_slo, args.tpot_slo, args.figure,
              server_args)
    print_table(out["summaries"], args.ttft_slo, args.tpot_slo)
    if args.figure:
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
