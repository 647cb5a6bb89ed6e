"""``python -m minivllm.bench profile``: where one engine step's time goes.

For each (dtype, workload) cell (``bench throughput``'s workloads: 1 request of 64 tokens, 32 mixed
requests), in its own subprocess:

1. an untimed ``generate`` gives tokens/s and the median step (only ``EngineCore.step`` is timed;
   ``--skip-untimed`` takes both from the timed run instead);
2. a second ``generate`` with timers wrapped around the engine's own pieces gives the breakdown,
   per step: projections (every ``Linear`` of the target but the LM head), LM head, attention
   (``Attention``: ``reshape_and_cache`` + paged attention), norm and rotary (``RMSNorm``,
   ``RotaryEmbedding``), sampling or rejection (``_sample``, ``_rejection_sample``), drafter
   (``propose_draft_token_ids``, everything inside it), scheduler (``schedule``, ``update_from_output``, ``update_draft_token_ids``), input
   preparation (``_update_states``, ``_prepare_inputs``), model other (embedding, residual adds,
   activation, module calls) and other (the rest of the step). Times are exclusive: a timer nested
   in another is subtracted from it. The timers are installed on instances only for this run, so
   an engine not being profiled pays nothing.

Below the breakdown, the garbage collector's pauses during the timed run (``gc.callbacks``): they
happen inside whichever category was running, so they are a row apart, not one more category.

It also prints the weight-streaming floor: the bytes of weights one decode step reads (every
parameter once, the embedding table not: one row of it) over the copy bandwidth measured in the
same process (``dst.copy_(src)`` of 256 MiB, read + write bytes, STREAM's convention), and the
measured 1-request step over that floor.

``--base DIR``: also run every cell on the code in DIR (e.g. a worktree of main), alternating with
this tree, cell by cell, so a before/after table comes from one run of one machine.
``--rounds N``: each cell N times per tree, the order of the trees reversed every round (the
second process of a pair can run measurably slower on a small machine), keeping each tree's
fastest run.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

CATEGORIES = ("projections", "LM head", "attention", "norm and rotary", "sampling or rejection",
              "drafter", "suffix tree", "scheduler", "input preparation", "model other", "other")
# --method: the speculative_config of each method (bench vllm's configs), none for "plain".
METHODS = {"plain": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3,
                     "prompt_lookup_max": 5},
           "suffix": {"method": "suffix", "num_speculative_tokens": 3}}
THIS_TREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GcPauses:
    """A ``gc.callbacks`` entry: the cyclic collector's pauses, in seconds, and how many were full
    (oldest-generation) collections, the ones that walk every tracked object not frozen."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t0 = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.full += info["generation"] == 2
            self._t0 = None


class StepTimers:
    """Exclusive wall-clock time per category; a nested timer's time is removed from its parent.
    Inside an ``OPAQUE`` category (the drafter, which may call the target's LM head) nothing nested
    is timed apart: all of it is the drafter's."""

    OPAQUE = ("drafter",)
    # Timed apart even inside an opaque category: suffix decoding's tree work within the drafter.
    INSIDE_OPAQUE = ("suffix tree",)

    def __init__(self) -> None:
        self.total = defaultdict(float)       # exclusive seconds per category
        self.inclusive = defaultdict(float)   # seconds including nested timers
        self._stack: list[list] = []   # [category, start, time spent in children]

    def wrap(self, fn, category: str):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            if (self._stack and self._stack[-1][0] in self.OPAQUE
                    and category not in self.INSIDE_OPAQUE):
                return fn(*args, **kwargs)
            frame = [category, clock(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = clock() - frame[1]
                self.total[category] += spent - frame[2]
                self.inclusive[category] += spent
                if self._stack:
                    self._stack[-1][2] += spent
        return timed


class _Timed:
    """A callable object (an older tree's sampler) timed as a category; attributes pass through."""

    def __init__(self, obj, timed_call) -> None:
        self.__dict__["_obj"], self.__dict__["_call"] = obj, timed_call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._obj, name)


def install(llm, timers: StepTimers) -> None:
    """Wrap the engine's pieces of ``llm`` (instance attributes only) with ``timers``."""
    from minivllm.attention.layer import Attention
    from minivllm.model_executor.linear import Linear
    from minivllm.model_executor.models.llama import RMSNorm, RotaryEmbedding
    core = llm.llm_engine.engine_core
    runner = core.worker.model_runner
    core.step = timers.wrap(core.step, "step")
    for name in ("schedule", "update_from_output", "update_draft_token_ids"):
        setattr(core.scheduler, name, timers.wrap(getattr(core.scheduler, name), "scheduler"))
    for name in ("_update_states", "_prepare_inputs"):
        setattr(runner, name, timers.wrap(getattr(runner, name), "input preparation"))
    if runner.drafter is not None:
        runner.propose_draft_token_ids = timers.wrap(runner.propose_draft_token_ids, "drafter")
    cache = getattr(runner.drafter, "suffix_cache", None)
    if cache is not None:   # the tree work: every call the proposer makes into the trees
        for name in ("start_request", "stop_request", "add_active_response",
                     "evict_cached_response", "speculate"):
            setattr(cache, name, timers.wrap(getattr(cache, name), "suffix tree"))
    if hasattr(runner, "_sample"):   # the runner's two ways to pick the tokens
        for name in ("_sample", "_rejection_sample"):
            setattr(runner, name, timers.wrap(getattr(runner, name), "sampling or rejection"))
    else:   # a tree from before the runner's split (profiled with --base): its sampler objects
        for name in ("sampler", "rejection_sampler"):
            obj = getattr(runner, name, None)
            if obj is not None:
                setattr(runner, name, _Timed(obj, timers.wrap(obj, "sampling or rejection")))
    model = runner.model
    model.forward = timers.wrap(model.forward, "model other")
    model.compute_logits = timers.wrap(model.compute_logits, "model other")
    for mod in model.modules():
        if mod is model.lm_head:
            cat = "LM head"
        elif isinstance(mod, Linear):
            cat = "projections"
        elif isinstance(mod, Attention):
            cat = "attention"
        elif isinstance(mod, (RMSNorm, RotaryEmbedding)):
            cat = "norm and rotary"
        else:
            continue
        mod.forward = timers.wrap(mod.forward, cat)


def weight_bytes_per_token(model) -> int:
    """Bytes a 1-request decode step reads: every parameter once; of the embedding one row."""
    embed = model.model.embed_tokens.weight
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
    if not getattr(model, "tie_word_embeddings", False):   # tied: the LM head streams the table
        total -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
    return total


def copy_bandwidth(nbytes: int = 256 << 20, rounds: int = 5) -> float:
    """Bytes/s of ``dst.copy_(src)``, counting read + write (STREAM's copy), best of ``rounds``."""
    import torch
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _repeated_work(llm, workload: str, max_tokens: int) -> list[tuple[str, int]]:
    """``bench spec``'s repeated edits through the chat template, as ``bench vllm``'s suffix cells:
    "repeated1" 4 prompts one after another, "repeated8" 8 at once."""
    from minivllm.bench.spec import REPEATED
    tok = llm.get_tokenizer()
    n = 4 if workload == "repeated1" else 8
    return [(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                     add_generation_prompt=True), max_tokens) for t in REPEATED[:n]]


def run_cell(dtype: str, workload: str, single_tokens: int, batch_max_tokens: int = 0,
             untimed: bool = True, method: str = "plain", **llm_kwargs) -> dict:
    """One cell; ``llm_kwargs`` go to ``LLM`` (tests pass a tiny model). ``batch_max_tokens``
    caps the 32 requests' output lengths (0: ``bench throughput``'s 16-96); for the repeated
    workloads it is each request's output length (0: 128, stopping at EOS as ``bench vllm``)."""
    import torch

    from minivllm import LLM, SamplingParams
    from minivllm.bench.throughput import BASE_TEXT, QUESTIONS, make_workload
    llm = LLM(dtype=dtype, speculative_config=METHODS[method], **llm_kwargs)
    repeated = workload.startswith("repeated")
    if repeated:
        work = _repeated_work(llm, workload, batch_max_tokens or 128)
    else:
        work = [(BASE_TEXT * 2 + QUESTIONS[0], single_tokens)] if workload == "single" \
            else [(p, min(n, batch_max_tokens or n)) for p, n in make_workload(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=not repeated)
              for _, n in work]
    prompts = [p for p, _ in work]
    groups = [[i] for i in range(len(work))] if workload == "repeated1" else [list(range(len(work)))]
    llm.generate(prompts[:1], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)],
                 use_tqdm=False)   # warm-up
    core = llm.llm_engine.engine_core

    def timed_generate():
        plain_step, step_times = core.step, []

        def step():
            t0 = time.perf_counter()
            out = plain_step()
            step_times.append(time.perf_counter() - t0)
            return out
        core.step = step
        drafter = core.worker.model_runner.drafter
        if hasattr(drafter, "suffix_cache"):   # each run from an empty cache, as bench spec
            drafter.suffix_cache.__init__(drafter.suffix_cache.max_tree_depth,
                                          drafter.suffix_cache.max_cached_requests)
            drafter.num_tokens_seen = {}
        t0 = time.perf_counter()
        outs = [o for g in groups for o in llm.generate([prompts[i] for i in g],
                                                        [params[i] for i in g], use_tqdm=False)]
        elapsed = time.perf_counter() - t0
        core.step = plain_step
        return sum(len(o.outputs[0].token_ids) for o in outs), elapsed, sorted(step_times)

    if untimed:   # tokens/s and the median step with no timer but the step's own
        tokens, elapsed, step_times = timed_generate()
    timers, pauses = StepTimers(), GcPauses()
    install(llm, timers)
    gc.callbacks.append(pauses)
    try:
        t_tokens, t_elapsed, t_steps = timed_generate()
    finally:
        gc.callbacks.remove(pauses)
    if not untimed:
        tokens, elapsed, step_times = t_tokens, t_elapsed, t_steps
    steps = len(t_steps)
    total = timers.inclusive["step"]
    timers.total.pop("step")
    per_step = {c: timers.total.get(c, 0.0) / steps * 1e3 for c in CATEGORIES if c != "other"}
    per_step["other"] = total / steps * 1e3 - sum(per_step.values())
    model = core.worker.model_runner.model
    bw = copy_bandwidth()
    wbytes = weight_bytes_per_token(model)
    return {"dtype": dtype, "workload": workload, "method": method, "requests": len(work),
            "tokens": tokens,
            "seconds": elapsed, "tokens_per_s": tokens / elapsed, "steps": steps,
            "median_step_ms": step_times[len(step_times) // 2] * 1e3,
            "timed_step_ms": total / steps * 1e3, "breakdown_ms": per_step, "untimed": untimed,
            "gc_ms": pauses.seconds / steps * 1e3, "gc_full": pauses.full,
            "weight_bytes": wbytes, "copy_bw": bw, "floor_ms": wbytes / bw * 1e3,
            "threads": torch.get_num_threads()}


def _run_in(tree: str, cell: str, cell_args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    # This file is run by path, so a tree without it (the base) profiles its own engine.
    code = ("import runpy, sys; sys.argv = ['profile', '--cell', %r] + %r; "
            "runpy.run_path(%r, run_name='__main__')" % (cell, cell_args, os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tree, timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not line:
        print(proc.stderr[-3000:])
        raise SystemExit(f"cell {cell} in {tree} failed")
    return json.loads(line[0][len("RESULT "):])


def print_table(results: dict, labels: list[str]) -> None:
    cells = sorted({(r["dtype"], r["workload"]) for r in results.values()}, key=lambda c: (
        c[0] != "float32", c[1] != "single"))
    cols = [(lab, d, w) for d, w in cells for lab in labels]
    short = {"single": " 1", "batch32": " 32", "repeated1": " rep1", "repeated8": " rep8"}
    head = f"{'ms per step':22}" + "".join(f"{lab[:8] + ' ' + d[:4] + short.get(w, ' ' + w):>17}"
                                          for lab, d, w in cols)
    print(head)
    print("-" * len(head))
    for cat in CATEGORIES:
        print(f"{cat:22}" + "".join(f"{results[c]['breakdown_ms'][cat]:17.2f}" for c in cols))
    for key, fmt in (("gc_ms", "GC pauses (in above)"), ("gc_full", "full GC collections"),
                     ("timed_step_ms", "step (timed run)"), ("median_step_ms", "median step"),
                     ("steps", "steps"), ("tokens_per_s", "tokens/s")):
        print(f"{fmt:22}" + "".join(f"{results[c][key]:17.1f}" for c in cols))
    print()
    for lab in labels:
        r = results.get((lab, "float32", "single"))
        if r:
            print(f"[{lab}] weight-streaming floor, float32: {r['weight_bytes'] / 1e6:.0f} MB of "
                  f"weights per token / {r['copy_bw'] / 1e9:.1f} GB/s copy = {r['floor_ms']:.1f} ms; "
                  f"1-request median step {r['median_step_ms']:.1f} ms = "
                  f"{r['median_step_ms'] / r['floor_ms']:.2f}x the floor")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="single,batch32",
                    help="single, batch32, repeated1, repeated8 (bench spec's repeated edits, "
                    "as bench vllm's suffix cells)")
    ap.add_argument("--method", default="plain", choices=sorted(METHODS),
                    help="speculative decoding in every cell (bench vllm's n-gram and suffix "
                    "configs); suffix decoding's calls into its trees get a row of their own")
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--batch-max-tokens", type=int, default=0,
                    help="cap the 32 requests' output lengths (default: 16-96 as bench throughput)")
    ap.add_argument("--skip-untimed", action="store_true",
                    help="one generate per cell: tokens/s from the timed run (faster, ~1%% slower)")
    ap.add_argument("--base", help="another checkout (e.g. main) to profile, alternating")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per cell and tree, the trees' order reversed each round; the fastest kept")
    ap.add_argument("--json", help="write every cell's numbers here")
    ap.add_argument("--cell", help=argparse.SUPPRESS)   # internal: one cell, print JSON
    args = ap.parse_args(argv)
    if args.cell:
        dtype, workload = args.cell.split(":")
        print("RESULT " + json.dumps(run_cell(dtype, workload, args.single_tokens,
                                              args.batch_max_tokens, not args.skip_untimed,
                                              args.method)))
        return
    if args.base and not os.path.isdir(os.path.join(args.base, "minivllm")):
        raise SystemExit(f"--base {args.base!r} is not a minivllm checkout (no minivllm/ in it).")
    trees = ([("before", os.path.abspath(args.base))] if args.base else []) + [("after" if args.base else "this", THIS_TREE)]
    results = {}
    cells = [(d, w) for d in args.dtypes.split(",") for w in args.workloads.split(",")]
    jobs = [(lab, tree, d, w) for d, w in cells for r in range(args.rounds)
            for lab, tree in (trees if r % 2 == 0 else trees[::-1])]
    for i, (lab, tree, d, w) in enumerate(jobs, 1):
        print(f"[{i}/{len(jobs)}] {lab} {d} {w} ...", flush=True)
        cell_args = ["--single-tokens", str(args.single_tokens), "--batch-max-tokens",
                     str(args.batch_max_tokens), "--method", args.method] + (["--skip-untimed"] if args.skip_untimed else [])
        run = _run_in(tree, f"{d}:{w}", cell_args)
        best = results.get((lab, d, w))
        if best is None or run["tokens_per_s"] > best["tokens_per_s"]:
            results[(lab, d, w)] = run
    print()
    print_table(results, [lab for lab, _ in trees])
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(r, label=lab) for (lab, _, _), r in results.items()], f, indent=1)


if __name__ == "__main__":
    main()
