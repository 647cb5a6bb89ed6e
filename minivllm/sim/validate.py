"""``python -m minivllm.sim validate``: the simulator checked against real runs on this machine.
The same trace goes through the real engine (or the real fleet, over its HTTP ingress) and through
the simulator; per request, the measured and the simulated TTFT, ITL and E2E, and the summary
(TTFT p50 / p90, ITL p50 / p90, makespan) with the simulation's relative error. No vLLM file
(vLLM has no simulator; Vidur and LLMServingSim report the same check for theirs). No article step:
it times the article's ``EngineCore.step`` and the fleet the article's "Disaggregated P/D" runs as.

    python -m minivllm.sim validate [--what engine|fleet|all] [--workloads a,b] [--out FILE]
        [--profile MINUTES] [--cost-model FILE] [--num-requests N] [--save-dir DIR]

What runs:
- **one engine** (``validate_engine``): ``bench throughput``'s workloads (``single``: one request
  of 64 tokens; ``batch32``: its 32 mixed requests at once, bench/throughput.py ``make_workload``)
  and ``staggered``, Poisson arrivals. The real ``LLMEngine`` gets each request when the wall clock
  reaches its arrival (``measure_engine``); each token is stamped when the ``engine.step()`` that
  made it returns, as the simulator stamps a token at its step's end. The simulated engine
  (engine.py ``SimEngine``) runs the same token ids with the same engine arguments.
- **the fleet** (``validate_fleet``): ``python -m minivllm.disagg.fleet``'s fleet
  (``start_fleet``: Ray Serve, bound to 127.0.0.1, replicas of one torch thread each), 1P1D on a
  Poisson trace and on ``bench fleet``'s multi-turn chats, and 2P2D on the Poisson trace. Every
  request is streamed through the ingress (``/v1/completions`` with the prompt's token ids, or
  ``/v1/chat/completions`` for the chats, ``ignore_eos``): TTFT is the first chunk, ITL the span
  from the first to the last chunk over the tokens less one (``usage``). The simulated fleet
  (fleet.py ``SimFleet``) runs the same trace; for the chats, every simulated replica answers a
  turn's prompt with the real reply (``SimulatedWorker.answer_with``: the next turn's prompt holds
  it, so its prefix-cache hits are the real ones), each turn sent when the previous one finished.
- Replicas sharing the cores: the cost model's ``contention`` (wall seconds per second of work,
  measured by ``profile`` on one engine) is one number for every replica; the simulator does not
  slow a replica down when others are busy. Two more simulations of the same trace say how much
  of a miss that explains: ``variants["shared cores"]`` (fleets with more replicas than cores)
  multiplies ``contention`` by replicas / cores, the bound where all of them step at once; and
  ``variants["contention measured in the run"]`` takes it from the run queue sampled while the
  real run was measured (``RunQueueSampler``: the fleet's replicas, its serving layer, the client
  and whatever else ran on the machine).

Each check is stored as JSON (``Validation``: the measured and simulated side per request, the
summary and errors, the machine, the date, the command, the load average, the cost model) in
``minivllm/sim/validation/<name>.json``; ``plot_validation`` draws simulated against measured per
request from those files (``figures/sim_validation.png``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

from minivllm.sim.cost_model import CostModel
from minivllm.sim.trace import TraceRequest

FORMAT = "minivllm.sim.validation/1"
HERE = os.path.dirname(os.path.abspath(__file__))
VALIDATION_DIR = os.path.join(HERE, "validation")
PROFILE_DIR = os.path.join(HERE, "profiles")
REPO = os.path.dirname(os.path.dirname(HERE))
FIGURE = os.path.join(REPO, "figures", "sim_validation.png")
GOAL = 0.15                # each error within 15%
SUMMARY_KEYS = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "makespan_s")
ENGINE_WORKLOADS = ("single", "batch32", "staggered")
FLEET_WORKLOADS = ("1p1d_poisson", "1p1d_multiturn", "2p2d_poisson")
FLEET_MAX_MODEL_LEN = 2048   # the fleet replicas' --max-model-len (bench fleet's multi-turn's)
_RUNS = itertools.count()


@dataclass
class RequestTiming:
    """One request's times (seconds): arrival (from the trace's start), TTFT, mean ITL (None with
    one token), E2E (arrival to last token)."""
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: Optional[float]
    itl_s: Optional[float]
    e2e_s: Optional[float]

    @classmethod
    def from_times(cls, t: Any) -> "RequestTiming":
        """From a ``SimEngine``'s ``RequestTimes``."""
        return cls(t.request_id, t.arrival_s, t.num_prompt_tokens, t.num_output_tokens,
                   t.ttft_s, t.itl_s, t.e2e_s)

    @classmethod
    def from_stamps(cls, request_id: str, arrival_s: float, prompt_tokens: int,
                    token_stamps: Sequence[float], num_tokens: Optional[int] = None
                    ) -> "RequestTiming":
        """From wall-clock stamps: the arrival, and when each output (or chunk) came.
        ``num_tokens``: the tokens those stamps carried (default: one each)."""
        n = len(token_stamps) if num_tokens is None else num_tokens
        if not token_stamps:
            return cls(request_id, arrival_s, prompt_tokens, 0, None, None, None)
        first, last = token_stamps[0], token_stamps[-1]
        return cls(request_id, arrival_s, prompt_tokens, n, first - arrival_s,
                   (last - first) / (n - 1) if n > 1 else None, last - arrival_s)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def summarize_timings(timings: Sequence[RequestTiming]) -> dict[str, Any]:
    """``engine.summarize``'s keys (DESIGN.md 5.8): TTFT and ITL p50 / p90, the makespan (first
    arrival to last token), the requests (and how many never got a token)."""
    import numpy as np

    def pct(values: list, q: float) -> Optional[float]:
        return float(np.percentile(values, q)) if values else None
    done = [t for t in timings if t.e2e_s is not None]
    ttft = [t.ttft_s for t in done]
    itl = [t.itl_s for t in done if t.itl_s is not None]
    makespan = (max(t.arrival_s + t.e2e_s for t in done) - min(t.arrival_s for t in timings)
                if done else None)
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "itl_p50_s": pct(itl, 50), "itl_p90_s": pct(itl, 90), "makespan_s": makespan,
            "num_requests": len(timings), "failed": len(timings) - len(done)}


def relative_errors(simulated: dict, measured: dict) -> dict[str, Optional[float]]:
    """(simulated - measured) / measured for each of ``SUMMARY_KEYS`` (None where either side
    has no value)."""
    out: dict[str, Optional[float]] = {}
    for k in SUMMARY_KEYS:
        s, m = simulated.get(k), measured.get(k)
        out[k] = None if s is None or not m else (s - m) / m
    return out


@dataclass
class Validation:
    """One check: a trace through the real system (``measured``) and the simulator
    (``simulated``), per request in the same order; ``variants``: other simulations of the same
    trace (another contention); ``meta``: what ran, where, when, with which cost model."""
    name: str
    what: str                 # "engine" or "fleet"
    workload: str             # what the trace is, in words
    measured: list[RequestTiming]
    simulated: list[RequestTiming]
    meta: dict[str, Any] = field(default_factory=dict)
    variants: dict[str, list[RequestTiming]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if [t.request_id for t in self.measured] != [t.request_id for t in self.simulated]:
            raise ValueError(f"{self.name}: the measured and simulated requests differ.")

    def summary(self) -> dict[str, dict]:
        """{"measured": ..., "simulated": ..., "error": ...} and each variant's simulation and
        error."""
        m, s = summarize_timings(self.measured), summarize_timings(self.simulated)
        out = {"measured": m, "simulated": s, "error": relative_errors(s, m)}
        for name, timings in self.variants.items():
            v = summarize_timings(timings)
            out[f"simulated ({name})"] = v
            out[f"error ({name})"] = relative_errors(v, m)
        return out

    def to_json(self) -> dict:
        requests = []
        for m, s in zip(self.measured, self.simulated):
            row = {"request_id": m.request_id, "arrival_s": m.arrival_s,
                   "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
                   "measured": {k: getattr(m, k) for k in ("ttft_s", "itl_s", "e2e_s")},
                   "simulated": {k: getattr(s, k) for k in ("ttft_s", "itl_s", "e2e_s")}}
            for name, timings in self.variants.items():
                v = timings[len(requests)]
                row[f"simulated ({name})"] = {k: getattr(v, k) for k in ("ttft_s", "itl_s",
                                                                         "e2e_s")}
            requests.append(row)
        return {"format": FORMAT, "name": self.name, "what": self.what,
                "workload": self.workload, "meta": self.meta, "summary": self.summary(),
                "variants": {name: [t.to_json() for t in ts]
                             for name, ts in self.variants.items()},
                "simulated": [t.to_json() for t in self.simulated], "requests": requests}

    @classmethod
    def from_json(cls, data: dict) -> "Validation":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a validation file of format {FORMAT!r} "
                             f"(format {data.get('format')!r}).")
        measured = [RequestTiming(r["request_id"], r["arrival_s"], r["prompt_tokens"],
                                  r["output_tokens"], **r["measured"]) for r in data["requests"]]
        return cls(data["name"], data["what"], data["workload"], measured,
                   [RequestTiming(**t) for t in data["simulated"]], data.get("meta", {}),
                   {name: [RequestTiming(**t) for t in ts]
                    for name, ts in data.get("variants", {}).items()})

    def save(self, directory: str = VALIDATION_DIR) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{self.name}.json")
        with open(path, "w") as fh:
            json.dump(self.to_json(), fh, indent=1)
            fh.write("\n")
        return path

    @classmethod
    def load(cls, path: str) -> "Validation":
        with open(path) as fh:
            return cls.from_json(json.load(fh))


def load_validations(directory: str = VALIDATION_DIR) -> list[Validation]:
    """Every stored check in ``directory``, engines first, by name."""
    if not os.path.isdir(directory):
        return []
    found = [Validation.load(os.path.join(directory, n)) for n in sorted(os.listdir(directory))
             if n.endswith(".json")]
    return sorted(found, key=lambda v: (v.what != "engine", v.name))


# ---------------------------------------------------------------------- reporting
def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.0%}"


def table(validations: Sequence[Validation], variants: bool = True) -> str:
    """Markdown: per check and metric, measured and simulated (ms) and the error; a ``*`` marks
    an error over ``GOAL``."""
    head = ("| check | requests | " + " | ".join(
        f"{k.removesuffix('_s').replace('_', ' ')} ms: measured / simulated (error)"
        for k in SUMMARY_KEYS) + " |")
    rows = [head, "|" + "---|" * (len(SUMMARY_KEYS) + 2)]
    for v in validations:
        s = v.summary()
        sims = [("", s["simulated"], s["error"])]
        if variants:
            sims += [(f" ({n})", s[f"simulated ({n})"], s[f"error ({n})"]) for n in v.variants]
        for label, sim, err in sims:
            cells = []
            for k in SUMMARY_KEYS:
                e = err[k]
                flag = "*" if e is not None and abs(e) > GOAL else ""
                cells.append(f"{_ms(s['measured'][k])} / {_ms(sim[k])} ({_pct(e)}{flag})")
            rows.append(f"| {v.name}{label} | {s['measured']['num_requests']} | "
                        + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_validation(validations: Union[str, Sequence[Validation], None] = None, ax: Any = None,
                    metrics: Sequence[str] = ("ttft_s", "e2e_s")) -> Any:
    """Simulated against measured, one point per request, one panel per metric (TTFT, E2E), one
    colour per check; the line y = x and the band of +-``GOAL`` around it; log axes (the times
    run from milliseconds to tens of seconds). ``validations``: the checks, or a folder of stored
    ones (default: the package's). ``ax``: the axes to draw in (one per metric), else a new
    figure. -> the figure."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FormatStrFormatter, NullFormatter
    if validations is None or isinstance(validations, str):
        validations = load_validations(validations or VALIDATION_DIR)
    if ax is None:
        fig, ax = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 4.6))
    axes = np.atleast_1d(ax)
    fig = axes[0].figure
    titles = {"ttft_s": "TTFT", "e2e_s": "E2E", "itl_s": "ITL (mean per request)"}
    markers = {"engine": "o", "fleet": "^"}
    for a, metric in zip(axes, metrics):
        lo, hi = math.inf, 0.0
        for i, v in enumerate(validations):
            pairs = [(getattr(m, metric), getattr(s, metric))
                     for m, s in zip(v.measured, v.simulated)]
            pairs = [(m, s) for m, s in pairs if m and s and m > 0 and s > 0]
            if not pairs:
                continue
            x, y = np.array(pairs).T
            lo, hi = min(lo, x.min(), y.min()), max(hi, x.max(), y.max())
            a.scatter(x, y, s=14, alpha=0.75, marker=markers.get(v.what, "o"),
                      color=plt.cm.tab10(i % 10), label=v.name)
        if hi == 0:
            continue
        grid = np.geomspace(lo / 1.5, hi * 1.5, 50)
        a.plot(grid, grid, color="black", lw=1, label="simulated = measured")
        a.fill_between(grid, grid * (1 - GOAL), grid * (1 + GOAL), color="grey", alpha=0.2,
                       label=f"\u00b1{GOAL:.0%}")
        a.set_xscale("log")
        a.set_yscale("log")
        for axis in (a.xaxis, a.yaxis):
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(NullFormatter())
        a.set_xlim(grid[0], grid[-1])
        a.set_ylim(grid[0], grid[-1])
        a.set_xlabel(f"measured {titles.get(metric, metric)} (s)")
        a.set_ylabel(f"simulated {titles.get(metric, metric)} (s)")
        a.set_title(f"{titles.get(metric, metric)}, per request")
        a.grid(True, which="both", alpha=0.25)
    axes[-1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------- the run's contention
class RunQueueSampler:
    """How crowded the cores were while a run was measured: the kernel's count of runnable threads
    (``procs_running`` in /proc/stat) every ``interval_s``, less this sampler's own thread. A
    runnable thread at a moment when ``N`` are runnable on ``C`` cores gets ``C / N`` of a core
    when ``N > C``; weighted by the threads that run, the wall time per second of CPU is
    ``sum(N * max(1, N / C)) / sum(N)`` (``contention``; 1 on a quiet machine). The cost model's
    ``contention`` is the same quantity measured during the profile, for one engine alone. A
    ``with`` block; on a system without /proc/stat it records nothing."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def running() -> Optional[int]:
        try:
            with open("/proc/stat") as fh:
                for line in fh:
                    if line.startswith("procs_running"):
                        return max(0, int(line.split()[1]) - 1)     # less the reader
        except (OSError, ValueError):
            return None
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            n = self.running()
            if n is not None:
                self.samples.append(n)

    def __enter__(self) -> "RunQueueSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def contention(self, cores: Optional[int] = None) -> Optional[float]:
        cores = cores or os.cpu_count() or 1
        busy = sum(self.samples)
        if not busy:
            return None
        return sum(n * max(1.0, n / cores) for n in self.samples) / busy

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {}
        return {"samples": len(self.samples), "interval_s": self.interval_s,
                "running_mean": sum(self.samples) / len(self.samples),
                "contention": self.contention()}


def _with_run_contention(cost_model: CostModel, sampler: RunQueueSampler) -> Optional[CostModel]:
    """The cost model with ``contention`` as measured during the run (None without samples)."""
    measured = sampler.contention()
    return None if measured is None else dataclasses.replace(cost_model, contention=measured)


RUN_CONTENTION = "contention measured in the run"


# ---------------------------------------------------------------------- one engine
STAGGERED = {"rate": 1.0, "prompt_tokens": (64, 512), "output_tokens": (16, 96)}


def engine_trace(workload: str, tokenizer: Any, vocab_size: int, num_requests: Optional[int],
                 seed: int = 0, **staggered: Any) -> list[TraceRequest]:
    """``single`` and ``batch32``: ``bench throughput``'s prompts (its tokenizer's ids), all at
    once; ``staggered``: Poisson arrivals, by default (``STAGGERED``) 1 request/s, prompts of
    64-512 random tokens, outputs of 16-96 (``batch32``'s range). ``num_requests`` caps
    ``batch32`` and sizes ``staggered`` (default 32 and 24)."""
    from minivllm.bench.throughput import BASE_TEXT, QUESTIONS, make_workload
    from minivllm.sim.trace import poisson_trace
    if workload in ("single", "batch32"):
        work = ([(BASE_TEXT * 2 + QUESTIONS[0], 64)] if workload == "single"
                else make_workload(32, seed)[:num_requests or 32])
        return [TraceRequest(str(i), 0.0, len(ids), n, ids)
                for i, (text, n) in enumerate(work) for ids in [tokenizer.encode(text)]]
    if workload == "staggered":
        kw = {**STAGGERED, **staggered}
        requests = poisson_trace(num_requests or 24, kw["rate"], kw["prompt_tokens"],
                                 kw["output_tokens"], seed=seed)
        return [dataclasses.replace(r, prompt_token_ids=r.prompt_ids(vocab_size, seed))
                for r in requests]
    raise ValueError(f"unknown engine workload {workload!r}; one of {ENGINE_WORKLOADS}.")


def measure_engine(llm: Any, requests: Sequence[TraceRequest]) -> list[RequestTiming]:
    """The trace through the real engine, in wall-clock time: a request is added once the clock
    reaches its ``arrival_s`` (those arriving during a step join after it, as in the simulator),
    the engine idles (sleeps) when nothing is left to run, and each token is stamped when the
    ``LLMEngine.step()`` that made it returns. Greedy, ``ignore_eos``: each request makes exactly
    its ``output_tokens``. -> timings in trace order."""
    from minivllm import SamplingParams
    from minivllm.utils import frozen_gc_heap
    engine = llm.llm_engine
    pending = sorted(requests, key=lambda r: r.arrival_s)
    # Ids of their own: the engine may still hold a finished request of the same id (a warm-up's)
    # until its next step frees it.
    prefix = f"validate-{next(_RUNS)}-"
    stamps: dict[str, list[float]] = {prefix + r.request_id: [] for r in requests}
    seen: dict[str, int] = {}
    t0 = time.perf_counter()
    with frozen_gc_heap():
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while pending and pending[0].arrival_s <= now:
                r = pending.pop(0)
                engine.add_request(prefix + r.request_id,
                                   {"prompt_token_ids": r.prompt_token_ids},
                                   SamplingParams(temperature=0, max_tokens=r.output_tokens,
                                                  ignore_eos=True))
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            outputs = engine.step()
            t = time.perf_counter() - t0
            for out in outputs:
                n = len(out.outputs[0].token_ids)
                new = n - seen.get(out.request_id, 0)
                seen[out.request_id] = n
                stamps[out.request_id].extend([t] * new)
    return [RequestTiming.from_stamps(r.request_id, r.arrival_s, r.prompt_tokens,
                                      stamps[prefix + r.request_id]) for r in requests]


def simulate_engine(model: str, cost_model: CostModel, requests: Sequence[TraceRequest],
                    **engine_args: Any) -> list[RequestTiming]:
    """The same trace through ``SimEngine`` with the same engine arguments."""
    from minivllm.sim.engine import SimEngine
    sim = SimEngine.from_engine_args(model, cost_model, record_token_times=False, **engine_args)
    return [RequestTiming.from_times(t) for t in sim.run_trace(requests)]


def _warm_up(llm: Any, vocab_size: int) -> None:
    """A few steps before timing: the first steps pay one-time allocations the profile's did
    not."""
    from minivllm import SamplingParams
    llm.generate([{"prompt_token_ids": list(range(vocab_size // 8, vocab_size // 8 + 200))}],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)


def validate_engine(workload: str, model: str, cost_model: CostModel,
                    num_requests: Optional[int] = None, seed: int = 0, llm: Any = None,
                    tokenizer: Any = None, staggered: Optional[dict] = None,
                    **engine_args: Any) -> Validation:
    """One engine workload (``ENGINE_WORKLOADS``), measured then simulated. ``llm``: a real engine
    built with ``engine_args`` (default: built here); ``tokenizer``: for ``bench throughput``'s
    text prompts (default: the model's); ``staggered``: ``STAGGERED``'s rate and lengths
    changed."""
    from minivllm import LLM
    if llm is None:
        llm = LLM(model=model, skip_tokenizer_init=True, seed=seed, **engine_args)
        _warm_up(llm, int(llm.vllm_config.hf_config.vocab_size))
    vocab = int(llm.vllm_config.hf_config.vocab_size)
    if tokenizer is None and workload != "staggered":
        from minivllm.model_executor.model_loader import load_tokenizer
        tokenizer = load_tokenizer(llm.vllm_config.model_path)
    requests = engine_trace(workload, tokenizer, vocab, num_requests, seed, **(staggered or {}))
    load0 = os.getloadavg()[0]
    with RunQueueSampler() as sampler:
        measured = measure_engine(llm, requests)
    load1 = os.getloadavg()[0]
    simulated = simulate_engine(model, cost_model, requests, seed=seed, **engine_args)
    variants = {}
    crowded = _with_run_contention(cost_model, sampler)
    if crowded is not None:
        variants[RUN_CONTENTION] = simulate_engine(model, crowded, requests, seed=seed,
                                                   **engine_args)
    words = {"single": "bench throughput's single request (64 tokens)",
             "batch32": f"bench throughput's batch workload ({len(requests)} requests at once, "
                        "outputs 16-96)",
             "staggered": "{} requests, Poisson arrivals at {rate:g}/s, prompts {prompt_tokens}, "
                          "outputs {output_tokens}".format(len(requests),
                                                           **{**STAGGERED, **(staggered or {})})}
    return Validation(f"engine_{workload}", "engine", words[workload], measured, simulated,
                      _meta(cost_model, load0, load1, engine_args=engine_args,
                            run_queue=sampler.summary(),
                            trace=[r.to_json(with_id=True) for r in _lengths_only(requests)]),
                      variants)


def _lengths_only(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The trace as lengths (a stored file keeps counts, not token ids)."""
    return [dataclasses.replace(r, prompt_token_ids=None) for r in requests]


def _meta(cost_model: CostModel, load0: float, load1: float, **extra: Any) -> dict[str, Any]:
    from minivllm.sim.profile import _machine
    cm = cost_model.meta
    return {**_machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m minivllm.sim " + " ".join(sys.argv[1:]) if sys.argv[1:2] == [
                "validate"] else None,
            "load_average": [round(load0, 2), round(load1, 2)],
            "cost_model": {"path": cm.get("path"), "date": cm.get("date"),
                           "machine": cm.get("machine"), "contention": cost_model.contention,
                           "coefficients": cost_model.coefficients,
                           "load_average": cm.get("load_average")},
            **extra}


# ---------------------------------------------------------------------- the fleet
def _stream(url: str, path: str, body: dict, t0: float) -> tuple[float, list[float], dict]:
    """POST a streamed request; -> (when it was sent, when each chunk with choices came, the
    usage), times from ``t0``."""
    import httpx
    body = dict(body, stream=True, stream_options={"include_usage": True})
    sent, stamps, usage = time.perf_counter() - t0, [], {}
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{path}: {chunk['error']}")
            if chunk.get("choices"):
                stamps.append(time.perf_counter() - t0)
            usage = chunk.get("usage") or usage
    return sent, stamps, usage


def measure_fleet_trace(url: str, model: str, requests: Sequence[TraceRequest]
                        ) -> list[RequestTiming]:
    """A trace with token-id prompts through the fleet's ingress, each request streamed from its
    own thread, sent when the wall clock reaches its ``arrival_s``."""
    results: dict[str, RequestTiming] = {}
    errors: list[str] = []
    t0 = time.perf_counter()

    def one(r: TraceRequest) -> None:
        delay = r.arrival_s - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        try:
            sent, stamps, usage = _stream(url, "/v1/completions", {
                "model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_tokens,
                "temperature": 0, "ignore_eos": True}, t0)
        except Exception as e:                    # noqa: BLE001  reported below
            errors.append(f"{r.request_id}: {e}")
            return
        results[r.request_id] = RequestTiming.from_stamps(
            r.request_id, sent, r.prompt_tokens, stamps, usage.get("completion_tokens"))
    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:3]}")
    return [results[r.request_id] for r in requests]


def measure_fleet_chats(url: str, model: str, tokenizer: Any, conversations: int, turns: int,
                        max_tokens: int) -> tuple[list[RequestTiming], list[TraceRequest],
                                                  dict[int, list[int]]]:
    """``bench fleet --workload multiturn``'s chats (its topics and follow-ups), every
    conversation at once, each turn sent when the previous one finished, ``max_tokens`` a reply
    (``ignore_eos``). -> (timings, the trace the chats made: each turn's prompt as the ingress
    tokenizes it, its conversation, arrival 0; the real replies by ``prompt_key`` of their
    prompt, taken from the next turn's prompt, which holds them)."""
    from minivllm.bench.fleet_multiturn import _messages
    from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
    from minivllm.sim.trace import prompt_key
    turns_done: dict[tuple[int, int], tuple[list[int], RequestTiming, str]] = {}
    errors: list[str] = []
    t0 = time.perf_counter()

    def prompt_ids(body: dict) -> list[int]:   # as the ingress and the replicas tokenize a chat
        chat = ChatCompletionRequest(**body)
        text = tokenizer.apply_chat_template(chat.template_messages(), add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(text)

    def conversation(c: int) -> None:
        replies: list[str] = []
        for t in range(turns):
            body = {"model": model, "messages": _messages(c, replies), "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            ids = prompt_ids(body)
            text = ""
            try:
                import httpx
                sent = time.perf_counter() - t0
                stamps, usage = [], {}
                with httpx.stream("POST", url + "/v1/chat/completions", timeout=600,
                                  json=dict(body, stream=True,
                                            stream_options={"include_usage": True})) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}")
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(str(chunk["error"]))
                        for ch in chunk.get("choices") or []:
                            stamps.append(time.perf_counter() - t0)
                            text += ch.get("delta", {}).get("content") or ""
                        usage = chunk.get("usage") or usage
            except Exception as e:                # noqa: BLE001  reported below
                errors.append(f"chat {c} turn {t}: {e}")
                return
            # The role chunk and the finish chunk come with a token's output: one stamp per step
            # that sent something; the span first..last holds the tokens less one.
            timing = RequestTiming.from_stamps(f"c{c}t{t}", sent, len(ids), stamps,
                                               usage.get("completion_tokens"))
            turns_done[(c, t)] = (ids, timing, text)
            replies.append(text)
    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(conversations)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{len(errors)} chat turns failed: {errors[:3]}")
    keys = sorted(turns_done, key=lambda k: (k[1], k[0]))
    trace = [TraceRequest(f"c{c}t{t}", 0.0, len(turns_done[(c, t)][0]), max_tokens,
                          turns_done[(c, t)][0], str(c)) for c, t in keys]
    replies: dict[int, list[int]] = {}
    for c, t in keys:
        ids = turns_done[(c, t)][0]
        nxt = turns_done.get((c, t + 1))
        if nxt is not None and nxt[0][:len(ids)] == ids:
            replies[prompt_key(ids)] = nxt[0][len(ids):len(ids) + max_tokens]
        else:
            replies[prompt_key(ids)] = tokenizer.encode(turns_done[(c, t)][2],
                                                        add_special_tokens=False)
    return [turns_done[k][1] for k in keys], trace, replies


def simulate_fleet(config: Any, vllm_config: Any, cost_model: CostModel,
                   requests: Sequence[TraceRequest],
                   replies: Optional[dict[int, list[int]]] = None) -> list[RequestTiming]:
    """The trace through ``SimFleet``; ``replies``: every replica answers those prompts with the
    real replies (``SimulatedWorker.answer_with``). -> timings in trace order."""
    from minivllm.sim.fleet import SimFleet
    fleet = SimFleet(config, vllm_config, cost_model)
    if replies:
        for pool in fleet.replicas.values():
            for replica in pool.values():
                replica.engine.worker.answer_with(replies)
    by_id = {r.request_id: r for r in requests}
    return [RequestTiming(rec.request_id, rec.arrival_s, by_id[rec.request_id].prompt_tokens,
                          rec.num_output_tokens, rec.ttft_s, rec.itl_s, rec.e2e_s)
            for rec in fleet.run(requests)]


FLEET_POISSON = {"rate": 0.5, "prompt_tokens": (64, 512), "output_tokens": (16, 64)}


def fleet_poisson_trace(num_requests: int, vocab_size: int, seed: int = 0,
                        **poisson: Any) -> list[TraceRequest]:
    """Poisson arrivals with random-token prompts, by default (``FLEET_POISSON``) 0.5 request/s
    (a prefill replica here is about a third busy), prompts of 64-512 tokens, outputs of
    16-64."""
    from minivllm.sim.trace import poisson_trace
    kw = {**FLEET_POISSON, **poisson}
    requests = poisson_trace(num_requests, kw["rate"], kw["prompt_tokens"], kw["output_tokens"],
                             seed=seed)
    return [dataclasses.replace(r, prompt_token_ids=r.prompt_ids(vocab_size, seed))
            for r in requests]


def validate_fleet(workload: str, model: str, cost_model: CostModel, num_requests: int = 24,
                   seed: int = 0, conversations: int = 6, turns: int = 4,
                   max_tokens: int = 48, max_model_len: int = FLEET_MAX_MODEL_LEN,
                   poisson: Optional[dict] = None) -> Validation:
    """One fleet check (``FLEET_WORKLOADS``): the real fleet started here (its own Ray, Serve on
    127.0.0.1, fixed counts, replicas of one torch thread, ``--max-model-len max_model_len``), the
    trace streamed through its ingress, the fleet stopped; then the simulated fleet on the same
    trace. ``poisson``: ``FLEET_POISSON``'s rate and lengths changed."""
    from minivllm.bench.fleet_multiturn import _own_ray
    from minivllm.disagg.fleet.app import FleetConfig
    from minivllm.disagg.fleet.autoscale import FleetTargets
    from minivllm.disagg.fleet.driver import start_fleet
    from minivllm.model_executor.model_loader import load_tokenizer, resolve_model_path
    from minivllm.sim.engine import make_vllm_config
    from minivllm.sim.fleet import SimFleetConfig
    import ray
    counts, kind = workload.split("_")
    p, d = int(counts[0]), int(counts[2])
    tokenizer = load_tokenizer(resolve_model_path(model))
    vllm_config = make_vllm_config(model, max_model_len=max_model_len, seed=seed)
    vocab = int(vllm_config.hf_config.vocab_size)
    config = FleetConfig(model=model, replica_num_cpus=1, node_ip=False, seed=seed,
                         server_args=["--max-model-len", str(max_model_len)])
    cluster = _own_ray()
    replies = None
    try:
        fleet = start_fleet(config, FleetTargets(p, p, d, d), startup_timeout=300)
        try:
            # Warm-up: every replica's first steps pay one-time allocations.
            warm = fleet_poisson_trace(2 * (p + d), vocab, seed + 1, **(poisson or {}))
            measure_fleet_trace(fleet.url, model, [dataclasses.replace(r, arrival_s=0.0)
                                                   for r in warm])
            load0 = os.getloadavg()[0]
            sampler = RunQueueSampler().__enter__()
            if kind == "poisson":
                requests = fleet_poisson_trace(num_requests, vocab, seed, **(poisson or {}))
                measured = measure_fleet_trace(fleet.url, model, requests)
                words = ("{} requests, Poisson arrivals at {rate:g}/s, prompts {prompt_tokens}, "
                         "outputs {output_tokens}").format(len(requests),
                                                          **{**FLEET_POISSON, **(poisson or {})})
            else:
                measured, requests, replies = measure_fleet_chats(
                    fleet.url, model, tokenizer, conversations, turns, max_tokens)
                words = (f"bench fleet's multi-turn chats: {conversations} conversations x "
                         f"{turns} turns, {max_tokens} tokens a reply")
            sampler.__exit__(None, None, None)
            load1 = os.getloadavg()[0]
        finally:
            fleet.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
    sim_config = SimFleetConfig(num_prefill=p, num_decode=d, router=config.router,
                                pd_min_uncached_tokens=config.pd_min_uncached_tokens,
                                overlap_score_weight=config.overlap_score_weight, seed=seed)
    simulated = simulate_fleet(sim_config, vllm_config, cost_model, requests, replies)
    variants = {}
    cores = os.cpu_count() or 1
    if p + d > cores:
        shared = dataclasses.replace(cost_model,
                                     contention=cost_model.contention * (p + d) / cores)
        variants["shared cores"] = simulate_fleet(sim_config, vllm_config, shared, requests,
                                                  replies)
    crowded = _with_run_contention(cost_model, sampler)
    if crowded is not None:
        variants[RUN_CONTENTION] = simulate_fleet(sim_config, vllm_config, crowded, requests,
                                                  replies)
    return Validation(f"fleet_{workload}", "fleet", f"{p}P{d}D: {words}", measured, simulated,
                      _meta(cost_model, load0, load1, fleet=f"{p}P{d}D",
                            run_queue=sampler.summary(),
                            fleet_config={"router": config.router,
                                          "pd_min_uncached_tokens": config.pd_min_uncached_tokens,
                                          "kv_connector": config.kv_connector,
                                          "replica_num_cpus": config.replica_num_cpus,
                                          "server_args": config.server_args},
                            transfer=sim_config.transfer.describe(),
                            trace=[r.to_json(with_id=True) for r in _lengths_only(requests)]),
                      variants)


# ---------------------------------------------------------------------- the command
def add_parser(sub: argparse._SubParsersAction, default_model: str) -> None:
    ap = sub.add_parser("validate", help="the simulator against real runs here: per-request "
                        "TTFT / ITL / E2E, measured and simulated, and the errors",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=("engine", "fleet", "all"), default="all")
    ap.add_argument("--workloads", default=None,
                    help=f"a subset, comma-separated: engine {','.join(ENGINE_WORKLOADS)}; "
                    f"fleet {','.join(FLEET_WORKLOADS)}")
    ap.add_argument("--model", default=default_model)
    ap.add_argument("--cost-model", default=None, help="a cost model file (default: the one "
                    "`profile` stored for this model on this machine)")
    ap.add_argument("--profile", type=float, default=0.0, metavar="MINUTES",
                    help="profile first (the default cost model's file), this many minutes: "
                    "timings here drift from day to day")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per trace (default: 32 for batch32, 24 otherwise)")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per chat reply")
    ap.add_argument("--max-model-len", type=int, default=FLEET_MAX_MODEL_LEN,
                    help="the fleet replicas' --max-model-len")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the per-request lines and SUMMARY lines "
                    "here instead of stdout")
    ap.add_argument("--save-dir", default=VALIDATION_DIR,
                    help="where each check is stored as <name>.json (empty: not stored)")
    ap.add_argument("--figure", default=FIGURE,
                    help="draw every check stored in --save-dir here (empty: no figure)")


def main(args: argparse.Namespace) -> int:
    import torch
    prog = "minivllm sim validate"
    from minivllm.sim.cost_model import default_path
    if args.profile > 0:
        from minivllm.sim.profile import main as profile_main
        profile_main(["--model", args.model, "--minutes", str(args.profile)]
                     + (["--cost-model", args.cost_model] if args.cost_model else []))
    from minivllm.sim.cli_fleet import load_cost_model
    cost_model = load_cost_model(args, prog)
    if cost_model is None:
        return 2
    cost_model.meta.setdefault("path", args.cost_model or default_path(args.model))
    names = ([w for w in args.workloads.split(",") if w] if args.workloads else
             (list(ENGINE_WORKLOADS) if args.what in ("engine", "all") else [])
             + (list(FLEET_WORKLOADS) if args.what in ("fleet", "all") else []))
    unknown = set(names) - set(ENGINE_WORKLOADS) - set(FLEET_WORKLOADS)
    if unknown:
        print(f"{prog}: unknown workloads {sorted(unknown)}; engine {ENGINE_WORKLOADS}, fleet "
              f"{FLEET_WORKLOADS}", file=sys.stderr)
        return 2
    threads = int(cost_model.meta.get("torch_threads") or 1)
    torch.set_num_threads(threads)       # the profile's: its terms are one thread's work
    done: list[Validation] = []
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        llm = None
        for name in names:
            t0 = time.perf_counter()
            if name in ENGINE_WORKLOADS:
                if llm is None:
                    from minivllm import LLM
                    llm = LLM(model=args.model, skip_tokenizer_init=True, seed=args.seed)
                    _warm_up(llm, int(llm.vllm_config.hf_config.vocab_size))
                v = validate_engine(name, args.model, cost_model, args.num_requests, args.seed,
                                    llm=llm)
            else:
                llm = None        # the fleet's replicas get the machine (and the memory)
                gc.collect()
                v = validate_fleet(name, args.model, cost_model, args.num_requests or 24,
                                   args.seed, args.conversations, args.turns, args.max_tokens,
                                   args.max_model_len)
            done.append(v)
            data = v.to_json()
            for row in data["requests"]:
                out.write(json.dumps({"check": v.name, **row}) + "\n")
            out.write("SUMMARY " + json.dumps({"check": v.name, **data["summary"]}) + "\n")
            out.flush()
            saved = v.save(args.save_dir) if args.save_dir else None
            print(f"{prog}: {v.name} in {time.perf_counter() - t0:.0f} s, load average "
                  f"{v.meta['load_average']}" + (f"; stored {saved}" if saved else ""),
                  file=sys.stderr)
    finally:
        if out is not sys.stdout:
            out.close()
    print(table(done))
    if args.figure and args.save_dir:
        import matplotlib
        matplotlib.use("Agg")
        fig = plot_validation(args.save_dir)
        os.makedirs(os.path.dirname(os.path.abspath(args.figure)), exist_ok=True)
        fig.savefig(args.figure, dpi=110)
        print(f"figure: {args.figure}")
    return 0
