"""Draft-model speculative decoding: a smaller LM proposes k tokens greedily. Mirrors
vllm/v1/spec_decode/draft_model.py ``DraftModelProposer`` (added to V1 after the article, which says
V1 has no draft-model method) and the k-pass loop of eagle.py's ``EagleProposer.propose``.
Article step: spec step 2 (propose the next k drafts), and "Setup / load model" for its weights.

Two ways to get a draft model (``speculative_config``, method ``"draft_model"``):
- ``model``: a separate, smaller Llama-family checkpoint with the target's vocabulary;
- ``draft_num_layers=N``: a *self-draft*, the target's first N decoder layers plus its final norm and
  ``lm_head``, sharing the target's weight tensors (nothing is loaded twice).

KV cache. The draft model keeps its own paged cache (one ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` tensor per draft layer) addressed through the *same* block tables as the target: a
request's position ``p`` lives in the same slot in both caches. The scheduler reserves
``num_lookahead_tokens = k`` extra slots (``SpeculativeConfig.needs_lookahead_slots``) so the draft
can write the KV of its own drafts (vLLM 0.32 reserves them for the draft model too, and withholds
them only while an asynchronous KV load is pending); where a row has fewer slots (near
``max_model_len``), it drafts fewer tokens. Nothing is written outside the row's blocks.

One ``propose_for_batch`` call, per engine step, after the target sampled:
1. catch-up, one multi-token pass over every row: feed the positions whose draft KV is not valid yet,
   up to the row's last real token (a partial prefill chunk: up to what the target computed). The
   last logit of a drafting row gives draft 1 through the drafter's ``draft_sampler`` (the argmax
   with ``draft_sample_method="greedy"``, the default: the runner passes ``draft_probs=None``;
   "probabilistic": sampled, with its probs).
2. k - 1 single-token passes, each feeding the previous draft at the next position.

Validity: per request we remember which token id was fed at each position; the draft KV is valid on
the longest prefix where those equal the row's real tokens. Rejected drafts, chunked prefill and
recovered tokens are thereby handled by one rule; new, resumed (preempted: blocks replaced) and
finished requests reset or drop their state.

Shapes per pass: ``input_ids``, ``positions``, ``slot_mapping`` ``[num_tokens]``; ``block_table``
``[num_rows, max_blocks]``; logits ``[num_drafting_rows, vocab_size]``.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.config import SpeculativeConfig, VllmConfig
from minivllm.forward_context import set_forward_context
from minivllm.spec_decode.utils import DraftKVCacheMixin


def validate_draft_model(spec: SpeculativeConfig, target_hf_config: Any) -> str:
    """Check ``spec.model`` before any weights are read; return its resolved local directory.

    The draft must exist, be Llama-family and share the target's vocabulary (drafts are token ids
    of the target's vocabulary; a different vocab means a different tokenizer)."""
    from minivllm.model_executor.model_loader import load_hf_config, resolve_model_path
    try:
        path = resolve_model_path(spec.model)
    except (ValueError, ImportError) as e:
        raise ValueError(f"speculative_config.model={spec.model!r} cannot be used as a draft "
                         f"model: {e}") from e
    draft_vocab = load_hf_config(path).vocab_size
    if draft_vocab != target_hf_config.vocab_size:
        raise ValueError(f"speculative_config.model={spec.model!r} has vocab_size={draft_vocab}, "
                         f"the target model has {target_hf_config.vocab_size}: a draft model must "
                         "use the target's tokenizer (same vocabulary).")
    return path


def build_self_draft(target: Any, num_layers: int, attention_backend: str) -> Any:
    """The target's first ``num_layers`` layers + final norm + ``lm_head``, sharing its tensors.

    Built on the meta device, then every parameter is *assigned* the target's tensor (no copy); the
    draft's ``Attention`` modules are its own, so they can hold their own ``kv_cache``."""
    from minivllm.model_executor.models.llama import LlamaForCausalLM
    with torch.device("meta"):
        draft = LlamaForCausalLM(target.config, attention_backend=attention_backend,
                                 num_layers=num_layers)
    target_state = target.state_dict()
    draft.load_state_dict({name: target_state[name] for name in draft.state_dict()},
                          assign=True, strict=True)
    if draft.tie_word_embeddings:
        draft.lm_head.weight = draft.model.embed_tokens.weight
    return draft.eval().requires_grad_(False)


class _RequestDraftState:
    """Which token id the draft model has fed at each position of one request."""

    def __init__(self, max_model_len: int) -> None:
        self.fed = np.full(max_model_len, -1, dtype=np.int64)
        self.num_fed = 0

    def num_valid(self, tokens: np.ndarray) -> int:
        """Length of the longest prefix whose fed ids equal ``tokens`` (the row's real tokens)."""
        n = min(self.num_fed, len(tokens))
        mismatch = np.flatnonzero(self.fed[:n] != tokens[:n])
        return int(mismatch[0]) if len(mismatch) else n

    def record(self, start: int, token_ids: np.ndarray) -> None:
        self.fed[start:start + len(token_ids)] = token_ids
        self.num_fed = start + len(token_ids)


class DraftModelProposer(DraftKVCacheMixin):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.vllm_config = vllm_config
        self.spec = vllm_config.speculative_config
        self.k = self.spec.num_speculative_tokens
        self.device, self.dtype = device, dtype
        self.max_model_len = vllm_config.model_config.max_model_len
        self.model: Any = None
        self.states: dict[str, _RequestDraftState] = {}

    # ------------------------------------------------------------------ set-up
    def load_model(self, target_model: Any) -> None:
        """Article "Setup / load model": load the draft weights."""
        backend = self.vllm_config.attention_backend
        if self.spec.draft_num_layers is not None:
            self.model = build_self_draft(target_model, self.spec.draft_num_layers, backend)
            return
        from minivllm.model_executor.model_loader import load_model
        path = validate_draft_model(self.spec, target_model.config)
        self.model = load_model(path, self.dtype, self.device, attention_backend=backend)

    # ------------------------------------------------------------------ proposing
    def _sync_states(self, runner: Any, so: Any) -> None:
        """Drop finished requests; reset new and resumed ones (their blocks are new, or may have
        been reused by other requests while they waited)."""
        for req_id in list(self.states):
            if req_id not in runner.requests or req_id in so.preempted_req_ids:
                del self.states[req_id]
        fresh = [r.req_id for r in so.scheduled_new_reqs]
        fresh += list(so.scheduled_cached_reqs.resumed_req_ids)
        for req_id in fresh:
            self.states[req_id] = _RequestDraftState(self.max_model_len)

    def propose_for_batch(self, runner: Any, limits: dict[str, int],
                          so: Any) -> dict[str, list[int]]:
        """Drafts ``{req_id: [token ids]}``, at most ``limits[req_id]`` each (rows missing from
        ``limits`` are partial prefill chunks: caught up, never drafted for)."""
        self._sync_states(runner, so)
        batch = runner.input_batch
        bt = batch.block_table
        rows, starts, ends, num_drafts = [], [], [], []
        for req_id in batch.req_ids:
            row = batch.req_id_to_index[req_id]
            state = self.states.setdefault(req_id, _RequestDraftState(self.max_model_len))
            num_tokens = int(batch.num_tokens_no_spec[row])
            num_slots = int(bt.num_blocks_per_row[row]) * self.block_size
            if req_id in limits:
                # Feed through the last real token (its logits give draft 1); draft j > 1 feeds
                # draft j - 1 at position num_tokens + j - 2, so that slot must exist too.
                end = min(num_tokens, num_slots)
                n = min(limits[req_id], num_slots - num_tokens + 1) if end == num_tokens else 0
            else:   # partial prefill: the target has computed this far
                end = int(batch.num_computed_tokens_cpu[row]) + so.num_scheduled_tokens[req_id]
                n = 0
            start = state.num_valid(batch.token_ids_cpu[row, :end])
            if n > 0:
                start = min(start, end - 1)   # the last token's logits are needed even if fed
            if start < end:
                rows.append(row)
                starts.append(start)
                ends.append(end)
                num_drafts.append(max(n, 0))
        if not rows:
            return {}

        # 1. Catch-up pass: every row's missing positions at once (causal within each row).
        rows_a, starts_a, ends_a = (np.array(x, dtype=np.int64) for x in (rows, starts, ends))
        lens = ends_a - starts_a
        req_idx = np.repeat(rows_a, lens)
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
        input_ids = batch.token_ids_cpu[req_idx, positions].astype(np.int64)
        for i, row in enumerate(rows):
            fed = batch.token_ids_cpu[row, starts[i]:ends[i]]
            self.states[batch.req_ids[row]].record(starts[i], fed)
        drafting = [i for i, n in enumerate(num_drafts) if n > 0]
        last_idx = np.cumsum(lens)[drafting] - 1
        # (positional: tests wrap _forward with *args)
        tokens, probs = self._forward(batch, rows_a, lens, ends_a, req_idx, positions, input_ids,
                                      last_idx, self.kv_connector,
                                      rows_a[drafting])

        # 2. k - 1 single-token passes, each feeding the previous draft.
        drafts: dict[int, list[int]] = {i: [t] for i, t in zip(drafting, tokens)}
        draft_probs: dict[int, list[torch.Tensor]] = (
            {i: [probs[r]] for r, i in enumerate(drafting)} if probs is not None else {})
        for j in range(1, max((num_drafts[i] for i in drafting), default=0)):
            active = [i for i in drafting if num_drafts[i] > j]
            if not active:
                break
            act_rows = rows_a[active]
            pos = ends_a[active] + j - 1   # where draft j (0-based j - 1) sits
            ids = np.array([drafts[i][-1] for i in active], dtype=np.int64)
            for i, p, t in zip(active, pos, ids):
                self.states[batch.req_ids[rows[i]]].record(int(p), np.array([t]))
            ones = np.ones(len(active), dtype=np.int64)
            tokens, probs = self._forward(batch, act_rows, ones, pos + 1, act_rows, pos, ids,
                                          np.arange(len(active)), None, act_rows)
            for r, (i, t) in enumerate(zip(active, tokens)):
                drafts[i].append(t)
                if probs is not None:
                    draft_probs[i].append(probs[r])
        self.last_draft_probs = {batch.req_ids[rows[i]]: torch.stack(p)
                                 for i, p in draft_probs.items()}
        return {batch.req_ids[rows[i]]: d for i, d in drafts.items()}

    def _forward(self, batch: Any, rows: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
                 req_idx: np.ndarray, positions: np.ndarray, input_ids: np.ndarray,
                 sample_idx: np.ndarray, connector: Any = None,
                 sample_rows: Optional[np.ndarray] = None):
        """One draft forward over ``rows`` of the persistent batch -> (drafts at ``sample_idx``,
        their distributions ``[len(sample_idx), vocab]`` or ``None`` when greedy); logits row r
        belongs to batch row ``sample_rows[r]``.
        ``connector``: bound on the catch-up pass under P/D, so the draft layers save and load.

        ``req_idx``/``positions``/``input_ids`` are per token; ``seq_lens`` is each row's context
        length including its new tokens. The metadata has the target's layout, so the same
        unified attention serves the multi-token catch-up and the one-token draft steps."""
        bt = batch.block_table
        dev = self.device
        slot_mapping = bt.compute_slot_mapping(req_idx, positions)
        max_blocks = int(bt.num_blocks_per_row[rows].max())
        cu = np.concatenate([[0], np.cumsum(query_lens)])
        md = AttentionMetadata(
            num_actual_tokens=int(cu[-1]),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(bt.block_table[rows, :max_blocks]).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()))
        with set_forward_context(md, self.model.attn_layers(), connector):
            hidden = self.model(torch.from_numpy(input_ids).to(dev),
                                torch.from_numpy(positions.astype(np.int64)).to(dev))
        if len(sample_idx) == 0:
            return [], None
        logits = self.model.compute_logits(hidden[torch.from_numpy(sample_idx).to(dev)])
        ids, probs = self.draft_sampler(logits, batch, sample_rows)
        return ids.tolist(), probs
