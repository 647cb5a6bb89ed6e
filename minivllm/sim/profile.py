"""``python -m minivllm.sim profile``: this machine's step times, measured on the real engine, and
the cost model fitted to them. No vLLM file (Vidur profiles operators, vLLM's benchmarks time whole
runs; this times whole engine steps). No article step: it times the article's ``EngineCore.step``.

The real engine runs with ``ProfilingWorker``, the real ``Worker`` (minivllm/worker/worker.py)
chosen through ``LLM(worker_cls=...)``, which records each step's ``SchedulerOutput``, its
``StepShape``, its worker seconds, the tokens each request sampled and the drafts proposed and
accepted; the driver times each whole ``LLMEngine.step()`` around it (schedule, forward,
sampling, drafting, ``update_from_output``: the time a request waits for), in wall time and in the
thread's CPU time. So every shape is one the real scheduler made. With one torch thread on a CPU
the terms are fitted to the CPU time, which other processes on the machine do not move, and the
median ratio of wall to CPU time is the cost model's ``contention`` (on this shared 2-core machine
wall time scatters by 2-3x around it, CPU time by about 5%).

The sweep, in rounds until the time is spent (at least one), plain and speculative engines (n-gram,
``k = 3``) taking turns so that the machine's drift hits both:
- prefill: one prompt of 32 to 2,048 tokens; a prompt whose first 1,024 tokens are cached
  (prefill attention over a long context);
- decode: 1 to 32 requests behind a shared cached prefix of 64 to 1,536 tokens, 8 tokens each;
- mixed: a prompt of 256 or 1,024 tokens arriving while 8 requests decode (chunks beside decodes).
Prompts repeat a pattern, so that n-gram finds drafts; fresh tokens every round, so no round hits
the cache of another.

The fit (``CostModel.fit``), its error per shape class, the acceptance measured on the speculative
runs (``Acceptance``) and the weight-streaming floor (``bench profile``'s: weight bytes over the
copy bandwidth) go into the stored file.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from minivllm.core.sched.output import SchedulerOutput
from minivllm.sim.cost_model import Acceptance, CostModel, StepShape, default_path
from minivllm.sim.worker import ReplayedDrafts, StepDrafts
from minivllm.worker.worker import Worker

PROFILING_WORKER = "minivllm.sim.profile.ProfilingWorker"
_REQUEST_IDS = itertools.count()
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}


@dataclass
class StepRecord:
    """One real step: what was scheduled, its shape, the worker's seconds (``execute_model`` +
    ``sample_tokens`` + ``take_draft_token_ids``), tokens sampled per request, drafting; and the
    whole ``LLMEngine.step()``'s seconds when a driver timed it."""
    scheduler_output: SchedulerOutput
    shape: StepShape
    worker_s: float
    num_sampled: dict[str, int] = field(default_factory=dict)
    drafts: StepDrafts = field(default_factory=StepDrafts)
    step_s: Optional[float] = None
    step_cpu_s: Optional[float] = None   # the thread's CPU time in it (time.thread_time)


class ProfilingWorker(Worker):
    """The real worker, recording each step (``records``: one ``StepRecord`` per
    ``execute_model``)."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        self.records: list[StepRecord] = []
        self._pending: Optional[StepRecord] = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        t0 = time.perf_counter()
        output = super().execute_model(scheduler_output)
        elapsed = time.perf_counter() - t0
        states = self.model_runner.requests   # updated to this step, nothing sampled yet
        num_tokens = {r: states[r].num_tokens for r in scheduler_output.num_scheduled_tokens}
        speculating = self.vllm_config.speculative_config is not None
        shape = StepShape.from_scheduler_output(scheduler_output, num_tokens, speculating)
        record = StepRecord(scheduler_output, shape, elapsed)
        if output is not None:   # nothing scheduled: no sampling follows
            self.records.append(record)
        else:
            self._pending = record
        return output

    def sample_tokens(self) -> Any:
        t0 = time.perf_counter()
        output = super().sample_tokens()
        record, self._pending = self._pending, None
        record.worker_s += time.perf_counter() - t0
        so = record.scheduler_output
        for req_id in so.num_scheduled_tokens:
            n = len(output.sampled_token_ids[output.req_id_to_index[req_id]])
            record.num_sampled[req_id] = n
            if n and req_id in so.scheduled_spec_decode_tokens:
                record.drafts.accepted[req_id] = n - 1
        self.records.append(record)
        return output

    def take_draft_token_ids(self) -> Any:
        t0 = time.perf_counter()
        drafts = super().take_draft_token_ids()
        if self.records:
            record = self.records[-1]
            record.worker_s += time.perf_counter() - t0
            record.drafts.proposed = {r: len(d) for r, d in (drafts or {}).items()}
        return drafts

    def replayed_drafts(self) -> ReplayedDrafts:
        """This run's drafting, step by step, for a ``SimulatedWorker`` to replay."""
        return ReplayedDrafts([r.drafts for r in self.records])

    def measured_acceptance(self, method: str) -> Acceptance:
        """The drafting of the recorded steps as an ``Acceptance``."""
        k = self.vllm_config.speculative_config.num_speculative_tokens
        verified = [(len(so_drafts), r.drafts.accepted[req_id]) for r in self.records
                    for req_id, so_drafts in r.scheduler_output.scheduled_spec_decode_tokens.items()
                    if req_id in r.drafts.accepted]
        sampling = sum(1 for r in self.records for n in r.num_sampled.values() if n)
        proposing = sum(1 for r in self.records for n in r.drafts.proposed.values() if n)
        return Acceptance.measure(method, k, verified, sampling, proposing)


def run_timed(llm: Any, requests: list[tuple[list[int], int]],
              later: Optional[dict[int, list[tuple[list[int], int]]]] = None,
              on_step: Optional[Callable[[], None]] = None) -> None:
    """Run ``requests`` (prompt ids, max tokens) to the end, greedy, timing each
    ``LLMEngine.step()`` into the step record it made; ``later[i]``: requests added before step
    ``i``."""
    from minivllm import SamplingParams
    from minivllm.utils import frozen_gc_heap
    engine = llm.llm_engine
    worker = engine.engine_core.worker

    def add(batch: list[tuple[list[int], int]]) -> None:
        for ids, max_tokens in batch:
            engine.add_request(f"p{next(_REQUEST_IDS)}", {"prompt_token_ids": ids},
                               SamplingParams(temperature=0, max_tokens=max_tokens,
                                              ignore_eos=True))
    add(requests)
    later = dict(later or {})
    step = 0
    with frozen_gc_heap():
        while engine.has_unfinished_requests() or later:
            if step in later:
                add(later.pop(step))
            before = len(worker.records)
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
            if len(worker.records) > before:
                worker.records[-1].step_s = elapsed
                worker.records[-1].step_cpu_s = cpu
            step += 1
            if on_step is not None:
                on_step()


def _scenarios(rng: Any, vocab: int, max_model_len: int) -> list[tuple[str, list, dict]]:
    """One round's scenarios: (name, requests, later), fresh tokens (the pattern repeats so that
    n-gram finds drafts). Lengths are for a context of at least 2,112 tokens; a model with a
    shorter one gets them scaled down to fit."""
    lo = vocab // 8
    scale = min(1.0, (max_model_len - 64) / 2048)

    def pattern_prompt(n: int) -> list[int]:
        n = max(2, int(n * scale))
        pattern = rng.integers(lo, vocab, 24).tolist()
        return (pattern * (n // 24 + 1))[:n]

    out: list[tuple[str, list, dict]] = []
    for n in (32, 128, 512, 2048):
        out.append((f"prefill {n}", [(pattern_prompt(n), 1)], {}))
    base = pattern_prompt(1024)
    out.append(("prefill 256 after 1024 cached", [(base, 1)],
                {1: [(base + pattern_prompt(256), 1)]}))
    for length in (64, 512, 1536):
        prefix = pattern_prompt(length)
        for batch in (1, 4, 16, 32):
            reqs = [(prefix + prefix[:1 + i % 20], 8) for i in range(batch)]
            # The prefix computed first (one request), the batch then hits it in the cache.
            out.append((f"decode {batch} x {length}", [(prefix, 1)], {1: reqs}))
    for n in (256, 1024):
        prefix = pattern_prompt(512)
        out.append((f"mixed 8 x 512 + {n}", [(prefix, 1)],
                    {1: [(prefix + prefix[:1 + i], 10) for i in range(8)],
                     4: [(pattern_prompt(n), 2)]}))
    return out


def _machine() -> dict[str, Any]:
    import torch
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {"machine": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}


def profile(model: str, minutes: float = 3.0, seed: int = 0, progress: bool = True,
            spec: Optional[dict] = None
            ) -> tuple[CostModel, list[tuple[StepShape, float, Optional[float]]]]:
    """The sweep (module docstring) on ``model``: -> the fitted cost model and its samples
    (shape, wall seconds of the whole step, its CPU seconds)."""
    import numpy as np
    from tqdm.auto import tqdm

    from minivllm import LLM
    spec = NGRAM if spec is None else spec
    load0 = os.getloadavg()[0]
    engines = {"plain": LLM(model=model, skip_tokenizer_init=True, worker_cls=PROFILING_WORKER),
               "spec": LLM(model=model, skip_tokenizer_init=True, worker_cls=PROFILING_WORKER,
                           speculative_config=spec)}
    workers = {name: llm.llm_engine.engine_core.worker for name, llm in engines.items()}
    vocab = int(engines["plain"].vllm_config.hf_config.vocab_size)
    max_model_len = engines["plain"].vllm_config.model_config.max_model_len
    rng = np.random.default_rng(seed)
    budget = minutes * 60.0
    t_start = time.perf_counter()
    bar = tqdm(total=round(budget), desc="profiling (s)", unit="s", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)

    def tick() -> None:
        done = min(int(time.perf_counter() - t_start), bar.total)
        if done > bar.n:
            bar.update(done - bar.n)

    rounds = 0
    while rounds == 0 or time.perf_counter() - t_start < budget:
        rounds += 1
        scenarios = _scenarios(rng, vocab, max_model_len)
        for _, requests, later in scenarios:   # plain and spec take turns, scenario by scenario
            for llm in engines.values():
                run_timed(llm, requests, later, on_step=tick)
        tick()
    bar.close()
    timed = [(r.shape, r.step_s, r.step_cpu_s) for w in workers.values() for r in w.records
             if r.step_s is not None and r.shape.num_reqs]
    # One torch thread on a CPU: the step runs in this thread, so its CPU time is the step's own
    # cost, free of the waits for a core that other processes cause (contention, fitted apart).
    on_cpu_time = (engines["plain"].vllm_config.device == "cpu"
                   and _machine()["torch_threads"] == 1)
    samples = [(s, c if on_cpu_time else t) for s, t, c in timed]
    meta = {"model": model, "model_path": engines["plain"].vllm_config.model_path,
            "device": engines["plain"].vllm_config.device,
            "dtype": str(workers["plain"].dtype).removeprefix("torch."),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **_machine(), "minutes": round((time.perf_counter() - t_start) / 60, 2),
            "rounds": rounds, "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "speculative_config": spec, "timed": "LLMEngine.step (schedule, forward, sampling, "
            "drafting, update_from_output)",
            "fitted_to": "thread CPU time" if on_cpu_time else "wall time",
            "worker_share": sum(r.worker_s for w in workers.values() for r in w.records
                                if r.step_s) / max(1e-9, sum(t for _, t, _ in timed))}
    meta.update(_floor(workers["plain"]))
    cost_model = CostModel.fit(samples, [t for _, t, _ in timed] if on_cpu_time else None,
                               workers["spec"].measured_acceptance(spec["method"]), **meta)
    return cost_model, timed


def _floor(worker: Any) -> dict[str, float]:
    """``bench profile``'s weight-streaming floor for the fixed term: the bytes of weights one
    decode step reads over this machine's copy bandwidth."""
    from minivllm.bench.profile import copy_bandwidth, weight_bytes_per_token
    try:
        weight_bytes = weight_bytes_per_token(worker.model_runner.model)
    except (AttributeError, RuntimeError, NotImplementedError):   # an opaque (packed) weight
        return {}
    bandwidth = copy_bandwidth()
    return {"weight_bytes": weight_bytes, "copy_bandwidth_bytes_s": bandwidth,
            "weight_streaming_floor_s": weight_bytes / bandwidth}


def print_report(cost_model: CostModel, path: str, out: Any = sys.stdout) -> None:
    meta = cost_model.meta
    print(f"cost model for {meta.get('model')} on {meta.get('machine')} ({meta.get('cpu')}, "
          f"{meta.get('torch_threads')} torch threads, torch {meta.get('torch')}), "
          f"{meta.get('num_samples')} steps in {meta.get('minutes')} min, load average "
          f"{meta.get('load_average')}", file=out)
    units = {"step_s": "s per step", "prefill_token_s": "s per prefill token",
             "decode_token_s": "s per decode request", "draft_token_s": "s per draft verified",
             "prefill_attn_s": "s per query-key pair", "decode_attn_s": "s per KV token read",
             "drafter_step_s": "s per drafting step", "drafter_req_s": "s per request drafted"}
    for name, value in cost_model.coefficients.items():
        note = " (not exercised)" if name in meta.get("unfitted", []) else ""
        print(f"  {name:<16}{value:12.4g}  {units[name]}{note}", file=out)
    if "weight_streaming_floor_s" in meta:
        print(f"  weight-streaming floor {meta['weight_streaming_floor_s'] * 1e3:.1f} ms "
              f"({meta['weight_bytes'] / 1e6:.0f} MB / "
              f"{meta['copy_bandwidth_bytes_s'] / 1e9:.1f} GB/s); step_s is "
              f"{cost_model.step_s / meta['weight_streaming_floor_s']:.2f}x it", file=out)
    acc = cost_model.acceptance
    if acc is not None:
        print(f"  acceptance ({acc.method}, k={acc.num_speculative_tokens}, "
              f"{acc.num_observed} verifies): P(accepted = 0..k) = "
              + ", ".join(f"{p:.2f}" for p in acc.accepted_length_probs)
              + f"; drafts proposed on {acc.draft_probability:.0%} of sampled steps", file=out)
    print(f"  contention {cost_model.contention:.2f} (wall seconds per second of the terms; "
          f"fitted to {meta.get('fitted_to', 'wall time')})", file=out)
    for key, what in (("fit_error", f"the fit, against {meta.get('fitted_to', 'wall time')}"),
                      ("wall_error", "with contention, against wall time")):
        if key not in meta:
            continue
        print(f"error per shape class, {what} (|predicted - measured| / measured):", file=out)
        print(f"  {'class':<14}{'steps':>6}{'measured ms':>13}{'mean err':>10}{'p90 err':>9}"
              f"{'bias':>8}", file=out)
        for name, e in meta[key].items():
            print(f"  {name:<14}{e['steps']:>6}{e['measured_mean_s'] * 1e3:>13.1f}"
                  f"{e['abs_rel_err_mean']:>10.1%}{e['abs_rel_err_p90']:>9.1%}"
                  f"{e['rel_err_mean']:>+8.1%}", file=out)
    print(f"stored: {path}", file=out)


def main(argv: Optional[list[str]] = None) -> int:
    from minivllm.model_executor.model_loader import DEFAULT_MODEL
    ap = argparse.ArgumentParser(prog="python -m minivllm.sim profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--minutes", type=float, default=3.0,
                    help="time for the sweep's rounds (at least one round runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cost-model", default=None,
                    help="where to store it (default: the model's path in the cache)")
    ap.add_argument("--save-samples", default=None,
                    help="also write every timed step (shape, wall and CPU seconds, "
                    "predicted) as JSON lines")
    args = ap.parse_args(argv)
    if args.minutes <= 0:
        ap.error("--minutes must be > 0")
    cost_model, samples = profile(args.model, args.minutes, args.seed)
    path = cost_model.save(args.cost_model or default_path(args.model))
    if args.save_samples:
        import dataclasses
        with open(args.save_samples, "w") as fh:
            for shape, seconds, cpu in samples:
                fh.write(json.dumps({"shape": dataclasses.asdict(shape), "seconds": seconds,
                                     "cpu_seconds": cpu,
                                     "predicted": cost_model.predict(shape)}) + "\n")
    print_report(cost_model, path)
    return 0
