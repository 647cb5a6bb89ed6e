"""``python -m minivllm.sim fleet``: a fleet in virtual time through a trace (fleet.py), and the
arguments ``fleet`` and ``plan`` (plan.py) share: the trace or workload, the engine's flags, the
fleet's routing flags, the cost model. No vLLM file, no article step (the package docstring).

    python -m minivllm.sim fleet --trace FILE --prefill N --decode M   (or --colocated N)
        [--workload poisson|multiturn ...] [--transfer zmq_pull|GBPS[:MS]] [--router kv]
        [--ttft-p90 S --itl-p90 S]

One JSON line per request (``request_id``, ``ttft_s``, ``itl_s``, ``e2e_s``) and a last line
``SUMMARY {json}``, as ``sim run`` writes them (DESIGN.md 5.8); the summary also holds the fleet's
counts (steps and busy fraction per role, remote prefills, KV pulls) and, given both SLOs, the
fraction of requests meeting them. On stderr: what the simulation cost (seconds, per request, peak
memory).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import sys
import time
from typing import Any, Iterator, Optional

from minivllm.sim.trace import length_range

WORKLOADS = ("poisson", "multiturn")


def add_trace_args(ap: argparse.ArgumentParser, num_requests: int = 200) -> None:
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a JSON-lines trace file (arrival_s, prompt_tokens or "
                     "prompt_token_ids, output_tokens, conversation)")
    src.add_argument("--workload", choices=WORKLOADS,
                     help="generate the trace instead (--num-requests, --request-rate, "
                     "--prompt-tokens, --output-tokens; or --conversations, --turns)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=num_requests)
    ap.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--prompt-tokens", type=length_range, default=(64, 1024), metavar="LO,HI")
    ap.add_argument("--output-tokens", type=length_range, default=(32, 256), metavar="LO,HI")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)


def add_engine_args(ap: argparse.ArgumentParser, default_model: str) -> None:
    """Every replica's engine, under vLLM's flag names (as ``sim run``'s)."""
    ap.add_argument("--model", default=default_model)
    ap.add_argument("--cost-model", default=None, help="a cost model file (default: the one "
                    "`profile` stored for this model on this machine)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--num-gpu-blocks-override", type=int, default=None)
    ap.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                    action="store_false")


def add_fleet_args(ap: argparse.ArgumentParser) -> None:
    """The fleet command's routing flags (disagg/fleet/driver.py) and the transfer's cost."""
    from minivllm.sim.fleet import PD_MIN_UNCACHED_TOKENS, ROUTERS
    from minivllm.sim.transfer import TRANSFER_COSTS
    ap.add_argument("--router", default="kv", choices=ROUTERS,
                    help="kv: by the KV each replica holds (the fleet's); round_robin")
    ap.add_argument("--pd-min-uncached-tokens", type=int, default=PD_MIN_UNCACHED_TOKENS,
                    help="decode computes the prompt itself when it holds all but this many "
                    "tokens (0: always a remote prefill)")
    ap.add_argument("--overlap-score-weight", type=float, default=1.0)
    ap.add_argument("--transfer", default="zmq_pull",
                    help=f"one KV pull's cost: {', '.join(TRANSFER_COSTS)} (measured here or "
                    "typical), or GBPS[:LATENCY_MS] for a network")
    ap.add_argument("--contention", default="1",
                    help="wall seconds per CPU second of a replica's step: 1 (default) for "
                    "replicas on machines of their own; 'profile' for the one the cost model "
                    "measured here (other processes sharing the cores); or a number (about N / "
                    "cores for N replicas sharing this machine)")


def load_cost_model(args: argparse.Namespace, prog: str) -> Optional[Any]:
    """The cost model (``--cost-model``, else the one stored for ``--model``), or None after
    saying on stderr how to make one."""
    from minivllm.sim.cost_model import CostModel, CostModelMissing, default_path
    path = args.cost_model or default_path(args.model)
    try:
        cost_model = CostModel.load(path, args.model)
    except CostModelMissing as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None
    fitted_on = cost_model.meta.get("machine")
    if fitted_on and fitted_on != platform.node():
        print(f"{prog}: note: the cost model in {path} was fitted on {fitted_on}, not on this "
              f"machine ({platform.node()}).", file=sys.stderr)
    contention = getattr(args, "contention", None)
    if contention is not None and contention != "profile":
        try:
            value = float(contention)
        except ValueError:
            value = -1.0
        if not value > 0:
            print(f"{prog}: --contention is a number > 0 or 'profile', got {contention!r}.",
                  file=sys.stderr)
            return None
        if value != cost_model.contention:
            print(f"{prog}: note: contention {value:g} (each replica on a machine of its own "
                  f"when 1); the profile measured {cost_model.contention:.3g} here "
                  "(--contention profile uses it).", file=sys.stderr)
        cost_model = dataclasses.replace(cost_model, contention=value)
    cost_model.meta.setdefault("path", path)
    return cost_model


def engine_config(args: argparse.Namespace) -> Any:
    from minivllm.sim.engine import make_vllm_config
    return make_vllm_config(
        args.model, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed)


def iter_poisson(num_requests: int, rate: float, prompt_tokens: tuple[int, int],
                 output_tokens: tuple[int, int], seed: int = 0) -> Iterator[Any]:
    """``trace.poisson_trace``'s requests (the same draws, so the same trace), made one at a time:
    a trace of 100,000 requests is three arrays of numbers, never 100,000 objects at once."""
    import numpy as np

    from minivllm.sim.trace import TraceRequest
    if num_requests < 0 or not rate > 0:
        raise ValueError(f"need num_requests >= 0 and rate > 0, got {num_requests}, {rate}.")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    prompts = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, num_requests)
    outputs = rng.integers(output_tokens[0], output_tokens[1] + 1, num_requests)
    for i in range(num_requests):
        yield TraceRequest(str(i), float(arrivals[i]), int(prompts[i]), int(outputs[i]))


def requests_from_args(args: argparse.Namespace, vocab_size: int, lazy: bool = False) -> Any:
    """The trace (``--trace``) or the generated workload: a list, or with ``lazy`` a Poisson
    workload as an iterator (``iter_poisson``)."""
    from minivllm.sim import trace as traces
    if args.trace:
        return traces.read_trace(args.trace)
    if args.workload == "poisson":
        if lazy:
            return iter_poisson(args.num_requests, args.request_rate, args.prompt_tokens,
                                args.output_tokens, seed=args.seed)
        return traces.poisson_trace(args.num_requests, args.request_rate, args.prompt_tokens,
                                    args.output_tokens, seed=args.seed)
    return traces.multiturn_trace(args.conversations, args.turns, args.output_tokens,
                                  vocab_size=vocab_size, seed=args.seed)


def fleet_config(args: argparse.Namespace, **counts: int) -> Any:
    from minivllm.sim.fleet import SimFleetConfig
    from minivllm.sim.transfer import TransferCost
    return SimFleetConfig(router=args.router, pd_min_uncached_tokens=args.pd_min_uncached_tokens,
                          overlap_score_weight=args.overlap_score_weight,
                          transfer=TransferCost.parse(args.transfer), seed=args.seed, **counts)


def add_parser(sub: argparse._SubParsersAction, default_model: str) -> None:
    ap = sub.add_parser("fleet", help="a P/D (or colocated) fleet through a trace: per-request "
                        "TTFT / ITL / E2E and a SUMMARY line",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap)
    shape = ap.add_argument_group("the fleet (P/D, or --colocated)")
    shape.add_argument("--prefill", type=int, default=None, help="prefill replicas")
    shape.add_argument("--decode", type=int, default=None, help="decode replicas")
    shape.add_argument("--colocated", type=int, default=None,
                       help="N engines doing prefill and decode (chunked prefill), no P/D")
    add_fleet_args(ap)
    add_engine_args(ap, default_model)
    ap.add_argument("--ttft-p90", type=float, default=None, help="SLO: add the attainment")
    ap.add_argument("--itl-p90", type=float, default=None, help="SLO: add the attainment")
    ap.add_argument("--out", default=None, help="write the lines here instead of stdout")
    ap.add_argument("--progress", action="store_true", help="a progress bar on stderr")


def main(args: argparse.Namespace) -> int:
    prog = "minivllm sim fleet"
    if args.colocated is None and (args.prefill is None or args.decode is None):
        print(f"{prog}: give --prefill N --decode M, or --colocated N.", file=sys.stderr)
        return 2
    cost_model = load_cost_model(args, prog)
    if cost_model is None:
        return 2
    from minivllm.sim.fleet import SimFleet, slo_attainment, summarize_records
    try:   # a bad trace, engine or fleet argument: said before any step
        counts = ({"num_colocated": args.colocated} if args.colocated is not None
                  else {"num_prefill": args.prefill, "num_decode": args.decode})
        config = fleet_config(args, **counts)
        vllm_config = engine_config(args)
        requests = requests_from_args(args, int(vllm_config.hf_config.vocab_size), lazy=True)
        t0, c0 = time.perf_counter(), time.process_time()
        fleet = SimFleet(config, vllm_config, cost_model)
    except (ValueError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if args.progress:
        requests = _with_progress(requests, args)
    records = fleet.run(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    summary = summarize_records(records)
    summary.update(fleet.stats())
    if args.ttft_p90 is not None and args.itl_p90 is not None:
        summary["slo_attainment"] = slo_attainment(records, args.ttft_p90, args.itl_p90)
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        for r in records:
            out.write(json.dumps(r.to_json()) + "\n")
        out.write("SUMMARY " + json.dumps(summary) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steps = sum(v for k, v in summary.items() if k.endswith("_steps"))
    n = max(1, len(records))
    print(f"{prog}: {len(records)} requests over {config.num_instances} replicas "
          f"({config.label()}) in {wall:.1f} s ({cpu:.1f} s CPU): {wall / n * 1e3:.2f} ms per "
          f"request ({cpu / n * 1e3:.2f} ms CPU), {steps} engine steps, peak RSS {rss_mb:.0f} MB;"
          f" cost model {cost_model.meta.get('path')}", file=sys.stderr)
    return 0


def _with_progress(requests: Any, args: argparse.Namespace) -> Iterator[Any]:
    from tqdm.auto import tqdm
    total = args.num_requests if not args.trace and args.workload == "poisson" else None
    yield from tqdm(requests, total=total, desc="arrivals", dynamic_ncols=True)
