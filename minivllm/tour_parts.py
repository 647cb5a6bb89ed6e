"""The runs the tour stops in (``python -m minivllm.tour``; tour.py prints each stop): the article's
examples, set up so that every step of a part happens.

- ``spec``: the article's n-gram example (same prompts, ``temperature=0.8, top_p=0.95``, k=3), plus
  one self-repeating prompt so that the drafter finds a match right after the prefill, and one that
  arrives once those drafts exist, so that a prefill meets a verify at ``spec.6``. ``--method``
  swaps the drafter (SPEC_METHODS): ``draft_model`` (a self-draft: the target's first layers) and
  ``eagle`` (the shipped head) run a forward of their own after the target's and write KV for their
  drafts, so the scheduler reserves ``num_lookahead_tokens = k`` slots (``spec.4``); ``suffix``
  drafts from suffix trees (``spec.2`` prints the match).
- ``pd``: the article's prefill and decode instances, one after the other in this process (the
  article's ``prefill_done`` event becomes "the prefill run returned"). ``--connector`` picks the
  KV connector (PD_CONNECTORS): ``shared_storage``, the article's folder (loads inside the forward);
  ``redis``, a redis-server the tour starts and stops, loaded asynchronously, so that the decode
  instance also stops at ``pd.async_wait`` and ``pd.async_ready``.
"""
from __future__ import annotations

import gc
import shutil
import tempfile
from contextlib import ExitStack
from typing import Any, Optional, Protocol, TextIO

from minivllm import steps
from minivllm.tour_notes import decoded, short, speculation_summary



class Tour(Protocol):
    """What the runs read and set on tour.py's ``Tour`` (named here, not imported: no circle)."""
    out: TextIO
    tokenizer: Any
    instance: str
    summary: list[str]

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


def pd_stops(connector: str) -> tuple[str, ...]:
    """The P/D stops a run over ``connector`` reaches: the async ones only where loads are async."""
    return tuple(i for i in steps.GROUPS["pd"]
                 if connector == "redis" or not i.startswith("pd.async"))


def _prompts(model: str, texts: list[str], token_ids: list[list[int]]):
    """Text prompts, or token ids when the checkpoint has no tokenizer (skip_tokenizer_init)."""
    import os
    has_tok = not os.path.isdir(model) or any(
        os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return (texts, False) if has_tok else ([{"prompt_token_ids": t} for t in token_ids], True)


def _print_prompts(tour: "Tour", prompts: list[Any], note: str = "") -> None:
    """The prompts, with their token ids when the tokenizer is there."""
    print(f"prompts{': ' + note if note else ''}", file=tour.out)
    for i, p in enumerate(prompts):
        ids = p["prompt_token_ids"] if isinstance(p, dict) else tour.tokenizer.encode(p)
        text = decoded(tour.tokenizer, ids)
        print(f"  {i}: {text + ' ' if text else ''}{short(ids, 120)} ({len(ids)} tokens)",
              file=tour.out)


def run_spec(tour: "Tour", model: str, max_tokens: int, temperature: Optional[float],
             method: str = "ngram", **llm_kwargs: Any) -> list[Any]:
    from minivllm import LLM, SamplingParams
    from minivllm.examples.speculative_decoding import sampling_params, speculative_config
    prompts, skip = _prompts(model, SPEC_PROMPTS, SPEC_TOKEN_PROMPTS)
    if temperature is None:
        temperature = sampling_params.temperature
    params = SamplingParams(temperature=temperature, top_p=sampling_params.top_p,
                            max_tokens=max_tokens)
    llm = LLM(model=model, speculative_config=SPEC_METHODS[method] or speculative_config,
              skip_tokenizer_init=skip, break_at=steps.GROUPS["spec"], **llm_kwargs)
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


def _connector_configs(connector: str, stack: ExitStack) -> tuple[Any, Any]:
    """(prefill's, decode's) KVTransferConfig; what they need (a folder, a redis-server) is undone
    when ``stack`` closes."""
    from minivllm.config import KVTransferConfig
    if connector == "redis":
        from minivllm.kvstore import RedisServer
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


def run_pd(tour: "Tour", model: str, max_tokens: int, temperature: Optional[float],
           connector: str = "shared_storage", **llm_kwargs: Any) -> list[Any]:
    from minivllm import LLM, SamplingParams
    prompts, skip = _prompts(model, PD_PROMPTS, PD_TOKEN_PROMPTS)
    with ExitStack() as stack:
        ktc_p, ktc_d = _connector_configs(connector, stack)
        tour.instance = "prefill"
        llm = LLM(model=model, kv_transfer_config=ktc_p, skip_tokenizer_init=skip,
                  break_at=pd_stops(connector), **llm_kwargs)
        tour.tokenizer = None if skip else llm.get_tokenizer()
        _print_prompts(tour, prompts if skip else [{"prompt_token_ids": tour.tokenizer.encode(p)}
                                                   for p in prompts],
                       "the prefill instance computes them (max_tokens=1), then the decode instance")
        llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95, max_tokens=1), use_tqdm=False)
        del llm
        gc.collect()
        tour.instance = "decode"
        llm = LLM(model=model, kv_transfer_config=ktc_d, skip_tokenizer_init=skip,
                  break_at=pd_stops(connector), **llm_kwargs)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, top_p=0.95,
                                                       max_tokens=max_tokens), use_tqdm=False)
        tour.summary = [f"decode instance: {line}" for line in speculation_summary(llm, outputs)]
        del llm
        gc.collect()
        return outputs
