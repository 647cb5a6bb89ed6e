"""The drafter interface ``ModelRunner`` calls, in the spirit of vLLM 0.32's
vllm/v1/spec_decode/llm_base_proposer.py: what a drafter does is a method, what it needs is a
declared attribute, so the runner never probes a drafter with ``getattr`` / ``hasattr``.

Article, "Setup": the drafter is created at init device (``create_drafter``), its weights load at
load model (``load_model``: a no-op for n-gram), and after each step's sampling it proposes up to k
drafts per request (``propose_for_batch``, called by ``ModelRunner.propose_draft_token_ids``).

A drafter with a model of its own (EAGLE, the draft model) turns its logits into drafts with its
``draft_sampler``: the argmax here (``draft_sample_method="greedy"``, the default); vLLM 0.32's
``"probabilistic"`` is a sampler beside it (worker/vllm_today/draft_probs.py).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch


class DraftSampler:
    """How a drafter turns its logits into drafts. This one is ``draft_sample_method="greedy"``
    (vLLM's default): each draft is the argmax of the drafter's logits, with no distribution, so
    the rejection sampler treats it as certain (``p_draft = 1``)."""

    def __call__(self, logits: torch.Tensor, batch: Any, rows: np.ndarray,
                 drafting_rows: Optional[set[int]] = None,
                 ) -> tuple[np.ndarray, Optional[torch.Tensor]]:
        """Draft ids ``[m]`` from ``logits`` ``[m, vocab]``, row ``r`` belonging to the persistent
        batch's row ``rows[r]``, and the distributions ``[m, vocab]`` they were drawn from (``None``
        here). ``drafting_rows``: the batch rows whose drafts are kept (all when ``None``); only
        they may draw from their request's generator (a partial prefill chunk's draft is thrown
        away)."""
        return logits.argmax(dim=-1).cpu().numpy(), None


class Proposer:
    # Reads this step's target states (``runner.target_step_outputs``: EAGLE, EAGLE-3, Medusa).
    uses_target_hidden_states: bool = False
    # Keeps K/V of its own, in caches shaped like the target's (EAGLE's head, the draft model): it
    # then needs k lookahead slots per request and has layers a KV connector could move.
    has_kv_cache: bool = False
    # Under P/D, the connector the drafter's first pass saves and loads its KV through (set by the
    # runner when the drafter's layers move with the target's; ``None``: the drafter's KV stays local).
    kv_connector: Any = None
    # Turns the drafter's logits into drafts: the argmax; with draft_sample_method="probabilistic"
    # the runner hands vLLM 0.32's sampler instead.
    draft_sampler: DraftSampler = DraftSampler()

    def __init__(self) -> None:
        # draft_sample_method="probabilistic": req_id -> the distributions ``[num_drafts, vocab]``
        # the last proposals were sampled from; empty for greedy drafts (p_draft = 1).
        self.last_draft_probs: dict[str, torch.Tensor] = {}

    def load_model(self, target_model: Any) -> None:
        """Article "Setup / load model": load the draft weights (n-gram has none)."""

    def propose_for_batch(self, runner: Any, limits: dict[str, int],
                          scheduler_output: Any) -> dict[str, list[int]]:
        """Article step 2: ``{req_id: drafts}``, at most ``limits[req_id]`` drafts each; a request
        the drafter has nothing for is left out."""
        raise NotImplementedError

    def attn_layers(self) -> dict[str, Any]:
        """The drafter's own attention layers by name (empty unless ``has_kv_cache``)."""
        return {}

    def kv_cache_bytes_per_token(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Bind the drafter's KV caches (only drafters with ``has_kv_cache``)."""
