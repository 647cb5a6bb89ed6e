"""A guided walk through the article's steps: ``python -m minivllm.tour spec|pd [--pdb] [--no-wait]``.

The tour runs the article's example (``minivllm/examples/``) with every step of that part armed as a
breakpoint (``minivllm/steps.py``) and replaces ``sys.breakpointhook`` for the run: at each stop it
prints the step id on its own line, the article's sentence in our words, ``file:line`` (where pdb
then stops: the next line to run) and function, the values that matter there, read from the
engine's live frame, and the step's note (why the numbers are what they are, ids as text:
``step_table.NOTES``); then it waits for Enter.
``--pdb`` opens pdb in that frame instead (``c`` goes on to the next step); ``--no-wait`` runs
straight through (CI); ``--ide`` leaves ``breakpoint()`` to the debugger already in charge (VS Code's
debugpy stops in the engine's frame). ``--plain`` runs the forward on the reference paths (attention
``"torch"``, ``F.linear`` for every projection), so that stepping into the model shows plain torch
calls, and verifies with the article's rule as it reads (the rejection sampler's "reference"
backend, sample/rejection_reference.py); by default it runs the CPU's fast paths and vLLM's
exponential race, as ``LLM()`` does. ``--then-and-now`` adds vLLM 0.32's overrides (then_and_now.py).

The runs are ``Tour.run_spec`` and ``Tour.run_pd``, set up so that every step of a part happens:
- ``spec``: the article's n-gram example (same prompts, ``temperature=0.8, top_p=0.95``, k=3), plus
  one self-repeating prompt so that the drafter finds a match right after the prefill, and one that
  arrives once those drafts exist, so that a prefill meets a verify at ``spec.6``. ``--method``
  swaps the drafter (SPEC_METHODS): ``draft_model`` (a self-draft: the target's first layers) and
  ``eagle`` (the shipped head) run a forward of their own after the target's and write KV for their
  drafts, so the scheduler reserves ``num_lookahead_tokens = k`` slots (``spec.4``); ``suffix``
  drafts from suffix trees (``spec.2`` prints the match).
- ``pd``: the article's prefill and decode instances, one after the other in this process (the
  article's ``prefill_done`` event becomes "the prefill run returned"), over a temporary
  ``shared_storage_path``. ``--connector`` picks the KV connector (PD_CONNECTORS):
  ``shared_storage``, the article's folder (loads inside the forward); ``redis``, a redis-server the
  tour starts and stops, loaded asynchronously, so that the decode instance also stops at
  ``pd.async_wait`` and ``pd.async_ready``. The article's prompts are shorter than one 16-token
  block, so the tour puts a longer prompt first.
"""
from __future__ import annotations

import argparse
import ast
import gc
import os
import shutil
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from minivllm import steps
from minivllm.learn import then_and_now
from minivllm.metrics import speculation_summary
from minivllm.step_table import NOTES, decoded

SPEC_PROMPTS = ["one two three four five, one two three four five, one two three",
                "Hello, my name is", "The president of the United States is"]
PD_PROMPTS = ["Prefill and decode have very different performance profiles, so running them on "
              "separate instances gives tighter control over both latencies.",
              "Hello, my name is", "The president of the United States is"]
# Arrives after the first step: its prefill shares the batch with the first verify (spec.6).
LATE_PROMPT = "Prefill chunks and verify steps share one batch:"
# Token-id stand-ins for a checkpoint without a tokenizer (the tests' tiny random models).
SPEC_TOKEN_PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]]
LATE_TOKEN_PROMPT = {"prompt_token_ids": [41, 42, 43, 44, 45, 46]}
PD_TOKEN_PROMPTS = [list(range(30, 70)), [11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]]
# --method: the speculative_config beside the article's n-gram one (examples/speculative_decoding.py).
SPEC_METHODS: dict[str, Optional[dict[str, Any]]] = {
    "ngram": None,
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 3},
}
PD_CONNECTORS = ("shared_storage", "redis")


# The stops of each part in its default run (pd: the shared-storage connector, which loads inside
# the forward, so never asynchronously; ``--connector redis`` adds the async stops: pd_stops).
TOURS = {"spec": steps.GROUPS["spec"],
         "pd": tuple(i for i in steps.GROUPS["pd"] if not i.startswith("pd.async"))}


def pd_stops(connector: str) -> tuple[str, ...]:
    """The P/D stops a run over ``connector`` reaches: the async ones only where loads are async."""
    return tuple(i for i in steps.GROUPS["pd"]
                 if connector == "redis" or not i.startswith("pd.async"))


@dataclass
class Stop:
    id: str
    instance: str          # "" (spec), "prefill" or "decode"
    file: str
    line: int
    function: str


def short(value: Any, limit: int = 240) -> str:
    """``repr(value)`` (a tensor as a list), cut at ``limit`` characters."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 1) <= 2:
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _decisions(frame: Any) -> list[str]:
    """spec.7: the accept/reject decision per draft, from the tensors the sampler just used."""
    f = frame.f_locals
    records = f["self"].make_record(f["metadata"], f["sampling_metadata"], f["target_logits"],
                                    f["draft_probs"], f["target_probs"], f["target_argmax"],
                                    f["uniform_probs"], f["output"])
    lines = []
    for row, positions in enumerate(records):
        parts = []
        for p in positions:
            if p["kind"] == "bonus":
                parts.append(f"{'all accepted -> bonus' if parts else 'no drafts -> sampled'} "
                             f"{p['output_token_id']}")
                continue
            u = "greedy" if p["uniform"] is None else f"u={p['uniform']:.3f}"
            verdict = "accept" if p["accepted"] else f"reject -> recovered {p['output_token_id']}"
            parts.append(f"draft {p['draft_token_id']} p_target={p['p_target']:.3f} {u}: {verdict}")
        lines.append(f"row {row}: " + "; ".join(parts))
    return lines


def _metadata(frame: Any) -> list[str]:
    """pd.build_meta / pd.enter: the requests this step stores (is_store=True) or loads."""
    f = frame.f_locals
    meta = (f["scheduler_output"].kv_connector_metadata if "scheduler_output" in f else None)
    describe = getattr(meta, "describe", None)
    return [short(d) for d in describe()] if describe else ["(no per-request metadata)"]


def _files(frame: Any) -> list[str]:
    """pd.exit: what is in the shared storage now (one folder per prefix, a file per layer)."""
    root = getattr(frame.f_locals["connector"], "_storage_path", None)
    if not root or not os.path.isdir(root):
        return ["(no local storage)"]
    lines = []
    for name in sorted(os.listdir(root)):
        files = sorted(os.listdir(os.path.join(root, name)))
        lines.append(f"{name}/: {len(files)} files ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})")
    return lines or ["(empty: nothing long enough to store yet)"]


EXTRAS: dict[str, Callable[[Any], list[str]]] = {
    "spec.7": _decisions, "pd.build_meta": _metadata, "pd.enter": _metadata, "pd.exit": _files}


def describe_frame(step: steps.Step, frame: Any, tour: Optional["Tour"] = None) -> list[str]:
    """The lines a stop prints: where, then each of the step's ``show`` expressions and extras, then
    its note (``step_table.NOTES``: why the numbers are what they are, ids as text)."""
    path = frame.f_code.co_filename
    here = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    lines = [f"  article: {step.article}",
             f"  where:   {here}:{steps.debugger_line(step.id, frame)}  in "
             f"{frame.f_code.co_qualname}"]
    for node in ast.parse(f"({step.show},)", mode="eval").body.elts:
        expr = ast.unparse(node)
        try:
            value = short(eval(expr, frame.f_globals, frame.f_locals))
        except Exception as e:     # a value must never break the engine run
            value = f"<error: {type(e).__name__}: {e}>"
        lines.append(f"  {expr} = {value}")
    if step.id in EXTRAS:
        try:
            lines += ["  " + x for x in EXTRAS[step.id](frame)]
        except Exception as e:
            lines.append(f"  <error: {type(e).__name__}: {e}>")
    if step.id in NOTES:
        try:
            lines += ["  why: " + x for x in NOTES[step.id](frame, tour or Tour(out=sys.stdout))]
        except Exception as e:
            lines.append(f"  <error: {type(e).__name__}: {e}>")
    return lines


class Tour:
    """One tour run: the stops it reached, the instance running (P/D), the tokenizer that prints ids
    as text, and the summary printed at the end. ``hook`` is the ``sys.breakpointhook`` of the run;
    ``run_spec`` and ``run_pd`` drive the engine through the part's steps."""

    def __init__(self, mode: str = "wait", out: Any = None, then_and_now: bool = False) -> None:
        self.mode, self.out = mode, out or sys.stdout
        self.then_and_now = then_and_now
        self.instance = ""
        self.tokenizer: Any = None        # set once the engine is built: ids print as text too
        self.summary: list[str] = []      # tokens per engine step (target forward), per verify
        self.stops: list[Stop] = []
        self.armed: tuple[str, ...] = ()     # the stops this run asks for

    def hook(self, *args: Any, **kwargs: Any) -> None:
        """Installed as ``sys.breakpointhook``: the engine's ``breakpoint()`` lands here."""
        frame = sys._getframe(1)
        step = steps.current
        self.stops.append(Stop(step.id, self.instance, frame.f_code.co_filename,
                               steps.debugger_line(step.id, frame), frame.f_code.co_qualname))
        tag = f"  ({self.instance} instance)" if self.instance else ""
        print(f"\n[{len(self.stops)}]{tag}", file=self.out)
        print(step.id, file=self.out)
        print("\n".join(describe_frame(step, frame, self)), file=self.out, flush=True)
        if self.then_and_now:
            print("\n".join(then_and_now.describe(step.id)), file=self.out, flush=True)
        if self.mode == "pdb":
            import pdb
            pdb.Pdb().set_trace(frame)
        elif self.mode == "wait":
            try:
                if input("  -- Enter: next step, q: run to the end -- ").strip() == "q":
                    self.mode = "no-wait"
            except EOFError:
                self.mode = "no-wait"

    def print_prompts(self, prompts: list[Any], note: str = "") -> None:
        """The prompts, with their token ids when the tokenizer is there."""
        print(f"prompts{': ' + note if note else ''}", file=self.out)
        for i, p in enumerate(prompts):
            ids = p["prompt_token_ids"] if isinstance(p, dict) else self.tokenizer.encode(p)
            text = decoded(self.tokenizer, ids)
            print(f"  {i}: {text + ' ' if text else ''}{short(ids, 120)} ({len(ids)} tokens)",
                  file=self.out)

    def run_spec(self, model: str, max_tokens: int, temperature: Optional[float],
                 method: str = "ngram", **llm_kwargs: Any) -> list[Any]:
        """The spec part: the article's prompts, then a late one once the first drafts exist."""
        from minivllm import LLM, SamplingParams
        from minivllm.examples.speculative_decoding import sampling_params, speculative_config
        prompts, skip = _prompts(model, SPEC_PROMPTS, SPEC_TOKEN_PROMPTS)
        if temperature is None:
            temperature = sampling_params.temperature
        params = SamplingParams(temperature=temperature, top_p=sampling_params.top_p,
                                max_tokens=max_tokens)
        llm = LLM(model=model, speculative_config=SPEC_METHODS[method] or speculative_config,
                  skip_tokenizer_init=skip, break_at=steps.GROUPS["spec"], **llm_kwargs)
        self.tokenizer = None if skip else llm.get_tokenizer()
        late = LATE_TOKEN_PROMPT if skip else {"prompt_token_ids": self.tokenizer.encode(LATE_PROMPT)}
        self.print_prompts([*prompts, late], "the last one arrives once the first drafts exist, "
                           "so its prefill meets their verify in one batch (spec.6)")
        engine, finished = llm.llm_engine, {}
        requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        while engine.has_unfinished_requests() and not any(r.spec_token_ids for r in requests):
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        engine.add_request(str(len(prompts)), late, params)    # now, as the first drafts wait
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        outputs = [finished[r] for r in sorted(finished, key=int)]
        self.summary = speculation_summary(llm, outputs)
        return outputs

    def run_pd(self, model: str, max_tokens: int, temperature: Optional[float],
               connector: str = "shared_storage", **llm_kwargs: Any) -> list[Any]:
        """The P/D part: a prefill instance (max_tokens=1), then a decode instance loading its KV."""
        from minivllm import LLM, SamplingParams
        prompts, skip = _prompts(model, PD_PROMPTS, PD_TOKEN_PROMPTS)
        with ExitStack() as stack:
            ktc_p, ktc_d = _connector_configs(connector, stack)
            self.instance = "prefill"
            llm = LLM(model=model, kv_transfer_config=ktc_p, skip_tokenizer_init=skip,
                      break_at=pd_stops(connector), **llm_kwargs)
            self.tokenizer = None if skip else llm.get_tokenizer()
            self.print_prompts(prompts if skip else [{"prompt_token_ids": self.tokenizer.encode(p)}
                                                     for p in prompts],
                               "the prefill instance computes them (max_tokens=1), then the decode "
                               "instance")
            llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95, max_tokens=1), use_tqdm=False)
            del llm
            gc.collect()
            self.instance = "decode"
            llm = LLM(model=model, kv_transfer_config=ktc_d, skip_tokenizer_init=skip,
                      break_at=pd_stops(connector), **llm_kwargs)
            outputs = llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95,
                                                           max_tokens=max_tokens), use_tqdm=False)
            self.summary = [f"decode instance: {line}" for line in speculation_summary(llm, outputs)]
            del llm
            gc.collect()
            return outputs


def _prompts(model: str, texts: list[str], token_ids: list[list[int]]):
    """Text prompts, or token ids when the checkpoint has no tokenizer (skip_tokenizer_init)."""
    has_tok = not os.path.isdir(model) or any(
        os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return (texts, False) if has_tok else ([{"prompt_token_ids": t} for t in token_ids], True)


def _connector_configs(connector: str, stack: ExitStack) -> tuple[Any, Any]:
    """(prefill's, decode's) KVTransferConfig; what they need (a folder, a redis-server) is undone
    when ``stack`` closes."""
    from minivllm.config import KVTransferConfig
    if connector == "redis":
        from minivllm.distributed.kv_transfer.redis_server import RedisServer
        server = RedisServer().start()           # a child process, stopped by its PID
        stack.callback(server.stop)
        return (KVTransferConfig("RedisStoreConnector", "kv_producer", {"url": server.url}),
                KVTransferConfig("RedisStoreConnector", "kv_consumer",
                                 {"url": server.url, "load_async": True}))
    storage = tempfile.mkdtemp(prefix="minivllm_tour_storage_")
    stack.callback(shutil.rmtree, storage, ignore_errors=True)
    ktc = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both",
                           kv_connector_extra_config={"shared_storage_path": storage})
    return ktc, ktc


# The reference paths' switches, set while a ``--plain`` tour runs: plain ``F.linear`` for every
# projection, and the rejection sampler's "reference" backend (the article's rule as it reads).
REFERENCE_ENV = {"MINIVLLM_LINEAR_ROUTE": "f_linear", "MINIVLLM_REJECTION_SAMPLER": "reference"}


@contextmanager
def reference_paths(plain: bool) -> Iterator[dict[str, Any]]:
    """``LLM`` keyword arguments for the run: with ``plain``, the reference attention, plain
    ``F.linear`` and the readable rejection rule (``REFERENCE_ENV`` while the tour runs, restored
    after)."""
    if not plain:
        yield {}
        return
    previous = {name: os.environ.get(name) for name in REFERENCE_ENV}
    os.environ.update(REFERENCE_ENV)
    try:
        yield {"attention_backend": "torch"}
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run(argv: Optional[list[str]] = None, out: Any = None) -> Tour:
    parser = argparse.ArgumentParser(prog="python -m minivllm.tour", description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=sorted(TOURS), help="spec: speculative decoding; pd: P/D")
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per prompt")
    parser.add_argument("--method", choices=list(SPEC_METHODS), default="ngram",
                        help="spec: the drafter (ngram: the article's; draft_model: the target's "
                             "first layer as a self-draft; eagle: the shipped head of the default "
                             "model; suffix: suffix trees)")
    parser.add_argument("--connector", choices=list(PD_CONNECTORS), default="shared_storage",
                        help="pd: shared_storage (the article's folder) or redis (a redis-server the "
                             "tour starts; async loads: adds pd.async_wait, pd.async_ready)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="spec: override the article's 0.8 (0 = greedy; a tiny random model "
                             "repeats itself, and so gets n-gram drafts, only when greedy)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--pdb", action="store_true", help="open pdb at each step's frame")
    how.add_argument("--no-wait", action="store_true", help="run straight through")
    how.add_argument("--ide", action="store_true",
                     help="leave each breakpoint() to the debugger in charge (VS Code's debugpy, "
                          "or $PYTHONBREAKPOINT): it stops in the engine's frame")
    parser.add_argument("--then-and-now", action="store_true",
                        help="at each stop where vLLM 0.32 differs, print the article's function "
                             "beside 0.32's override (a diff of their source)")
    parser.add_argument("--plain", action="store_true",
                        help="the reference paths (attention 'torch', F.linear, the rejection "
                             "sampler's article rule): stepping in shows plain torch calls")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if args.part != "spec" and args.method != "ngram":
        parser.error("--method is for the spec tour")
    if args.part != "pd" and args.connector != "shared_storage":
        parser.error("--connector is for the pd tour")
    from minivllm.entrypoints.llm import DEFAULT_MODEL
    model = args.model or DEFAULT_MODEL
    tour = Tour("pdb" if args.pdb else "no-wait" if args.no_wait else "ide" if args.ide else "wait",
                out, then_and_now=args.then_and_now)
    out = tour.out
    stops = TOURS["spec"] if args.part == "spec" else pd_stops(args.connector)
    tour.armed = stops
    how = (f"; drafter {args.method}" if args.part == "spec" and args.method != "ngram" else
           f"; connector {args.connector}" if args.part == "pd" and args.connector != "shared_storage"
           else "")
    print(f"minivllm tour {args.part}: {len(stops)} article steps ({', '.join(stops)}){how}"
          f"{'; reference paths' if args.plain else ''}", file=out)
    if args.part == "pd" and args.connector == "shared_storage":
        print("(pd.async_wait and pd.async_ready need an asynchronous load: "
              "python -m minivllm.tour pd --connector redis)", file=out)
    previous_hook, previous_quiet = sys.breakpointhook, steps.quiet
    if tour.mode != "ide":      # --ide: at_step() prints its line, the debugger does the rest
        sys.breakpointhook, steps.quiet = tour.hook, True
    try:
        with reference_paths(args.plain) as llm_kwargs:
            outputs = (tour.run_spec(model, args.max_tokens, args.temperature, args.method,
                                     **llm_kwargs) if args.part == "spec" else
                       tour.run_pd(model, args.max_tokens, args.temperature, args.connector,
                                   **llm_kwargs))
    finally:
        sys.breakpointhook, steps.quiet = previous_hook, previous_quiet
        steps.disarm()
    print(f"\ntour done: {len(tour.stops)} stops", file=out)
    for o in outputs:
        text = o.outputs[0].text if o.outputs[0].text else o.outputs[0].token_ids
        print(f"  output: {text!r}", file=out)
    print("\n".join(tour.summary), file=out)
    return tour


def main(argv: Optional[list[str]] = None) -> int:
    tour = run(argv)
    missing = [i for i in tour.armed if i not in {s.id for s in tour.stops}]
    if missing and tour.mode != "ide":
        print(f"not reached in this run: {', '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
