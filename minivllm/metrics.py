"""Metric objects returned by ``LLM.get_metrics()``, shaped like vLLM's (vllm/v1/metrics/reader.py):
counters and gauges carry ``.value``; per-position vectors carry ``.values``. Names are vLLM's
Prometheus names (``vllm:spec_decode_num_drafts`` ...) so code written against vLLM reads the same.
Loaded when someone asks for them.
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
