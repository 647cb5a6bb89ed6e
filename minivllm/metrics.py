"""Metric objects returned by ``LLM.get_metrics()``, shaped like vLLM's (vllm/v1/metrics/reader.py):
counters and gauges carry ``.value``; per-position vectors carry ``.values``. Names are vLLM's
Prometheus names (``vllm:spec_decode_num_drafts`` ...) so code written against vLLM reads the same.
``speculation_summary`` reads them back as the sentences a run prints: tokens per engine step and
per verify (vLLM logs its own summary in ``vllm/v1/spec_decode/metrics.py``, SpecDecodingLogging).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Metric:
    name: str


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int]


def get_metrics_snapshot(llm: Any) -> list[Metric]:
    """Every metric of ``llm`` (an ``LLM``) now: the scheduler's, the KV cache's, the spec-decode
    counters (with a drafter) and each connector's ``get_stats()``."""
    core = llm.llm_engine.engine_core
    sched = core.scheduler
    kv = sched.kv_cache_manager
    stats = kv.prefix_cache_stats
    metrics: list[Metric] = [
        Counter("vllm:num_preemptions", sched.num_preemptions_total),
        Counter("vllm:prefix_cache_queries", stats.queries),
        Counter("vllm:prefix_cache_hits", stats.hits),
        Gauge("vllm:kv_cache_usage_perc", kv.usage),
        Gauge("vllm:num_gpu_blocks", llm.vllm_config.cache_config.num_gpu_blocks),
    ]
    s = sched.spec_decoding_stats
    if s is not None:
        metrics += [
            Counter("vllm:spec_decode_num_drafts", s.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", s.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", s.num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos",
                   list(s.num_accepted_tokens_per_pos)),
            Gauge("minivllm:spec_decode_mean_acceptance_length", s.mean_acceptance_length),
        ]
    for connector in (sched.connector, core.worker.kv_connector):
        if connector is not None and hasattr(connector, "get_stats"):
            role = "scheduler" if connector is sched.connector else "worker"
            for name, value in connector.get_stats().items():
                metrics.append(Counter(f"minivllm:kv_connector_{role}_{name}", value))
    return metrics


def speculation_summary(llm: Any, outputs: list[Any]) -> list[str]:
    """The numbers speculation changes, from the engine's counters: output tokens per engine step
    (one target forward over the batch), and tokens per verify (``vllm:spec_decode_*``)."""
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = llm.llm_engine.engine_core.step_index
    lines = [f"{n} output tokens in {steps} engine steps (one target forward each, over the batch)"]
    verifies = metrics.get("vllm:spec_decode_num_drafts")
    if verifies:
        accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
        lines.append(f"{verifies} verify steps: {accepted} of "
                     f"{metrics['vllm:spec_decode_num_draft_tokens']} drafts accepted, so a verify "
                     f"emitted 1 + {accepted}/{verifies} = {1 + accepted / verifies:.2f} tokens of its "
                     "request for one forward (plain decoding: 1)")
    return lines
