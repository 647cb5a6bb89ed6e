"""``python -m minivllm.bench pd``: disaggregated P/D, time to first token on the decode instance
with the prompt's KV loaded from ``SharedStorageConnector`` and from ``RedisStoreConnector`` (a
real redis-server; synchronous and asynchronous loads) and pulled from P's blocks by
``ZmqPullConnector`` (vLLM's NixlConnector flow over a ZeroMQ side channel) against recomputing it;
then the async effect: the inter-token latency of requests already decoding while a long prompt's KV loads.

Three instances of one model in this process, prefix caching off so that nothing is reused
locally: P (``kv_producer``) prefills each prompt with ``max_tokens=1`` and stores its KV; D-load
(``kv_consumer``) then runs the same prompt and loads all whole blocks below the last token;
D-recompute (no connector) runs it from scratch. The same with a Redis P and two Redis Ds, and
with a pull P (which holds the prompt's blocks until D has read them) and a pull D. Every prompt is fresh random token ids, every
instance is warmed up first, and the first tokens of the three runs must agree (a sanity check of
what is being timed). Ratios from one run are what count; absolute times vary by machine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Optional

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _timed(llm, prompt_ids: list[int]) -> tuple[float, int]:
    from minivllm import SamplingParams
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt_ids}],
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0, out[0].outputs[0].token_ids[0]


def _timed_pull(p, d, prompt_ids: list[int]) -> tuple[float, int, int]:
    """P prefills with ``do_remote_decode``; D's TTFT includes the whole pull; then P is stepped
    until it freed the held blocks (on D's "done")."""
    from minivllm import SamplingParams

    def params(kv: dict) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                              extra_args={"kv_transfer_params": kv})
    prompt = [{"prompt_token_ids": prompt_ids}]
    out_p = p.generate(prompt, params({"do_remote_decode": True}), use_tqdm=False)[0]
    t0 = time.perf_counter()
    out_d = d.generate(prompt, params(out_p.kv_transfer_params), use_tqdm=False)[0]
    t = time.perf_counter() - t0
    deadline = time.monotonic() + 30
    while p.llm_engine.has_requests() and time.monotonic() < deadline:
        p.llm_engine.step()
    return t, out_p.outputs[0].token_ids[0], out_d.outputs[0].token_ids[0]


def _stats(llm) -> dict:
    return dict(llm.llm_engine.engine_core.worker.kv_connector.get_stats())


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def run(model: str, lengths: list[int], repeats: int, block_size: int, device: str, dtype: str,
        layerwise: bool, storage: str, redis_url: Optional[str] = None,
        pull: bool = True) -> list[dict]:
    import random

    from minivllm import LLM
    from minivllm.config import KVTransferConfig

    def ktc(role: str) -> KVTransferConfig:
        return KVTransferConfig("SharedStorageConnector", role,
                                {"shared_storage_path": storage, "layerwise": layerwise})

    def rtc(role: str, load_async: bool = True) -> KVTransferConfig:
        return KVTransferConfig("RedisStoreConnector", role, {"url": redis_url, "load_async": load_async})
    blocks = -(-(max(lengths) + 1) // block_size) + 2
    common = dict(model=model, block_size=block_size, enable_prefix_caching=False,
                  skip_tokenizer_init=True, num_gpu_blocks_override=blocks, device=device, dtype=dtype)
    p = LLM(kv_transfer_config=ktc("kv_producer"), **common)
    d_load = LLM(kv_transfer_config=ktc("kv_consumer"), **common)
    d_rec = LLM(**common)
    redis_ps = []
    if redis_url is not None:
        redis_ps = [LLM(kv_transfer_config=rtc("kv_producer"), **common),
                    LLM(kv_transfer_config=rtc("kv_consumer", False), **common),
                    LLM(kv_transfer_config=rtc("kv_consumer", True), **common)]
    pull_ps = []
    if pull:
        pull_ps = [LLM(kv_transfer_config=KVTransferConfig("ZmqPullConnector", role), **common)
                   for role in ("kv_producer", "kv_consumer")]
    vocab = p.vllm_config.hf_config.vocab_size
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        # Skip the low ids, where small vocabularies keep their special tokens.
        return [rng.randrange(min(100, vocab // 2), vocab) for _ in range(n)]
    warm = fresh(2 * block_size + 1)
    for llm in (p, d_load, d_rec, *redis_ps):
        _timed(llm, warm)
    if pull_ps:
        _timed_pull(*pull_ps, warm)

    rows = []
    for n in lengths:
        for _ in range(repeats):
            ids = fresh(n)
            p0, d0 = _stats(p), _stats(d_load)
            t_p, tok_p = _timed(p, ids)
            t_load, tok_load = _timed(d_load, ids)
            t_rec, tok_rec = _timed(d_rec, ids)
            stored, loaded = _delta(_stats(p), p0), _delta(_stats(d_load), d0)
            extra, firsts = {}, [tok_p, tok_load, tok_rec]
            if redis_ps:
                rp, r_sync, r_async = redis_ps
                rp0, rs0, ra0 = _stats(rp), _stats(r_sync), _stats(r_async)
                _, tok_rp = _timed(rp, ids)
                t_sync, tok_sync = _timed(r_sync, ids)
                t_async, tok_async = _timed(r_async, ids)
                firsts += [tok_rp, tok_sync, tok_async]
                r_stored = _delta(_stats(rp), rp0)
                r_loaded = [_delta(_stats(r_sync), rs0), _delta(_stats(r_async), ra0)]
                extra = dict(
                    ttft_redis_sync=t_sync, ttft_redis_async=t_async,
                    redis_loaded_tokens=[x["num_loaded_tokens"] for x in r_loaded],
                    redis_store_mb_s=r_stored["num_stored_bytes"] / 2**20 / max(r_stored["save_time_s"], 1e-9),
                    redis_load_mb_s=sum(x["num_loaded_bytes"] for x in r_loaded) / 2**20
                    / max(sum(x["load_time_s"] for x in r_loaded), 1e-9))
            if pull_ps:
                pd0 = _stats(pull_ps[1])
                t_pull, tok_pp, tok_pd = _timed_pull(*pull_ps, ids)
                firsts += [tok_pp, tok_pd]
                pulled = _delta(_stats(pull_ps[1]), pd0)
                extra.update(ttft_pull=t_pull, pull_loaded_tokens=pulled["num_loaded_tokens"],
                             pull_mb_s=pulled["num_loaded_bytes"] / 2**20
                             / max(pulled["load_time_s"], 1e-9))
            rows.append(dict(
                prompt_tokens=n, loaded_tokens=loaded["num_loaded_tokens"], ttft_prefill_store=t_p,
                ttft_load=t_load, ttft_recompute=t_rec,
                stored_bytes=stored["num_stored_bytes"],
                bytes_per_token=stored["num_stored_bytes"] / max(stored["num_stored_tokens"], 1),
                load_mb_s=loaded["num_loaded_bytes"] / 2**20 / max(loaded["load_time_s"], 1e-9),
                same_first_token=len(set(firsts)) == 1, **extra))
    return rows


def print_table(rows: list[dict]) -> None:
    head = ("prompt", "loaded", "P prefill+store s", "D TTFT load s", "D TTFT recompute s",
            "speedup", "stored MiB", "bytes/token", "load MiB/s", "same 1st token")
    print(" | ".join(head))
    print("-|-".join("-" * len(h) for h in head))
    for r in rows:
        cells: tuple = (r["prompt_tokens"], r["loaded_tokens"], f"{r['ttft_prefill_store']:.3f}",
                 f"{r['ttft_load']:.3f}", f"{r['ttft_recompute']:.3f}",
                 f"{r['ttft_recompute'] / r['ttft_load']:.2f}x",
                 f"{r['stored_bytes'] / 2**20:.2f}", f"{r['bytes_per_token']:.0f}",
                 f"{r['load_mb_s']:.0f}", "yes" if r["same_first_token"] else "NO")
        print(" | ".join(str(c).rjust(len(h)) for c, h in zip(cells, head)))
    if rows and "ttft_redis_sync" in rows[0]:
        head = ("prompt", "D TTFT recompute s", "Redis sync s", "Redis async s", "sync/recompute",
                "async/recompute", "Redis load MiB/s", "Redis store MiB/s")
        print("\n" + " | ".join(head))
        print("-|-".join("-" * len(h) for h in head))
        for r in rows:
            cells = (r["prompt_tokens"], f"{r['ttft_recompute']:.3f}", f"{r['ttft_redis_sync']:.3f}",
                     f"{r['ttft_redis_async']:.3f}", f"{r['ttft_redis_sync'] / r['ttft_recompute']:.2f}x",
                     f"{r['ttft_redis_async'] / r['ttft_recompute']:.2f}x", f"{r['redis_load_mb_s']:.0f}",
                     f"{r['redis_store_mb_s']:.0f}")
            print(" | ".join(str(c).rjust(len(h)) for c, h in zip(cells, head)))


def print_pull_table(rows: list[dict]) -> None:
    head = ("prompt", "D TTFT recompute s", "SharedStorage s", "Redis async s", "pull s",
            "pull/recompute", "pull/Redis", "pulled", "pull MiB/s")
    print("\n" + " | ".join(head))
    print("-|-".join("-" * len(h) for h in head))
    for r in rows:
        redis = r.get("ttft_redis_async")
        cells = (r["prompt_tokens"], f"{r['ttft_recompute']:.3f}", f"{r['ttft_load']:.3f}",
                 f"{redis:.3f}" if redis else "-", f"{r['ttft_pull']:.3f}",
                 f"{r['ttft_pull'] / r['ttft_recompute']:.2f}x",
                 f"{r['ttft_pull'] / redis:.2f}x" if redis else "-", r["pull_loaded_tokens"],
                 f"{r['pull_mb_s']:.0f}")
        print(" | ".join(str(c).rjust(len(h)) for c, h in zip(cells, head)))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench pd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--lengths", default="256,1024,2048",
                    help="comma-separated prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--layerwise", action="store_true", help="load layer by layer")
    ap.add_argument("--storage", default=None, help="shared_storage_path (default: a temp dir)")
    ap.add_argument("--redis-url", default=None,
                    help="RedisStoreConnector url (default: start a redis-server for the run)")
    ap.add_argument("--no-redis", action="store_true", help="no RedisStoreConnector columns")
    ap.add_argument("--no-pull", action="store_true", help="no ZmqPullConnector column")
    ap.add_argument("--itl-prompt", type=int, default=None,
                    help="async effect: tokens of the prompt whose KV loads (default: the longest "
                         "of --lengths; 0: skip)")
    ap.add_argument("--itl-decoders", type=int, default=4, help="async effect: requests decoding meanwhile")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if not lengths or min(lengths) <= args.block_size:
        ap.error(f"--lengths must all exceed the block size ({args.block_size}): only whole "
                 "blocks below the last prompt token are transferred")
    storage = args.storage or tempfile.mkdtemp(prefix="minivllm-pd-")
    server, url = None, args.redis_url
    if url is None and not args.no_redis:
        from minivllm.distributed.kv_transfer.redis_server import RedisServer
        server = RedisServer().start()
        url = server.url
    try:
        rows = run(args.model, lengths, args.repeats, args.block_size, args.device, args.dtype,
                   args.layerwise, storage, url, pull=not args.no_pull)
        itl = None
        itl_prompt = max(lengths) if args.itl_prompt is None else args.itl_prompt
        if url is not None and itl_prompt:
            from minivllm.bench.pd_itl import print_itl, run_itl
            itl = run_itl(args.model, url, itl_prompt, args.itl_decoders, args.block_size,
                          args.device, args.dtype)
    finally:
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)
        if server is not None:
            server.stop()
    print(f"\nP/D time to first token, {os.path.basename(args.model.rstrip('/'))}, block size "
          f"{args.block_size}{', layerwise' if args.layerwise else ''}; one run, ratios are what count\n")
    print_table(rows)
    if rows and "ttft_pull" in rows[0]:
        print_pull_table(rows)
    if itl is not None:
        print_itl(itl)
    return rows


if __name__ == "__main__":
    main()
