"""The serving benchmark's client side (vLLM's benchmarks/benchmark_serving.py in small): a fixed-seed
workload, real streaming HTTP requests sent on schedule, and per-request metrics.

Workload: short chat requests arriving steadily (Poisson, ``chat_rate`` per second) while long
prompts (``long_tokens`` token ids each) arrive in bursts of ``burst_size`` every ``burst_every``
seconds. Each request records when every streamed chunk arrived, so TTFT (first chunk), ITL (gaps
between chunks), TPOT ((end - first chunk) / (tokens - 1)) and end-to-end latency come from the
client's clock, as a user would see them.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
import numpy as np


@dataclass
class Workload:
    duration_s: float = 60.0
    chat_rate: float = 0.7           # short chat requests per second
    chat_max_tokens: int = 32
    burst_every_s: float = 20.0
    burst_size: int = 2
    long_tokens: tuple[int, int] = (1024, 2048)
    long_max_tokens: int = 8
    seed: int = 0

    def requests(self, vocab_lo: int = 1000, vocab_hi: int = 30000) -> list[dict]:
        """(send time, kind, body) for every request, sorted by send time; fixed by ``seed``."""
        rng = random.Random(self.seed)
        out = []
        t = rng.expovariate(self.chat_rate)
        topics = ["the sea", "a red bicycle", "mountains", "coffee", "a small robot", "winter"]
        while t < self.duration_s:
            msg = f"Write one sentence about {rng.choice(topics)}."
            out.append({"t": t, "kind": "chat", "path": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": msg}],
                                 "max_tokens": self.chat_max_tokens, "temperature": 0,
                                 "ignore_eos": True}})
            t += rng.expovariate(self.chat_rate)
        b = self.burst_every_s / 2
        while b < self.duration_s:
            for _ in range(self.burst_size):
                n = rng.randint(*self.long_tokens)
                ids = [rng.randrange(vocab_lo, vocab_hi) for _ in range(n)]
                out.append({"t": b, "kind": "long", "path": "/v1/completions",
                            "body": {"prompt": ids, "max_tokens": self.long_max_tokens,
                                     "temperature": 0, "ignore_eos": True}})
            b += self.burst_every_s
        return sorted(out, key=lambda r: r["t"])


@dataclass
class RequestResult:
    kind: str
    sent: float                              # seconds since the run started
    chunk_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: Optional[str] = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.sent

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.chunk_times))

    @property
    def tpot(self) -> Optional[float]:
        if self.num_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.num_tokens - 1)


async def _one(client: httpx.AsyncClient, url: str, req: dict, t0: float,
               res: RequestResult) -> None:
    await asyncio.sleep(max(0.0, t0 + req["t"] - time.perf_counter()))
    res.sent = time.perf_counter() - t0
    body = dict(req["body"], stream=True, stream_options={"include_usage": True})
    try:
        async with client.stream("POST", url + req["path"], json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return
                if chunk.get("usage"):
                    res.num_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    text = c.get("text") or (c.get("delta") or {}).get("content")
                    if text:
                        res.chunk_times.append(time.perf_counter() - t0)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"


async def run_workload(url: str, workload: Workload) -> list[RequestResult]:
    """Send every request of ``workload`` to ``url`` on its schedule; wait for all to finish."""
    reqs = workload.requests()
    results = [RequestResult(r["kind"], r["t"]) for r in reqs]
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_one(client, url, r, t0, res) for r, res in zip(reqs, results)))
    return results


def summarize(results: list[RequestResult], ttft_slo: float, tpot_slo: float) -> dict:
    """Percentiles over the requests that finished; goodput counts the chat requests meeting both
    SLOs (TTFT <= ttft_slo, TPOT <= tpot_slo) per second of the run."""
    ok = [r for r in results if r.error is None and r.chunk_times]
    chat = [r for r in ok if r.kind == "chat"]
    long = [r for r in ok if r.kind == "long"]
    itl = [x for r in chat for x in r.itls]
    span = max(r.chunk_times[-1] for r in ok) - min(r.sent for r in ok) if ok else float("nan")

    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else float("nan")
    good = [r for r in chat if r.ttft <= ttft_slo and (r.tpot or 0.0) <= tpot_slo]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "chat_ttft_p50": pct([r.ttft for r in chat], 50),
        "chat_ttft_p99": pct([r.ttft for r in chat], 99),
        "long_ttft_p50": pct([r.ttft for r in long], 50),
        "chat_tpot_p50": pct([r.tpot for r in chat if r.tpot], 50),
        "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
        "chat_e2e_p50": pct([r.e2e for r in chat], 50),
        "output_tok_s": sum(r.num_tokens for r in ok) / span,
        "goodput_req_s": len(good) / span, "slo_attained": len(good) / max(1, len(chat)),
    }
