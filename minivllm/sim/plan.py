"""``python -m minivllm.sim plan``: how many prefill and decode instances a workload needs to meet a
TTFT and an ITL target, and whether disaggregation beats running prefill and decode together. No
vLLM file (vLLM has no planner; NVIDIA Dynamo's SLA planner and DistServe's placement search play
this role for theirs). No article step: it sizes the article's "N vLLM prefill instances and M vLLM
decode instances", running each candidate through the fleet simulator (fleet.py).

    python -m minivllm.sim plan --trace FILE --ttft-p90 S --itl-p90 S
        [--workload poisson ...] [--cost-model FILE] [--transfer zmq_pull|GBPS[:MS]]
        [--max-instances 4] [--attainment 0.9]

**Goodput**, as DistServe (OSDI '24) defines it: the highest request rate at which the SLO
attainment target holds (by default 90% of requests meet both their TTFT and their ITL target; a
request's ITL is its mean inter-token latency). For each candidate, colocated serving with N
engines and P/D with P prefill + D decode replicas (up to ``--max-instances`` in all), the trace's
arrival times are scaled to a rate and the fleet simulated; the rate is doubled or halved until
the target flips, then bisected (``goodput``). The candidate with the best **goodput per
instance** is the plan's unit; the trace's own rate needs ``ceil(rate / unit's goodput)`` copies of
it (DistServe's replication of its best placement).

The command that runs the plan:
- P/D: the fleet (``python -m minivllm.disagg.fleet``), each role between 1 and the plan's count,
  with the autoscaling targets derived from the plan (``autoscale_targets``):
  ``--prefill-target-queued-tokens``: the prompt tokens one prefill replica clears within the TTFT
  target, less the transfer and decode's first step (its prefill rate on the workload's mean prompt,
  from the cost model, times that time budget), so that ``ceil(queued / target)`` replicas keep
  every queued prompt within the target;
  ``--decode-target-running``: the largest batch whose decode step, at the workload's mean context
  (prompt + half the output), stays within the ITL target (capped at ``--max-num-seqs``), so that
  ``ceil(running / target)`` replicas keep every step within it.
- Colocated: the fleet needs a replica per role, so the server command (``python -m
  minivllm.serve``) and how many instances of it to put behind a load balancer.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from minivllm.sim.cost_model import CostModel, StepShape
from minivllm.sim.trace import TraceRequest

DEFAULT_ATTAINMENT = 0.9


@dataclass(frozen=True)
class SLO:
    """Both targets and the attainment the goodput is measured at."""
    ttft_s: float
    itl_s: float
    attainment: float = DEFAULT_ATTAINMENT

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0 and 0 < self.attainment <= 1):
            raise ValueError("the SLOs must be > 0 seconds and the attainment in (0, 1], got "
                             f"{self.ttft_s}, {self.itl_s}, {self.attainment}.")


@dataclass
class Trial:
    """One simulation: the rate, the attainment, and the summary it gave."""
    rate: float
    attainment: float
    summary: dict


@dataclass
class PlanRow:
    """One candidate's goodput: ``rate`` the highest rate that met the target (0 when even the
    lowest tried did not), ``trial`` the simulation at that rate, ``trials`` every one run."""
    label: str
    num_prefill: int
    num_decode: int
    num_colocated: int
    rate: float
    trial: Optional[Trial]
    trials: list[Trial] = field(default_factory=list)

    @property
    def num_instances(self) -> int:
        return self.num_colocated or self.num_prefill + self.num_decode

    @property
    def goodput_per_instance(self) -> float:
        return self.rate / self.num_instances

    def to_json(self) -> dict:
        s = self.trial.summary if self.trial else {}
        return {"fleet": self.label, "num_prefill": self.num_prefill,
                "num_decode": self.num_decode, "num_colocated": self.num_colocated,
                "instances": self.num_instances, "goodput_rps": self.rate,
                "goodput_per_instance_rps": self.goodput_per_instance,
                "attainment": self.trial.attainment if self.trial else None,
                "ttft_p90_s": s.get("ttft_p90_s"), "itl_p90_s": s.get("itl_p90_s"),
                "simulations": len(self.trials)}


def trace_rate(requests: Sequence[TraceRequest]) -> float:
    """Requests per second over the trace's arrivals (n - 1 gaps over the span)."""
    arrivals = [r.arrival_s for r in requests]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    if len(arrivals) < 2 or span <= 0:
        raise ValueError("the planner scales the trace's arrival rate: it needs at least two "
                         "distinct arrival times (a multi-turn workload: --request-rate sets the "
                         "conversations' start rate).")
    return (len(arrivals) - 1) / span


def at_rate(requests: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """The trace with its arrival times scaled so that its rate is ``rate`` (same order, same
    requests; from its first arrival)."""
    base = trace_rate(requests)
    t0 = min(r.arrival_s for r in requests)
    factor = base / rate
    return [dataclasses.replace(r, arrival_s=t0 + (r.arrival_s - t0) * factor) for r in requests]


def spread_conversations(requests: Sequence[TraceRequest], rate: float,
                         seed: int = 0) -> list[TraceRequest]:
    """A multi-turn trace whose conversations all start at once, with their starts spread as a
    Poisson process of ``rate`` conversations per second (every turn of a conversation gets its
    start: the fleet sends a turn once the previous one finished)."""
    import numpy as np
    convs = list(dict.fromkeys(r.conversation for r in requests))
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(convs))
    start = dict(zip(convs, np.cumsum(gaps) - gaps[0]))
    out = [dataclasses.replace(r, arrival_s=float(start[r.conversation])) for r in requests]
    return sorted(out, key=lambda r: r.arrival_s)


def goodput(simulate: Callable[[float], Trial], start_rate: float, slo: SLO,
            rel_tol: float = 0.05, max_steps: int = 8) -> tuple[float, Optional[Trial],
                                                                  list[Trial]]:
    """The highest rate whose simulation meets ``slo.attainment``: from ``start_rate``, doubled
    (or halved) until the outcome flips, at most ``max_steps`` times, then bisected (geometric
    mean) until the bracket is within ``rel_tol``. -> (rate, its trial, every trial); rate 0 when
    even ``start_rate / 2**max_steps`` missed the target."""
    trials: list[Trial] = []

    def ok(rate: float) -> bool:
        trial = simulate(rate)
        trials.append(trial)
        return trial.attainment >= slo.attainment

    lo = hi = None
    rate = start_rate
    if ok(rate):
        lo = rate
        for _ in range(max_steps):
            rate *= 2
            if not ok(rate):
                hi = rate
                break
            lo = rate
        if hi is None:     # met at every rate tried: the last is a lower bound
            return lo, _trial_at(trials, lo), trials
    else:
        hi = rate
        for _ in range(max_steps):
            rate /= 2
            if ok(rate):
                lo = rate
                break
            hi = rate
        if lo is None:
            return 0.0, None, trials
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, _trial_at(trials, lo), trials


def _trial_at(trials: list[Trial], rate: float) -> Trial:
    return next(t for t in reversed(trials) if t.rate == rate)


def candidates(max_instances: int, colocated: bool = True,
               disaggregated: bool = True) -> list[dict[str, int]]:
    """Colocated N (1..max) and every P + D <= max (P, D >= 1), as ``SimFleetConfig`` counts."""
    out: list[dict[str, int]] = []
    if colocated:
        out += [{"num_colocated": n} for n in range(1, max_instances + 1)]
    if disaggregated:
        out += [{"num_prefill": p, "num_decode": d} for total in range(2, max_instances + 1)
                for p in range(1, total) for d in [total - p]]
    return out


def search(requests: Sequence[TraceRequest], slo: SLO, fleet_config: Any, vllm_config: Any,
           cost_model: CostModel, counts: Sequence[dict[str, int]],
           rel_tol: float = 0.05, progress: Optional[Callable[[str], None]] = None
           ) -> list[PlanRow]:
    """Each candidate's goodput on ``requests`` (scaled in rate). ``fleet_config``: a
    ``SimFleetConfig`` whose routing and transfer every candidate shares."""
    from minivllm.sim.fleet import run_fleet, slo_attainment
    base = trace_rate(requests)
    rows: list[PlanRow] = []
    for c in counts:
        config = dataclasses.replace(fleet_config, num_prefill=c.get("num_prefill", 0),
                                     num_decode=c.get("num_decode", 0),
                                     num_colocated=c.get("num_colocated", 0))

        def simulate(rate: float, config: Any = config) -> Trial:
            records, summary = run_fleet(config, vllm_config, cost_model,
                                         at_rate(requests, rate))
            return Trial(rate, slo_attainment(records, slo.ttft_s, slo.itl_s), summary)

        # Start from the best rate per instance found so far, times this fleet's size.
        best = max((r.goodput_per_instance for r in rows), default=0.0)
        start = best * config.num_instances if best > 0 else base
        rate, trial, trials = goodput(simulate, start, slo, rel_tol)
        rows.append(PlanRow(config.label(), config.num_prefill, config.num_decode,
                            config.num_colocated, rate, trial, trials))
        if progress is not None:
            progress(f"{config.label()}: {rate:.3g} req/s ({len(trials)} simulations)")
    return rows


@dataclass
class AutoscaleTargets:
    """The fleet's autoscaling targets derived from the plan, and how."""
    prefill_target_queued_tokens: int
    decode_target_running: int
    how: list[str]


def autoscale_targets(cost_model: CostModel, slo: SLO, mean_prompt: float, mean_output: float,
                      transfer_s: float, max_num_seqs: int) -> AutoscaleTargets:
    """(module docstring) From the cost model's prediction of the workload's mean shapes."""
    L = max(1, round(mean_prompt))
    prefill_s = cost_model.predict(StepShape(
        num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=L,
        prefill_context_sum=L * (L + 1) // 2, num_sampled_reqs=1))
    context = round(mean_prompt + mean_output / 2)

    def decode_s(batch: int) -> float:
        return cost_model.predict(StepShape(
            num_reqs=batch, num_decode_reqs=batch, num_decode_tokens=batch,
            decode_context_sum=batch * (context + 1), num_sampled_reqs=batch))

    budget = slo.ttft_s - transfer_s - decode_s(1)
    tokens_per_s = L / prefill_s if prefill_s > 0 else math.inf
    queued = max(1, math.floor(tokens_per_s * budget)) if budget > 0 else 1
    batch = 1
    while batch < max_num_seqs and decode_s(batch + 1) <= slo.itl_s:
        batch += 1
    how = [f"--prefill-target-queued-tokens {queued}: one prefill replica computes a "
           f"{L}-token prompt in {prefill_s * 1e3:.0f} ms ({tokens_per_s:.0f} tokens/s); the TTFT "
           f"target {slo.ttft_s:g} s less the transfer ({transfer_s * 1e3:.0f} ms) and decode's "
           f"first step ({decode_s(1) * 1e3:.0f} ms) leaves {max(budget, 0):.3f} s, in which it "
           f"clears {queued} queued tokens",
           f"--decode-target-running {batch}: a decode step of {batch} requests at the mean "
           f"context ({context} tokens) takes {decode_s(batch) * 1e3:.1f} ms, within the ITL "
           f"target {slo.itl_s * 1e3:g} ms" + (" (one more would not be)" if batch < max_num_seqs
                                              else f" (--max-num-seqs {max_num_seqs})")]
    if decode_s(1) > slo.itl_s:
        how[1] += "; even one request's step misses the target: no batch meets it"
    return AutoscaleTargets(queued, batch, how)


@dataclass
class Plan:
    rows: list[PlanRow]
    best: Optional[PlanRow]
    copies: int
    trace_rate: float
    targets: Optional[AutoscaleTargets]
    command: str
    contention: Optional[float] = None


def make_plan(rows: list[PlanRow], rate: float, slo: SLO, cost_model: CostModel,
              requests: Sequence[TraceRequest], fleet_config: Any, model: str,
              max_num_seqs: int, bytes_per_token: int, engine_flags: Sequence[str] = ()) -> Plan:
    """The best candidate (goodput per instance; ties: fewer instances), the copies the trace's
    own ``rate`` needs, and the command that runs them. ``bytes_per_token``: the model's KV size
    per token (the transfer's bytes)."""
    feasible = [r for r in rows if r.rate > 0]
    if not feasible:
        return Plan(rows, None, 0, rate, None, "")
    best = max(feasible, key=lambda r: (r.goodput_per_instance, -r.num_instances))
    copies = max(1, math.ceil(rate / best.rate - 1e-9))
    flags = " ".join(engine_flags)
    if best.num_colocated:
        n = copies * best.num_colocated
        command = (f"{n} x python -m minivllm.serve --model {model} --port 8000+i"
                   + (f" {flags}" if flags else "") + "   (i = 0.." + f"{n - 1}, behind a load "
                   "balancer: the fleet needs a replica per role)")
        return Plan(rows, best, copies, rate, None, command)
    mean_prompt = sum(r.prompt_tokens for r in requests) / len(requests)
    mean_output = sum(r.output_tokens for r in requests) / len(requests)
    transfer_s = fleet_config.transfer.time_s(mean_prompt * bytes_per_token)
    targets = autoscale_targets(cost_model, slo, mean_prompt, mean_output, transfer_s,
                                max_num_seqs)
    command = ("python -m minivllm.disagg.fleet "
               f"--prefill 1:{copies * best.num_prefill} --decode 1:{copies * best.num_decode} "
               f"--kv-connector ZmqPullConnector --model {model} "
               f"--router {fleet_config.router} "
               f"--pd-min-uncached-tokens {fleet_config.pd_min_uncached_tokens} "
               f"--prefill-target-queued-tokens {targets.prefill_target_queued_tokens} "
               f"--decode-target-running {targets.decode_target_running}"
               + (f" --server-args '{flags}'" if flags else ""))
    return Plan(rows, best, copies, rate, targets, command)


def print_plan(plan: Plan, slo: SLO, num_requests: int, out: Any = None) -> None:
    w = (out or sys.stdout).write
    w(f"Goodput: the highest rate at which >= {slo.attainment:.0%} of requests meet TTFT <= "
      f"{slo.ttft_s:g} s and ITL <= {slo.itl_s:g} s (DistServe's), {num_requests} requests, "
      f"their arrivals scaled.\n")
    if plan.contention is not None:
        w(f"Step times: the cost model's, x {plan.contention:g} (contention; 1: each replica on "
          "a machine of its own).\n")
    w("\n")
    w("| fleet | instances | goodput req/s | per instance | TTFT p90 s | ITL p90 s | met | "
      "simulations |\n|---|---|---|---|---|---|---|---|\n")
    for r in sorted(plan.rows, key=lambda r: -r.goodput_per_instance):
        j = r.to_json()

        def f(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)
        w(f"| {r.label} | {r.num_instances} | {r.rate:.3g} | {r.goodput_per_instance:.3g} | "
          f"{f(j['ttft_p90_s'], '.3f')} | {f(j['itl_p90_s'], '.4f')} | "
          f"{f(j['attainment'], '.0%')} | {len(r.trials)} |\n")
    w("\n")
    if plan.best is None:
        w("PLAN: no candidate meets the SLOs at any rate tried; loosen them or look at the cost "
          "model.\n")
        return
    b = plan.best
    unit = (f"{b.num_colocated} colocated" if b.num_colocated
            else f"{b.num_prefill} prefill + {b.num_decode} decode")
    total = (f"{plan.copies * b.num_colocated} colocated instances" if b.num_colocated else
             f"{plan.copies * b.num_prefill} prefill + {plan.copies * b.num_decode} decode")
    w(f"PLAN: {b.label} ({unit}), {b.goodput_per_instance:.3g} req/s per instance, {b.rate:.3g} "
      f"req/s per unit. The trace's own rate, {plan.trace_rate:.3g} req/s, needs "
      f"{plan.copies} unit(s): {total}.\n")
    if plan.targets is not None:
        w("Autoscaling targets:\n")
        for line in plan.targets.how:
            w(f"  {line}\n")
    w(f"COMMAND: {plan.command}\n")
    w("PLAN " + json.dumps({"best": b.to_json(), "copies": plan.copies,
                           "trace_rate_rps": plan.trace_rate,
                           "targets": None if plan.targets is None else {
                               "prefill_target_queued_tokens":
                                   plan.targets.prefill_target_queued_tokens,
                               "decode_target_running": plan.targets.decode_target_running},
                           "command": plan.command,
                           "rows": [r.to_json() for r in plan.rows]}) + "\n")


# ---------------------------------------------------------------------------- the command
def add_parser(sub: argparse._SubParsersAction, default_model: str) -> None:
    from minivllm.sim.cli_fleet import add_engine_args, add_fleet_args, add_trace_args
    ap = sub.add_parser("plan", help="search colocated and P/D counts for the best goodput per "
                        "instance under TTFT and ITL targets; print the table, the plan and the "
                        "command", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap, num_requests=100)
    ap.add_argument("--ttft-p90", type=float, required=True, help="TTFT target, seconds")
    ap.add_argument("--itl-p90", type=float, required=True,
                    help="ITL target (a request's mean inter-token latency), seconds")
    ap.add_argument("--attainment", type=float, default=DEFAULT_ATTAINMENT,
                    help="fraction of requests that must meet both (DistServe's 90%%)")
    ap.add_argument("--max-instances", type=int, default=4,
                    help="candidates: colocated 1..N and every P + D <= N")
    ap.add_argument("--only", choices=("colocated", "pd"), default=None)
    ap.add_argument("--rel-tol", type=float, default=0.05, help="the rate search's precision")
    add_fleet_args(ap)
    add_engine_args(ap, default_model)
    ap.add_argument("--progress", action="store_true", help="each candidate's result on stderr")


def main(args: argparse.Namespace) -> int:
    prog = "minivllm sim plan"
    from minivllm.sim.cli_fleet import (engine_config, fleet_config, load_cost_model,
                                        requests_from_args)
    cost_model = load_cost_model(args, prog)
    if cost_model is None:
        return 2
    try:
        slo = SLO(args.ttft_p90, args.itl_p90, args.attainment)
        vllm_config = engine_config(args)
        requests = list(requests_from_args(args, int(vllm_config.hf_config.vocab_size)))
        if args.workload == "multiturn":
            requests = spread_conversations(requests, args.request_rate, args.seed)
        rate = trace_rate(requests)
        base = fleet_config(args, num_prefill=1, num_decode=1)
        counts = candidates(args.max_instances, colocated=args.only != "pd",
                            disaggregated=args.only != "colocated")
        if not counts:
            raise ValueError("no candidate: --max-instances must be >= 1 (>= 2 for P/D).")
    except (ValueError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    report = (lambda msg: print(f"{prog}: {msg}", file=sys.stderr)) if args.progress else None
    rows = search(requests, slo, base, vllm_config, cost_model, counts, args.rel_tol, report)
    flags = [f"--block-size {args.block_size}", f"--max-num-seqs {args.max_num_seqs}"]
    if args.max_num_batched_tokens:
        flags.append(f"--max-num-batched-tokens {args.max_num_batched_tokens}")
    from minivllm.sim.worker import SimulatedWorker
    plan = make_plan(rows, rate, slo, cost_model, requests, base, args.model,
                     args.max_num_seqs, SimulatedWorker(vllm_config).kv_cache_bytes_per_token(),
                     flags)
    plan.contention = cost_model.contention
    print_plan(plan, slo, len(requests))
    print(f"{prog}: {sum(len(r.trials) for r in rows)} simulations in "
          f"{time.perf_counter() - t0:.1f} s; cost model {cost_model.meta.get('path')}",
          file=sys.stderr)
    return 0
