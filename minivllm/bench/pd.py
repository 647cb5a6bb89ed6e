"""``python -m minivllm.bench pd``: disaggregated P/D, time to first token on the decode instance
with the prompt's KV loaded from ``SharedStorageConnector`` against recomputing it.

Three instances of one model in this process, prefix caching off so that nothing is reused
locally: P (``kv_producer``) prefills each prompt with ``max_tokens=1`` and stores its KV; D-load
(``kv_consumer``) then runs the same prompt and loads all whole blocks below the last token;
D-recompute (no connector) runs it from scratch. Every prompt is fresh random token ids, every
instance is warmed up first, and the first tokens of the three runs must agree (a sanity check of
what is being timed). Ratios from one run are what count; absolute times vary by machine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _timed(llm, prompt_ids: list[int]) -> tuple[float, int]:
    from minivllm import SamplingParams
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt_ids}],
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0, out[0].outputs[0].token_ids[0]


def _stats(llm) -> dict:
    return dict(llm.llm_engine.engine_core.worker.kv_connector.get_stats())


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def run(model: str, lengths: list[int], repeats: int, block_size: int, device: str, dtype: str,
        layerwise: bool, storage: str) -> list[dict]:
    import random

    from minivllm import LLM
    from minivllm.config import KVTransferConfig

    def ktc(role: str) -> KVTransferConfig:
        return KVTransferConfig("SharedStorageConnector", role,
                                {"shared_storage_path": storage, "layerwise": layerwise})
    blocks = -(-(max(lengths) + 1) // block_size) + 2
    common = dict(model=model, block_size=block_size, enable_prefix_caching=False,
                  skip_tokenizer_init=True, num_gpu_blocks_override=blocks, device=device, dtype=dtype)
    p = LLM(kv_transfer_config=ktc("kv_producer"), **common)
    d_load = LLM(kv_transfer_config=ktc("kv_consumer"), **common)
    d_rec = LLM(**common)
    vocab = p.vllm_config.hf_config.vocab_size
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        # Skip the low ids, where small vocabularies keep their special tokens.
        return [rng.randrange(min(100, vocab // 2), vocab) for _ in range(n)]
    warm = fresh(2 * block_size + 1)
    for llm in (p, d_load, d_rec):
        _timed(llm, warm)

    rows = []
    for n in lengths:
        for _ in range(repeats):
            ids = fresh(n)
            p0, d0 = _stats(p), _stats(d_load)
            t_p, tok_p = _timed(p, ids)
            t_load, tok_load = _timed(d_load, ids)
            t_rec, tok_rec = _timed(d_rec, ids)
            stored, loaded = _delta(_stats(p), p0), _delta(_stats(d_load), d0)
            rows.append(dict(
                prompt_tokens=n, loaded_tokens=loaded["num_loaded_tokens"], ttft_prefill_store=t_p,
                ttft_load=t_load, ttft_recompute=t_rec,
                stored_bytes=stored["num_stored_bytes"],
                bytes_per_token=stored["num_stored_bytes"] / max(stored["num_stored_tokens"], 1),
                load_mb_s=loaded["num_loaded_bytes"] / 2**20 / max(loaded["load_time_s"], 1e-9),
                same_first_token=tok_p == tok_load == tok_rec))
    return rows


def print_table(rows: list[dict]) -> None:
    head = ("prompt", "loaded", "P prefill+store s", "D TTFT load s", "D TTFT recompute s",
            "speedup", "stored MiB", "bytes/token", "load MiB/s", "same 1st token")
    print(" | ".join(head))
    print("-|-".join("-" * len(h) for h in head))
    for r in rows:
        cells = (r["prompt_tokens"], r["loaded_tokens"], f"{r['ttft_prefill_store']:.3f}",
                 f"{r['ttft_load']:.3f}", f"{r['ttft_recompute']:.3f}",
                 f"{r['ttft_recompute'] / r['ttft_load']:.2f}x",
                 f"{r['stored_bytes'] / 2**20:.2f}", f"{r['bytes_per_token']:.0f}",
                 f"{r['load_mb_s']:.0f}", "yes" if r["same_first_token"] else "NO")
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
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if not lengths or min(lengths) <= args.block_size:
        ap.error(f"--lengths must all exceed the block size ({args.block_size}): only whole "
                 "blocks below the last prompt token are transferred")
    storage = args.storage or tempfile.mkdtemp(prefix="minivllm-pd-")
    try:
        rows = run(args.model, lengths, args.repeats, args.block_size, args.device, args.dtype,
                   args.layerwise, storage)
    finally:
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)
    print(f"\nP/D time to first token, {os.path.basename(args.model.rstrip('/'))}, block size "
          f"{args.block_size}{', layerwise' if args.layerwise else ''}; one run, ratios are what count\n")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
