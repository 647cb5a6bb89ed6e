"""Where the KV is: the fleet's index of which replica holds which prefix-cache block, and the
choice it feeds. Pure Python, no Ray: the same events always build the same index.

- ``KVIndex``: one per pool (prefill, decode). Fed by each replica's KV events
  (distributed/kv_events.py: ``BlockStored`` adds hashes, ``BlockRemoved`` drops them,
  ``AllBlocksCleared`` empties the replica), as llm-d's precise prefix-cache scorer and Dynamo's
  KV router are. Bounded per replica (least recently stored or matched first out), and a replica
  that leaves or restarts is forgotten (``forget``).
- ``prompt_block_hashes``: a prompt's full blocks hashed exactly as the engines' prefix cache
  hashes them (core/kv_cache_utils.py ``hash_block_tokens``), so a match is a real hit.
- ``score``: NVIDIA Dynamo's KV router cost, ``w * (prompt blocks - prefix blocks held) + KV blocks
  in use``: the blocks it would still have to prefill, plus the load it already carries (the
  prompt blocks of the requests the ingress has in flight there, counted as it places them, as
  Dynamo's router counts its active sequences).
- ``pick``: the lowest score wins; a tie (and an empty index, where every prefix is 0) goes to the
  least loaded replica.
- ``needs_remote_prefill``: the P/D decision, decode picked first (llm-d's
  ``prefix-based-pd-decider``): prefill remotely only when the decode replica would have to
  compute more than ``pd_min_uncached_tokens`` of the prompt itself.

Routing is a hint: an event lost, late or out of order can make the index wrong, and a wrong index
costs a cache miss (the engine recomputes what it does not hold), never a wrong token.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Optional, Sequence

from minivllm.core.kv_cache_utils import hash_block_tokens

# Blocks remembered per replica: far more than a CPU replica's KV cache holds (a few thousand
# blocks), so the bound only protects the ingress from a replica whose events never say "removed".
DEFAULT_MAX_BLOCKS_PER_REPLICA = 100_000
# Dynamo's default ``overlap_score_weight``: a block still to prefill weighs as much as a block of
# load. Higher favours the cache (less prefill, a longer queue), lower the balance.
OVERLAP_SCORE_WEIGHT = 1.0


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hashes of the prompt's full blocks, chained from the first (``[num_tokens // block_size]``)."""
    out: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out


class KVIndex:
    """block hash -> the replicas holding it, and per replica its hashes in LRU order."""

    def __init__(self, max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA) -> None:
        self.max_blocks_per_replica = max_blocks_per_replica
        self.holders: dict[bytes, set] = {}
        self.blocks: dict[Hashable, OrderedDict] = {}

    def apply(self, replica: Hashable, events: Iterable[Any]) -> None:
        """One batch of ``replica``'s events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``, or anything with the same fields and class names)."""
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                for h in event.block_hashes:
                    self._add(replica, h)
            elif kind == "BlockRemoved":
                for h in event.block_hashes:
                    self._drop(replica, h)
            elif kind == "AllBlocksCleared":
                self.forget(replica)

    def _add(self, replica: Hashable, h: bytes) -> None:
        held = self.blocks.setdefault(replica, OrderedDict())
        held[h] = None
        held.move_to_end(h)
        self.holders.setdefault(h, set()).add(replica)
        while len(held) > self.max_blocks_per_replica:
            self._drop(replica, next(iter(held)))

    def _drop(self, replica: Hashable, h: bytes) -> None:
        held = self.blocks.get(replica)
        if held is None or h not in held:       # not held: a late or repeated removal
            return
        del held[h]
        holders = self.holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.holders[h]

    def forget(self, replica: Hashable) -> None:
        """The replica left, restarted or cleared its cache: it holds nothing we know of."""
        for h in list(self.blocks.pop(replica, ())):
            holders = self.holders.get(h)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self.holders[h]

    def prefix_blocks(self, replica: Hashable, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, ``replica`` holds without a gap (a prefix
        cache can only use a prefix). The matched blocks become its most recently used."""
        held = self.blocks.get(replica)
        n = 0
        if held:
            for h in hashes:
                if h not in held:
                    break
                n += 1
            for h in hashes[:n]:
                held.move_to_end(h)
        return n

    def num_blocks(self, replica: Hashable) -> int:
        return len(self.blocks.get(replica, ()))


@dataclass
class Candidate:
    """One replica as the policy sees it: its id, the prompt blocks it holds (a prefix), the KV
    blocks its requests in flight hold (its load) and how many requests those are."""
    replica: Hashable
    cached_blocks: int
    blocks_in_use: int
    num_ongoing: int = 0
    score: float = 0.0


def score(num_prompt_blocks: int, cached_blocks: int, blocks_in_use: int,
          weight: float = OVERLAP_SCORE_WEIGHT) -> float:
    """Dynamo's cost: the prompt blocks it would still prefill, weighted, plus its decode load."""
    return weight * (num_prompt_blocks - cached_blocks) + blocks_in_use


def pick(candidates: list[Candidate], num_prompt_blocks: int,
         weight: float = OVERLAP_SCORE_WEIGHT) -> Optional[Candidate]:
    """The lowest score wins; among equal scores, the fewest requests in flight, then the fewest
    blocks in use (so an empty index spreads the load). ``None`` for no candidate."""
    for c in candidates:
        c.score = score(num_prompt_blocks, c.cached_blocks, c.blocks_in_use, weight)
    if not candidates:
        return None
    return min(candidates, key=lambda c: (c.score, c.num_ongoing, c.blocks_in_use))


def needs_remote_prefill(num_prompt_tokens: int, cached_blocks: int, block_size: int,
                         pd_min_uncached_tokens: int) -> bool:
    """Decode picked first: prefill remotely only when more than ``pd_min_uncached_tokens`` of
    the prompt are not already in the decode replica's cache (0: always remote)."""
    uncached = num_prompt_tokens - cached_blocks * block_size
    return pd_min_uncached_tokens <= 0 or uncached > pd_min_uncached_tokens
