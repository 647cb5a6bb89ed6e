"""EAGLE and EAGLE-3 proposing, mirroring vllm/v1/spec_decode/eagle.py ``EagleProposer`` (the
non-padded drafter batch; article, "Speculative decoding": "EAGLE ... model surgery").

Once per engine step, after the target sampled (``propose_for_batch``):

1. Inputs of the first draft pass (``prepare_inputs``): every token the target just processed for
   each request, minus the drafts it rejected (vLLM's example: query lens [4, 7, 5], rejected
   [1, 3, 2] -> cu [0, 3, 7, 10], token indices [0,1,2, 4,5,6,7, 11,12,13]).
2. First pass over those tokens, shifted: position p is fed token p + 1 with the target's hidden
   state at p (EAGLE-3: ``fc`` over the three aux states); each request's last position gets the
   token just sampled (a partial prefill chunk: the next prompt token). Positions and slots are the
   target's, so the draft's KV lands in the *same slots* of its own KV tensors (one block table).
   The last position's logits give draft 1 through the drafter's ``draft_sampler`` (the argmax
   with ``draft_sample_method="greedy"``, the default, ``draft_probs=None``; sampled, with
   ``draft_probs``, when "probabilistic").
3. Passes 2..k, one token per request: the previous draft, at position + 1, with the draft's own
   fed-back state; slot from the block table (the scheduler reserved ``num_lookahead_tokens = k``
   slots). A position at or past ``max_model_len`` (or past the row's blocks) is clamped to 0 and
   its write skipped (``PADDING_SLOT_ID``); such drafts are never returned.

No state is kept between steps: the next first pass rewrites the KV of every accepted position
from target features, and a position past the request's tokens is rewritten before it is read.
Shapes: first pass ``[N]`` tokens / ``[N, H]`` states; later passes ``[B]`` / ``[B, H]``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minivllm import trace
from minivllm.attention.metadata import AttentionMetadata
from minivllm.config import VllmConfig
from minivllm.forward_context import set_forward_context
from minivllm.spec_decode.utils import PADDING_SLOT_ID, DraftKVCacheMixin, TargetStepOutputs


def prepare_inputs(cu_target_query_lens: np.ndarray,
                   num_rejected_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vLLM ``EagleProposer.prepare_inputs``: keep the first ``q_i - r_i`` tokens of each request.

    ``cu_target_query_lens`` ``[n + 1]`` (starts at 0), ``num_rejected_tokens`` ``[n]`` ->
    (``cu_num_tokens`` ``[n + 1]``, ``token_indices`` ``[sum(q_i - r_i)]`` into the target batch)."""
    cu = np.asarray(cu_target_query_lens, dtype=np.int64)
    new_lens = np.diff(cu) - np.asarray(num_rejected_tokens, dtype=np.int64)
    cu_num_tokens = np.concatenate([[0], np.cumsum(new_lens)])
    token_indices = np.concatenate(
        [np.arange(start, start + n) for start, n in zip(cu[:-1], new_lens)] or [np.zeros(0)])
    return cu_num_tokens, token_indices.astype(np.int64)


class EagleProposer(DraftKVCacheMixin):
    uses_target_hidden_states = True

    def __init__(self, vllm_config: VllmConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.vllm_config = vllm_config
        self.spec = vllm_config.speculative_config
        self.method = self.spec.method
        self.k = self.spec.num_speculative_tokens
        self.device, self.dtype = device, dtype
        self.max_model_len = vllm_config.model_config.max_model_len
        self.model: Any = None
        self._drafting: set[int] = set()   # batch rows that draft this step (own generator)

    prepare_inputs = staticmethod(prepare_inputs)

    # ------------------------------------------------------------------ set-up
    def load_model(self, target_model: Any) -> None:
        """Load the head, share the target's embeddings / lm_head; EAGLE-3 taps the target."""
        from minivllm.spec_decode.heads import aux_layer_ids, load_head, read_head_config
        path = self.spec.model
        self.model = load_head(path, self.method, target_model, self.k, self.dtype, self.device,
                               self.vllm_config.attention_backend)
        if self.method == "eagle3":
            config = read_head_config(path, "eagle3")
            target_model.set_aux_hidden_state_layers(
                aux_layer_ids(config, target_model.config, path))

    # ------------------------------------------------------------------ proposing
    def propose_for_batch(self, runner: Any, limits: dict[str, int],
                          so: Any) -> dict[str, list[int]]:
        """Drafts ``{req_id: [token ids]}`` (at most ``limits[req_id]``; none for rows missing
        from ``limits``, i.e. partial prefill chunks, whose first pass still writes draft KV)."""
        t: TargetStepOutputs = runner.target_step_outputs
        batch = runner.input_batch
        n = batch.num_reqs
        sampled = t.sampled_token_ids
        num_draft = (np.array(t.spec_decode_metadata.num_draft_tokens)
                     if t.spec_decode_metadata is not None else np.zeros(n, dtype=np.int64))
        num_rejected = np.array([d + 1 - len(s) if d > 0 and s else 0
                                 for d, s in zip(num_draft, sampled)], dtype=np.int64)
        # The token after each request's last kept position: just sampled, or the next prompt token.
        next_token_ids = np.array([s[-1] if s else batch.token_ids_cpu[i, t.seq_lens[i]]
                                   for i, s in enumerate(sampled)], dtype=np.int64)

        # 1.-2. First pass over the target's kept tokens, shifted by one.
        cu, token_indices = self.prepare_inputs(t.query_start_loc, num_rejected)
        last = cu[1:] - 1
        input_ids = np.empty(len(token_indices), dtype=np.int64)
        input_ids[:-1] = t.input_ids[token_indices[1:]]
        input_ids[last] = next_token_ids
        positions = t.positions[token_indices]
        slots = t.slot_mapping[token_indices]
        seq_lens = t.seq_lens[:n] - num_rejected
        idx = torch.from_numpy(token_indices).to(self.device)
        if self.method == "eagle3":
            hidden = self.model.combine_hidden_states(
                torch.cat([h[idx] for h in t.aux_hidden_states], dim=-1))
        else:
            hidden = t.hidden_states[idx]
        rows = np.arange(n)
        self._drafting = {i for i in range(n) if sampled[i] and batch.req_ids[i] in limits}
        draft, fed_back, probs = self._pass(0, batch, rows, cu, seq_lens, positions, slots,
                                            input_ids, hidden, last)
        drafts, pass_probs = [draft], [probs]

        # 3. Passes 2..k over the rows that sampled (a partial prefill chunk drafts nothing).
        active = np.array([i for i in range(n) if sampled[i]], dtype=np.int64)
        num_slots = batch.block_table.num_blocks_per_row[:n].astype(np.int64) * self.block_size
        pos = positions[last]
        hidden = fed_back
        for j in range(1, self.k if len(active) else 1):
            pos = pos + 1
            valid = (pos < self.max_model_len) & (pos < num_slots)
            clamped = np.where(valid, pos, 0)
            bt = batch.block_table.block_table
            slot = bt[rows, clamped // self.block_size].astype(np.int64) * self.block_size \
                + clamped % self.block_size
            slot = np.where(valid, slot, PADDING_SLOT_ID)
            ids = drafts[-1][active]
            cu_one_each = np.arange(len(active) + 1)
            draft_a, fed, probs_a = self._pass(j, batch, active, cu_one_each,
                                      np.where(valid, pos + 1, 1)[active],
                                      clamped[active], slot[active], ids, hidden[active],
                                      np.arange(len(active)))
            draft = np.zeros(n, dtype=np.int64)
            draft[active] = draft_a
            drafts.append(draft)
            if probs_a is not None:
                probs = torch.zeros_like(pass_probs[0])
                probs[torch.from_numpy(active).to(self.device)] = probs_a
                pass_probs.append(probs)
            hidden = torch.zeros_like(hidden)
            hidden[torch.from_numpy(active).to(self.device)] = fed

        # A draft from a pass at position p needs p < max_model_len and p inside the row's blocks:
        # draft d (1-based) comes from position L + d - 2, with L = seq_lens (kept context).
        out: dict[str, list[int]] = {}
        self.last_draft_probs = {}
        for i, req_id in enumerate(batch.req_ids):
            usable = min(limits.get(req_id, 0), int(num_slots[i] - seq_lens[i] + 1),
                         self.max_model_len - int(seq_lens[i]) + 1)
            if usable > 0 and sampled[i]:
                out[req_id] = [int(d[i]) for d in drafts[:usable]]
                if pass_probs[0] is not None:   # drawn from q (probabilistic): keep q
                    self.last_draft_probs[req_id] = torch.stack(
                        [p[i] for p in pass_probs[:usable]])
        return out

    def _pass(self, j: int, batch: Any, rows: np.ndarray, cu: np.ndarray, seq_lens: np.ndarray,
              positions: np.ndarray, slots: np.ndarray, input_ids: np.ndarray,
              hidden: torch.Tensor, sample_idx: np.ndarray):
        """One draft forward over ``rows`` of the persistent batch -> (drafts at ``sample_idx``
        ``[len(sample_idx)]``, fed-back states at ``sample_idx`` ``[len(sample_idx), H]``, their
        distributions ``[len(sample_idx), vocab]`` or ``None`` when drafting greedily)."""
        dev = self.device
        bt = batch.block_table
        max_blocks = max(int(bt.num_blocks_per_row[rows].max()), 1)
        md = AttentionMetadata(
            num_actual_tokens=int(cu[-1]),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(bt.block_table[rows, :max_blocks]).to(dev),
            slot_mapping=torch.from_numpy(slots.astype(np.int64)).to(dev),
            max_query_len=int(np.diff(cu).max()), max_seq_len=int(seq_lens.max()))
        # The first pass writes the draft KV of the context: under P/D it moves through the
        # connector (the runner registered the head's layers); later passes only write lookahead.
        connector = self.kv_connector if j == 0 else None
        with set_forward_context(md, self.model.attn_layers(), connector):
            logits_states, fed_back = self.model(torch.from_numpy(input_ids).to(dev),
                                                 torch.from_numpy(positions.astype(np.int64)).to(dev),
                                                 hidden.to(self.dtype))
        sel = torch.from_numpy(sample_idx).to(dev)
        draft, probs = self.draft_sampler(self.model.compute_logits(logits_states[sel]), batch,
                                          rows, self._drafting)
        if trace.active and trace.is_recording():
            trace.record("spec_draft_pass", method=self.method, pass_idx=j,
                         req_ids=[batch.req_ids[r] for r in rows],
                         query_start_loc=cu.tolist(), positions=positions.tolist(),
                         slot_mapping=slots.tolist(), input_ids=input_ids.tolist(),
                         draft_token_ids=draft.tolist())
        return draft, fed_back[sel], probs
