"""``GET /metrics``: Prometheus text with vLLM's metric names (vllm/v1/metrics/loggers.py,
``PrometheusStatLogger``), written by hand so that the format is visible: ``# TYPE`` lines,
counters ending in ``_total``, histograms as cumulative ``_bucket{le=...}`` plus ``_sum`` and
``_count``. Every sample carries ``model_name``, as in vLLM.
"""
from __future__ import annotations

from minivllm.engine.async_llm import AsyncLLM, Histogram
from minivllm.metrics import Counter, Gauge, Vector


def _fmt(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def render_metrics(async_llm: AsyncLLM, model_name: str) -> str:
    label = f'model_name="{model_name}"'
    lines: list[str] = []

    def gauge(name: str, value: float, help_text: str) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                      f"{name}{{{label}}} {_fmt(value)}"])

    def counter(name: str, value: float, help_text: str, extra: str = "") -> None:
        lines.extend([f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter",
                      f"{name}_total{{{label}{extra}}} {_fmt(value)}"])

    def histogram(name: str, h: Histogram, help_text: str) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} histogram"])
        cumulative = 0
        counts = h.counts or [0] * len(h.buckets)
        for edge, n in zip(h.buckets, counts):
            cumulative += n
            lines.append(f'{name}_bucket{{{label},le="{edge}"}} {cumulative}')
        lines.append(f'{name}_bucket{{{label},le="+Inf"}} {h.count}')
        lines.append(f"{name}_sum{{{label}}} {_fmt(h.sum)}")
        lines.append(f"{name}_count{{{label}}} {h.count}")

    sched = async_llm.engine.scheduler
    stats = async_llm.stats
    gauge("vllm:num_requests_running", len(sched.running), "Requests in the running batch.")
    gauge("vllm:num_requests_waiting", len(sched.waiting) + len(sched.kv_holding_waiting),
          "Requests waiting to be scheduled.")
    counter("vllm:prompt_tokens", stats.prompt_tokens, "Prompt tokens of started requests.")
    counter("vllm:generation_tokens", stats.generation_tokens, "Generated tokens.")
    for reason, n in sorted(stats.finished.items()):
        counter("vllm:request_success", n, "Finished requests by finish reason.",
                extra=f',finished_reason="{reason}"')
    histogram("vllm:time_to_first_token_seconds", stats.ttft, "Time to first token (server side).")
    histogram("vllm:inter_token_latency_seconds", stats.itl, "Time between engine outputs.")
    histogram("vllm:e2e_request_latency_seconds", stats.e2e, "Arrival to finish.")
    # Everything LLM.get_metrics() reports: KV usage, prefix cache, spec decode, the connector.
    for m in async_llm.llm.get_metrics():
        if m.name == "vllm:kv_cache_usage_perc":
            gauge(m.name, m.value, "Fraction of KV-cache blocks in use (1 = 100%).")
        elif isinstance(m, Gauge):
            gauge(m.name, m.value, "See LLM.get_metrics().")
        elif isinstance(m, Counter):
            counter(m.name, m.value, "See LLM.get_metrics().")
        elif isinstance(m, Vector):
            name = m.name
            lines.extend([f"# HELP {name}_total See LLM.get_metrics().",
                          f"# TYPE {name}_total counter"])
            for pos, v in enumerate(m.values):
                lines.append(f'{name}_total{{{label},position="{pos}"}} {v}')
    return "\n".join(lines) + "\n"
