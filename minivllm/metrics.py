"""Metric objects returned by ``LLM.get_metrics()``, shaped like vLLM's (vllm/v1/metrics/reader.py):
counters and gauges carry ``.value``; per-position vectors carry ``.values``. Names are vLLM's
Prometheus names (``vllm:spec_decode_num_drafts`` ...) so code written against vLLM reads the same."""
from __future__ import annotations

from dataclasses import dataclass


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
