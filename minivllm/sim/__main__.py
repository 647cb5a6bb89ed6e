"""``python -m minivllm.sim {profile,run,fleet,plan,validate}`` (``minivllm sim ...``):
DESIGN.md 5.8's planning commands. No vLLM file, no article step (see the package docstring).

- ``profile [--model M] [--minutes N]``: time the real engine's steps on this machine, fit the cost
  model and store it (profile.py).
- ``run --trace FILE [--model M] [--cost-model FILE]``: one simulated engine through a trace (or
  ``--workload poisson|multiturn``); one JSON line per request
  (``request_id``, ``ttft_s``, ``itl_s``, ``e2e_s``) and a last line ``SUMMARY {json}``
  (``ttft_p50_s``, ``ttft_p90_s``, ``itl_p50_s``, ``itl_p90_s``, ``makespan_s``,
  ``num_requests``). ``itl_s`` is a request's mean inter-token latency (its TPOT). Exit status 2,
  with the command that makes one, when no cost model is stored for this machine and model.
- ``fleet``, ``plan``, ``validate``: subcommands whose parser and handler live in modules of their
  own (``SUBCOMMANDS``): a fleet of simulated engines (cli_fleet.py), the planner (plan.py), the
  simulator against real runs here (validate.py).
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from typing import Optional

from minivllm.sim.cli_fleet import add_engine_args
from minivllm.sim.trace import length_range


# Subcommands in modules of their own: name -> module with ``add_parser(sub, default_model)`` and
# ``main(args) -> int`` (exit status).
SUBCOMMANDS = {"fleet": "minivllm.sim.cli_fleet", "plan": "minivllm.sim.plan",
               "validate": "minivllm.sim.validate"}


def _run_parser(sub: argparse._SubParsersAction, default_model: str) -> None:
    ap = sub.add_parser("run", help="one simulated engine through a trace: per-request "
                        "TTFT / ITL / E2E and a SUMMARY line",
                        description="One simulated engine through a trace (JSON lines: arrival_s, "
                        "prompt_tokens or prompt_token_ids, output_tokens, conversation). Writes "
                        "one JSON line per request and a last line SUMMARY {json}.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a JSON-lines trace file")
    src.add_argument("--workload", choices=("poisson", "multiturn"),
                     help="generate the trace instead (--num-requests, --request-rate, "
                     "--prompt-tokens, --output-tokens; or --conversations, --turns)")
    add_engine_args(ap, default_model)
    ap.add_argument("--out", default=None, help="write the lines here instead of stdout")
    ap.add_argument("--save-trace", default=None, help="also write the generated trace here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--prompt-tokens", type=length_range, default=(64, 1024), metavar="LO,HI")
    ap.add_argument("--output-tokens", type=length_range, default=(32, 256), metavar="LO,HI")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help="JSON, as vllm serve's flag; drafts follow the profile's acceptance")
    ap.add_argument("--progress", action="store_true", help="a progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from minivllm.sim.cost_model import CostModel, CostModelMissing, default_path
    path = args.cost_model or default_path(args.model)
    try:
        cost_model = CostModel.load(path, args.model)
    except CostModelMissing as e:
        print(f"minivllm sim run: {e}", file=sys.stderr)
        return 2
    fitted_on = cost_model.meta.get("machine")
    if fitted_on and fitted_on != platform.node():
        print(f"minivllm sim run: note: the cost model in {path} was fitted on {fitted_on}, "
              f"not on this machine ({platform.node()}).", file=sys.stderr)
    from minivllm.sim import trace as traces
    from minivllm.sim.engine import SimEngine, summarize
    try:   # a bad trace or engine argument: said before any step
        engine = SimEngine.from_engine_args(
            args.model, cost_model, record_token_times=False, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            enable_prefix_caching=args.enable_prefix_caching,
            speculative_config=args.speculative_config, seed=args.seed)
        vocab = int(engine.vllm_config.hf_config.vocab_size)
        if args.trace:
            requests = traces.read_trace(args.trace)
        elif args.workload == "poisson":
            requests = traces.poisson_trace(args.num_requests, args.request_rate,
                                            args.prompt_tokens, args.output_tokens,
                                            seed=args.seed)
        else:
            requests = traces.multiturn_trace(args.conversations, args.turns, args.output_tokens,
                                              vocab_size=vocab, seed=args.seed)
        engine.check_trace(requests)
    except (ValueError, OSError) as e:
        print(f"minivllm sim run: {e}", file=sys.stderr)
        return 2
    if args.save_trace:
        traces.write_trace(args.save_trace, requests)
    t0 = time.perf_counter()
    times = engine.run_trace(requests, seed=args.seed, progress=args.progress)
    wall = time.perf_counter() - t0
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        for t in times:
            out.write(json.dumps({"request_id": t.request_id, "ttft_s": t.ttft_s,
                                  "itl_s": t.itl_s, "e2e_s": t.e2e_s}) + "\n")
        out.write("SUMMARY " + json.dumps(summarize(times)) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"minivllm sim run: {len(times)} requests, {engine.num_steps} steps in {wall:.2f} s "
          f"({engine.num_steps / max(wall, 1e-9):.0f} steps/s, "
          f"{wall / max(1, len(times)) * 1e3:.2f} ms per request); cost model {path}",
          file=sys.stderr)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    from minivllm.model_executor.model_loader import DEFAULT_MODEL
    ap = argparse.ArgumentParser(prog="python -m minivllm.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("profile", add_help=False,
                   help="time the real engine's steps here and store the fitted cost model")
    _run_parser(sub, DEFAULT_MODEL)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub, DEFAULT_MODEL)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "profile":   # its own parser (profile.py), help included
        from minivllm.sim.profile import main as profile_main
        return profile_main(argv[1:])
    args = ap.parse_args(argv)
    if args.command in SUBCOMMANDS:
        return importlib.import_module(SUBCOMMANDS[args.command]).main(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
