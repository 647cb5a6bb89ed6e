"""A guided walk through the article's steps: ``python -m minivllm.tour spec|pd [--pdb] [--no-wait]``.

The tour runs the article's example (``minivllm/examples/``) with every step of that part armed as a
breakpoint (``minivllm/steps.py``) and replaces ``sys.breakpointhook`` for the run: at each stop it
prints the step id on its own line, the article's sentence in our words, ``file:line`` and function,
and the values that matter there, read from the engine's live frame; then it waits for Enter.
``--pdb`` opens pdb in that frame instead (``c`` goes on to the next step); ``--no-wait`` runs
straight through (CI); ``--ide`` leaves ``breakpoint()`` to the debugger already in charge (VS Code's
debugpy stops in the engine's frame). ``--plain`` runs the forward on the reference paths (attention
``"torch"``, ``F.linear`` for every projection), so that stepping into the model shows plain torch
calls, and verifies with the article's rule as it reads (the rejection sampler's "reference"
backend, sample/rejection_reference.py); by default it runs the CPU's fast paths and vLLM's
exponential race, as ``LLM()`` does.

- ``spec``: the article's n-gram example (same prompts, ``temperature=0.8, top_p=0.95``, k=3), plus
  one self-repeating prompt so that the n-gram drafter finds a match right after the prefill, and
  one that arrives once those drafts exist, so that a prefill meets a verify at ``spec.6``.

Each stop also prints notes (``tour_notes.py``): why the numbers are what they are, ids as text.
- ``pd``: the article's prefill and decode instances, one after the other in this process (the
  article's ``prefill_done`` event becomes "the prefill run returned"), sharing a temporary
  ``shared_storage_path``. The article's prompts are shorter than one 16-token block, so nothing
  would move: the tour puts a longer prompt first.
"""
from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from minivllm import steps
from minivllm.tour_notes import decoded, speculation_summary

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
TOURS = {"spec": steps.GROUPS["spec"],
         "pd": tuple(i for i in steps.GROUPS["pd"] if not i.startswith("pd.async"))}


@dataclass
class Stop:
    id: str
    instance: str          # "" (spec), "prefill" or "decode"
    file: str
    line: int
    function: str


def _short(value: Any, limit: int = 240) -> str:
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
    return [_short(d) for d in describe()] if describe else ["(no per-request metadata)"]


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
    the notes (``tour_notes.py``: why the numbers are what they are, ids as text)."""
    path = frame.f_code.co_filename
    here = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    lines = [f"  article: {step.article}",
             f"  where:   {here}:{frame.f_lineno}  in {frame.f_code.co_qualname}"]
    for node in ast.parse(f"({step.show},)", mode="eval").body.elts:
        expr = ast.unparse(node)
        try:
            value = _short(eval(expr, frame.f_globals, frame.f_locals))
        except Exception as e:     # a value must never break the engine run
            value = f"<error: {type(e).__name__}: {e}>"
        lines.append(f"  {expr} = {value}")
    if step.id in EXTRAS:
        try:
            lines += ["  " + x for x in EXTRAS[step.id](frame)]
        except Exception as e:
            lines.append(f"  <error: {type(e).__name__}: {e}>")
    from minivllm.tour_notes import NOTES
    if step.id in NOTES:
        try:
            lines += ["  why: " + x for x in NOTES[step.id](frame, tour or Tour(out=sys.stdout))]
        except Exception as e:
            lines.append(f"  <error: {type(e).__name__}: {e}>")
    return lines


class Tour:
    def __init__(self, mode: str = "wait", out: Any = None, then_and_now: bool = False) -> None:
        self.mode, self.out = mode, out or sys.stdout
        self.then_and_now = then_and_now
        self.instance = ""
        self.tokenizer: Any = None        # set once the engine is built: ids print as text too
        self.summary: list[str] = []      # tokens per engine step (target forward), per verify
        self.stops: list[Stop] = []

    def hook(self, *args: Any, **kwargs: Any) -> None:
        """Installed as ``sys.breakpointhook``: the engine's ``breakpoint()`` lands here."""
        frame = sys._getframe(1)
        step = steps.current
        self.stops.append(Stop(step.id, self.instance, frame.f_code.co_filename, frame.f_lineno,
                               frame.f_code.co_qualname))
        tag = f"  ({self.instance} instance)" if self.instance else ""
        print(f"\n[{len(self.stops)}]{tag}", file=self.out)
        print(step.id, file=self.out)
        print("\n".join(describe_frame(step, frame, self)), file=self.out, flush=True)
        if self.then_and_now:
            from minivllm import then_and_now
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


def _prompts(model: str, texts: list[str], token_ids: list[list[int]]):
    """Text prompts, or token ids when the checkpoint has no tokenizer (skip_tokenizer_init)."""
    has_tok = not os.path.isdir(model) or any(
        os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return (texts, False) if has_tok else ([{"prompt_token_ids": t} for t in token_ids], True)


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


def run_spec(tour: Tour, model: str, max_tokens: int, temperature: Optional[float],
             **llm_kwargs: Any) -> list[Any]:
    from minivllm import LLM, SamplingParams
    from minivllm.examples.speculative_decoding import sampling_params, speculative_config
    prompts, skip = _prompts(model, SPEC_PROMPTS, SPEC_TOKEN_PROMPTS)
    if temperature is None:
        temperature = sampling_params.temperature
    params = SamplingParams(temperature=temperature, top_p=sampling_params.top_p,
                            max_tokens=max_tokens)
    llm = LLM(model=model, speculative_config=speculative_config, skip_tokenizer_init=skip,
              break_at=TOURS["spec"], **llm_kwargs)
    tour.tokenizer = None if skip else llm.get_tokenizer()
    late = LATE_TOKEN_PROMPT if skip else {"prompt_token_ids": tour.tokenizer.encode(LATE_PROMPT)}
    _print_prompts(tour, [*prompts, late], "the last one arrives once the first drafts exist, so "
                   "its prefill meets their verify in one batch (spec.6)")
    engine, finished = llm.llm_engine, {}
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests() and not any(r.spec_token_ids for r in requests):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    engine.add_request(str(len(prompts)), late, params)    # now, as the first drafts wait
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    outputs = [finished[r] for r in sorted(finished, key=int)]
    tour.summary = speculation_summary(llm, outputs)
    return outputs


def _print_prompts(tour: Tour, prompts: list[Any], note: str = "") -> None:
    """The prompts, with their token ids when the tokenizer is there."""
    print(f"prompts{': ' + note if note else ''}", file=tour.out)
    for i, p in enumerate(prompts):
        ids = p["prompt_token_ids"] if isinstance(p, dict) else tour.tokenizer.encode(p)
        text = decoded(tour.tokenizer, ids)
        print(f"  {i}: {text + ' ' if text else ''}{_short(ids, 120)} ({len(ids)} tokens)", file=tour.out)


def run_pd(tour: Tour, model: str, max_tokens: int, temperature: Optional[float],
           **llm_kwargs: Any) -> list[Any]:
    import gc
    from minivllm import LLM, SamplingParams
    from minivllm.config import KVTransferConfig
    prompts, skip = _prompts(model, PD_PROMPTS, PD_TOKEN_PROMPTS)
    storage = tempfile.mkdtemp(prefix="minivllm_tour_storage_")
    ktc = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both",
                           kv_connector_extra_config={"shared_storage_path": storage})
    try:
        tour.instance = "prefill"
        llm = LLM(model=model, kv_transfer_config=ktc, skip_tokenizer_init=skip, break_at=TOURS["pd"],
                  **llm_kwargs)
        tour.tokenizer = None if skip else llm.get_tokenizer()
        _print_prompts(tour, prompts if skip else [{"prompt_token_ids": tour.tokenizer.encode(p)}
                                                   for p in prompts],
                       "the prefill instance computes them (max_tokens=1), then the decode instance")
        llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95, max_tokens=1), use_tqdm=False)
        del llm
        gc.collect()
        tour.instance = "decode"
        llm = LLM(model=model, kv_transfer_config=ktc, skip_tokenizer_init=skip, break_at=TOURS["pd"],
                  **llm_kwargs)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95,
                                                       max_tokens=max_tokens), use_tqdm=False)
        tour.summary = [f"decode instance: {line}" for line in speculation_summary(llm, outputs)]
        return outputs
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def run(argv: Optional[list[str]] = None, out: Any = None) -> Tour:
    parser = argparse.ArgumentParser(prog="python -m minivllm.tour", description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=sorted(TOURS), help="spec: speculative decoding; pd: P/D")
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per prompt")
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
    from minivllm.entrypoints.llm import DEFAULT_MODEL
    model = args.model or DEFAULT_MODEL
    tour = Tour("pdb" if args.pdb else "no-wait" if args.no_wait else "ide" if args.ide else "wait",
                out, then_and_now=args.then_and_now)
    out = tour.out
    print(f"minivllm tour {args.part}: {len(TOURS[args.part])} article steps "
          f"({', '.join(TOURS[args.part])}){'; reference paths' if args.plain else ''}", file=out)
    previous_hook, previous_quiet = sys.breakpointhook, steps.quiet
    if tour.mode != "ide":      # --ide: at_step() prints its line, the debugger does the rest
        sys.breakpointhook, steps.quiet = tour.hook, True
    try:
        with reference_paths(args.plain) as llm_kwargs:
            outputs = (run_spec if args.part == "spec" else run_pd)(
                tour, model, args.max_tokens, args.temperature, **llm_kwargs)
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
    part = (argv or sys.argv[1:])[0] if (argv or sys.argv[1:]) else ""
    missing = [i for i in TOURS.get(part, ()) if i not in {s.id for s in tour.stops}]
    if missing and tour.mode != "ide":
        print(f"not reached in this run: {', '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
