"""Suffix decoding (``method="suffix"``), mirroring vLLM 0.32's
vllm/v1/spec_decode/suffix_decoding.py and the ``SuffixDecodingCache`` it calls from
arctic-inference (Oliaro et al., "SuffixDecoding", arXiv 2411.04975).

Article step 2 ("propose k drafts"), after the n-gram rule: instead of the first earlier place
where the last n tokens occurred in one request, a scored match in suffix trees (suffix_tree.py):

- one tree per running request, over its prompt and output so far;
- one global tree over the outputs of the last ``suffix_decoding_max_cached_requests`` requests,
  so a pattern repeated **across** requests (the same edit on similar code, a templated answer)
  is found too.

Each step the proposer speculates in both trees and keeps the higher-scoring draft. Its length
varies per request (at most ``suffix_decoding_max_spec_factor`` times the match length, capped by
``num_speculative_tokens``); the scheduler counts ``len(request.spec_token_ids)`` per request
(article step 4), so nothing else changes.

The request's lifecycle, as vLLM runs it (no hook in the engine: the proposer sees every running
request each step, and notices the ones that left):

- first proposal for a request: its prompt becomes its tree (``start_request``);
- every step: the tokens it sampled join its tree and, as they arrive, the global tree
  (``add_active_response``);
- a request no longer in the batch (finished or preempted) loses its own tree
  (``stop_request``); its output stays in the global tree until FIFO eviction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from minivllm.spec_decode.base_proposer import Proposer
from minivllm.spec_decode.suffix_tree import SuffixDraft, SuffixTree


class SuffixDecodingCache:
    """arctic-inference's ``SuffixDecodingCache``, readable: per active request a tree over its
    prompt and output; one global tree over the outputs of the last ``max_cached_requests``
    requests (0: no global tree; -1: no limit)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = -1) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.global_tree = SuffixTree(max_tree_depth)
        self.local_trees: dict[Hashable, SuffixTree] = {}
        self.cached_seq_ids: dict[Hashable, int] = {}   # insertion order = eviction order (FIFO)
        self._next_seq_id = 0

    @property
    def active_requests(self):
        return self.local_trees.keys()

    @property
    def cached_requests(self):
        return self.cached_seq_ids.keys()

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int]) -> None:
        if req_id in self.local_trees:
            raise ValueError(f"Request '{req_id}' is already active")
        tree = self.local_trees[req_id] = SuffixTree(self.max_tree_depth)
        tree.extend(0, prompt_token_ids)
        if self.max_cached_requests != 0:
            if req_id in self.cached_seq_ids:
                self.evict_cached_response(req_id)
            self.cached_seq_ids[req_id] = self._next_seq_id
            self._next_seq_id += 1
            while 0 <= self.max_cached_requests < len(self.cached_seq_ids):
                self.evict_cached_response(next(iter(self.cached_seq_ids)))   # the oldest

    def stop_request(self, req_id: Hashable) -> None:
        if req_id not in self.local_trees:
            raise ValueError(f"Request '{req_id}' is not active")
        del self.local_trees[req_id]

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int]) -> None:
        if req_id not in self.local_trees:
            raise ValueError(f"Request '{req_id}' is not active")
        self.local_trees[req_id].extend(0, token_ids)
        if req_id in self.cached_seq_ids:   # it may have been evicted while still running
            self.global_tree.extend(self.cached_seq_ids[req_id], token_ids)

    def evict_cached_response(self, req_id: Hashable) -> None:
        if req_id not in self.cached_seq_ids:
            raise ValueError(f"Request '{req_id}' is not cached")
        self.global_tree.remove(self.cached_seq_ids.pop(req_id))

    def speculate(self, req_id: Hashable, context: Sequence[int], max_spec_tokens: int,
                  max_spec_factor: float = 1.0, min_token_prob: float = 0.1
                  ) -> tuple[SuffixDraft, str]:
        """The better draft of the request's own tree and the global tree (its own on a tie),
        and which tree it came from: ``"request"`` or ``"global"``."""
        if req_id not in self.local_trees:
            raise ValueError(f"Request '{req_id}' is not active")
        context = list(context[-self.max_tree_depth:])   # a match is never deeper than the trees
        own = self.local_trees[req_id].speculate(context, max_spec_tokens, max_spec_factor,
                                                 min_token_prob)
        other = self.global_tree.speculate(context, max_spec_tokens, max_spec_factor,
                                           min_token_prob)
        return (own, "request") if own.score >= other.score else (other, "global")


@dataclass
class SuffixMatch:
    """What the last proposal for a request matched, for the tour's ``spec.2`` stop: the matched
    suffix of its context, the tree, the path walked (one ``(token, count, parent_count)`` per
    draft token) and each draft token's score (its estimated probability)."""
    matched_suffix: list[int]
    tree: str
    path: list[tuple[int, int, int]]
    scores: list[float]


class SuffixDecodingProposer(Proposer):
    """The ``Proposer`` for ``method="suffix"`` (vLLM 0.32's ``SuffixDecodingProposer``)."""

    def __init__(self, vllm_config: Any, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_tree_depth = spec.suffix_decoding_max_tree_depth
        self.max_spec_factor = spec.suffix_decoding_max_spec_factor
        self.min_token_prob = spec.suffix_decoding_min_token_prob
        self.max_model_len = vllm_config.model_config.max_model_len
        self.suffix_cache = SuffixDecodingCache(spec.suffix_decoding_max_tree_depth,
                                                spec.suffix_decoding_max_cached_requests)
        self.num_tokens_seen: dict[str, int] = {}   # req_id -> context tokens already in its tree
        self.last_match: dict[str, SuffixMatch] = {}

    def propose_for_batch(self, runner: Any, limits: dict[str, int],
                          so: Any) -> dict[str, list[int]]:
        """``limits`` holds the requests that sampled this step (not a partial prefill). Each one's
        new tokens join the trees, then it gets the best suffix draft, cut at its limit."""
        batch, drafts = runner.input_batch, {}
        self.last_match = {}
        for req_id, limit in limits.items():
            row = batch.req_id_to_index[req_id]
            num_tokens = int(batch.num_tokens_no_spec[row])
            if num_tokens >= self.max_model_len:
                continue                        # full: vLLM neither adds nor drafts
            context = batch.token_ids_cpu[row, :num_tokens].tolist()
            self._add_new_tokens(req_id, context, int(batch.num_prompt_tokens[row]))
            # vLLM drafts up to k (and the model length) here and cuts at max_tokens later: the
            # cap changes which match scores best, so it is applied first, the limit after.
            draft, tree_name = self.suffix_cache.speculate(   # the context is cut to the depth there
                req_id, context,
                max_spec_tokens=min(self.num_speculative_tokens,
                                    self.max_model_len - num_tokens - 1),
                max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
            self.last_match[req_id] = SuffixMatch(
                context[num_tokens - draft.match_len:] if draft.match_len else [], tree_name,
                [(t, c, p) for t, (c, p) in zip(draft.token_ids, draft.counts)], draft.probs)
            if limit > 0 and draft.token_ids:
                drafts[req_id] = draft.token_ids[:limit]
        for req_id in set(self.suffix_cache.active_requests) - batch.req_id_to_index.keys():
            self.suffix_cache.stop_request(req_id)     # finished or preempted: its tree goes
            self.num_tokens_seen.pop(req_id, None)
        return drafts

    def _add_new_tokens(self, req_id: str, context: list[int], num_prompt_tokens: int) -> None:
        """The request's tokens sampled this step into its tree (and the global one)."""
        cache = self.suffix_cache
        if req_id not in cache.active_requests:
            # A request id seen before (e.g. preempted): start_request evicts its old response.
            cache.start_request(req_id, context[:num_prompt_tokens])
            # First seen right after its prefill (or a preempted request's recompute): it sampled
            # one token this step; vLLM adds only that one (earlier outputs are not re-added).
            self.num_tokens_seen[req_id] = len(context) - 1
        cache.add_active_response(req_id, context[self.num_tokens_seen[req_id]:])
        self.num_tokens_seen[req_id] = len(context)
