"""Case k: KV events on vLLM's wire. minivllm's stream, decoded by vLLM 0.32's own
``KVEventBatch``, equals what it sent; and for the same prompts (prefilled one after another into
a cache small enough to evict) it matches the stream vLLM 0.32 publishes: the same events in the
same order, the same token chunks per block, parent links and block size.

Hash *values* differ, because the hash functions do: minivllm's is sha256 over (parent, token count,
int64 token ids, extra keys) (core/kv_cache_utils.py), vLLM's is sha256 over its CBOR encoding of
(parent, tokens, extra keys) with its own seed. So hashes are compared by identity: each side's
hashes are numbered in order of first appearance, and the numbered streams must be equal.
"""
from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

# vLLM 0.32's CPU attention takes block sizes that are multiples of 32.
BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_MODEL_LEN = 32, 20, 512


def _prompts(chat_prompts):
    c = chat_prompts
    # turns of one conversation (each extends the last: prefix hits, parents in the cache), other
    # prompts in between, and enough tokens for 19 usable blocks to evict
    return [c[0], c[0] + c[4], c[1], c[2], c[3], c[0] + c[4] + c[5], c[6]]


def _minivllm_stream(model, prompts) -> list[bytes]:
    from minivllm import LLM, SamplingParams
    llm = LLM(model=model, dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
              num_gpu_blocks_override=NUM_GPU_BLOCKS,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0"})
    publisher = llm.llm_engine.engine_core.scheduler.kv_event_publisher
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)
    payloads = []
    try:
        for ids in prompts:
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)
            while sub.poll(1000):
                _, seq, payload = sub.recv_multipart()
                assert int.from_bytes(seq, "big") == len(payloads)
                payloads.append(payload)
    finally:
        sub.close(linger=0)
        publisher.shutdown()
    return payloads


def _numbered(batches: list[dict]) -> list[tuple]:
    """The events in order, each hash replaced by its order of first appearance."""
    ids: dict = {}

    def n(h):
        return None if h is None else ids.setdefault(h, len(ids))
    out = []
    for b in batches:
        for e in b["events"]:
            out.append((e["type"], [n(h) for h in e.get("block_hashes", [])],
                        n(e.get("parent_block_hash")), e.get("token_ids"), e.get("block_size")))
    return out


def test_k_vllm_decodes_our_events_and_they_match_its_own(vllm_side, conformance_model,
                                                          chat_prompts):
    prompts = _prompts(chat_prompts)
    ours = _minivllm_stream(conformance_model, prompts)
    got = vllm_side("k_kv_events.py", {"model": conformance_model, "prompts": prompts,
                                       "block_size": BLOCK_SIZE, "num_gpu_blocks": NUM_GPU_BLOCKS,
                                       "max_model_len": MAX_MODEL_LEN,
                                       "minivllm_payloads": [p.hex() for p in ours]})
    from minivllm.distributed.kv_events import decoder
    sent = [decoder().decode(p) for p in ours]
    decoded = got["minivllm"]                     # by vLLM's classes
    assert len(decoded) == len(sent)
    for a, b in zip(sent, decoded):
        assert [type(e).__name__ for e in a.events] == [e["type"] for e in b["events"]]
        for e, d in zip(a.events, b["events"]):
            assert [h.hex() for h in getattr(e, "block_hashes", [])] == d.get("block_hashes", [])
            if d["type"] == "BlockStored":
                assert (d["token_ids"], d["block_size"]) == (e.token_ids, e.block_size)
                assert d["parent_block_hash"] == (e.parent_block_hash.hex()
                                                  if e.parent_block_hash else None)
    kinds = {e[0] for e in _numbered(got["vllm"])}
    assert {"BlockStored", "BlockRemoved"} <= kinds, kinds      # the cache evicted
    assert _numbered(decoded) == _numbered(got["vllm"])
