"""The async effect of ``python -m minivllm.bench pd``: a decode instance runs ``n`` requests that
are already decoding (one token each per engine step, so a step's wall time is their inter-token
latency, ITL); then a long prompt arrives whose KV is in Redis. With a synchronous load the step
that schedules it waits for the whole fetch; with vLLM's asynchronous path the request waits in
``WAITING_FOR_REMOTE_KVS`` while a worker thread fetches, and the decoding requests keep their pace.

Reported per mode: the median steady ITL before the long prompt arrives, the worst ITL from its
arrival until its first token, their ratio, and the long prompt's time to first token.
"""
from __future__ import annotations

import random
import statistics
import time


def _measure(d, prompts: list[list[int]], long_ids: list[int], steady_steps: int = 12) -> dict:
    from minivllm import SamplingParams
    engine = d.llm_engine
    for i, ids in enumerate(prompts):
        engine.add_request(f"dec{i}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
    decoders = [engine._requests[f"dec{i}"] for i in range(len(prompts))]
    while min(r.num_output_tokens for r in decoders) < 3:     # every prefill done
        engine.step()

    def timed_step() -> float:
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0
    steady = [timed_step() for _ in range(steady_steps)]
    t_arrive = time.perf_counter()
    engine.add_request("long", {"prompt_token_ids": long_ids},
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    long_req = engine._requests["long"]
    during = []
    while long_req.num_output_tokens == 0 and len(during) < 1000:
        during.append(timed_step())
    ttft = time.perf_counter() - t_arrive
    engine.abort_request([f"dec{i}" for i in range(len(prompts))] + ["long"])
    return dict(steady_itl=statistics.median(steady), max_itl=max(during), steps=len(during), ttft=ttft,
                loaded_tokens=long_req.num_external_computed_tokens)


def run_itl(model: str, url: str, prompt_len: int, n_decoders: int, block_size: int, device: str,
            dtype: str) -> dict[str, dict]:
    from minivllm import LLM, SamplingParams
    from minivllm.config import KVTransferConfig

    def rtc(role: str, load_async: bool = True) -> KVTransferConfig:
        return KVTransferConfig("RedisStoreConnector", role, {"url": url, "load_async": load_async})
    blocks = -(-(prompt_len + 1) // block_size) + n_decoders * 24 + 8
    common = dict(model=model, block_size=block_size, enable_prefix_caching=False, skip_tokenizer_init=True,
                  num_gpu_blocks_override=blocks, device=device, dtype=dtype)
    rng = random.Random(1)
    p = LLM(kv_transfer_config=rtc("kv_producer"), **common)
    vocab = p.vllm_config.hf_config.vocab_size
    fresh = lambda n: [rng.randrange(min(100, vocab // 2), vocab) for _ in range(n)]  # noqa: E731
    results: dict = {}
    for mode, load_async in (("sync", False), ("async", True)):
        long_ids = fresh(prompt_len)
        p.generate([{"prompt_token_ids": long_ids}], SamplingParams(temperature=0, max_tokens=1),
                   use_tqdm=False)
        d = LLM(kv_transfer_config=rtc("kv_consumer", load_async), **common)
        d.generate([{"prompt_token_ids": fresh(3 * block_size)}], SamplingParams(max_tokens=2), use_tqdm=False)
        results[mode] = _measure(d, [fresh(32) for _ in range(n_decoders)], long_ids)
        del d
    return {**results, "prompt_len": prompt_len, "n_decoders": n_decoders}


def print_itl(res: dict) -> None:
    print(f"\nAsync effect: {res['n_decoders']} requests decoding while a {res['prompt_len']}-token "
          "prompt's KV loads from Redis (ITL = one engine step)\n")
    head = ("load", "steady ITL ms", "max ITL during load ms", "stall (max/steady)", "steps",
            "long prompt TTFT s", "loaded tokens")
    print(" | ".join(head))
    print("-|-".join("-" * len(h) for h in head))
    for mode in ("sync", "async"):
        r = res[mode]
        cells = (mode, f"{r['steady_itl'] * 1e3:.1f}", f"{r['max_itl'] * 1e3:.1f}",
                 f"{r['max_itl'] / r['steady_itl']:.2f}x", r["steps"], f"{r['ttft']:.3f}", r["loaded_tokens"])
        print(" | ".join(str(c).rjust(len(h)) for c, h in zip(cells, head)))
