"""What ``RedisStoreConnector``'s scheduler half tells its worker half each step (vLLM: a
connector's ``KVConnectorMetadata`` subclass, e.g. LMCache's behind
vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm.distributed.kv_transfer.base import KVConnectorMetadata
from minivllm.distributed.kv_transfer.redis_store import Chunk


@dataclass
class RedisReqMeta:
    """One request's transfer this step: prompt positions ``[start, end)`` <-> paged-cache slots
    ``slot_mapping`` ``[end - start]``; ``chunks``: the chunks to load or store (a load reads only
    rows ``>= start`` of its first chunk)."""
    req_id: str
    chunks: list[Chunk]
    start: int
    end: int
    slot_mapping: torch.Tensor
    block_ids: list[int]
    is_store: bool
    load_async: bool = False

    @staticmethod
    def make(req_id: str, chunks: list[Chunk], start: int, end: int, block_ids: list[int],
             block_size: int, is_store: bool, load_async: bool = False) -> "RedisReqMeta":
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)
        slot_mapping = blocks[pos // block_size] * block_size + pos % block_size
        return RedisReqMeta(req_id, chunks, start, end, slot_mapping,
                            list(block_ids[start // block_size:-(-end // block_size)]), is_store, load_async)


@dataclass
class RedisStoreConnectorMetadata(KVConnectorMetadata):
    requests: list[RedisReqMeta] = field(default_factory=list)

    def describe(self) -> list[dict[str, Any]]:
        return [{"req_id": r.req_id, "is_store": r.is_store, "load_async": r.load_async,
                 "tokens": [r.start, r.end], "chunks": [c.hash[:12] for c in r.chunks],
                 "block_ids": r.block_ids} for r in self.requests]
