"""The worker's persistent batch, mirroring vllm/v1/worker/gpu_input_batch.py and block_table.py.

Rows persist across steps, so a decode step only touches what changed: a request's token ids live in
``token_ids_cpu[row]`` and its block ids in ``block_table.block_table[row]``. Speculative decoding,
article step 5: the scheduled drafts are copied into ``token_ids_cpu`` right after the request's real
tokens (``num_tokens`` counts them, ``num_tokens_no_spec`` does not).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The worker's own copy of a request (vLLM: gpu_input_batch.CachedRequestState)."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: Optional[torch.Generator]
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class BlockTable:
    """``block_table [max_num_reqs, max_num_blocks_per_req]`` int32 plus the slot-mapping rule.

    Slot of position ``p`` in row ``r``: ``block_table[r, p // block_size] * block_size + p % block_size``.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def append_row(self, block_ids: list[int], row_idx: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks_per_row[row_idx]
        self.block_table[row_idx, start:start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row_idx] += len(block_ids)

    def add_row(self, block_ids: list[int], row_idx: int) -> None:
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        n = self.num_blocks_per_row[src]
        self.block_table[tgt, :n] = self.block_table[src, :n]
        self.num_blocks_per_row[tgt] = n

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        block_numbers = self.block_table[req_indices, positions // self.block_size]
        return block_numbers.astype(np.int64) * self.block_size + positions % self.block_size


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 block_size: int) -> None:
        self.req_ids: list[Optional[str]] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)         # includes drafts
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)   # suffix decoding reads it
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, max_num_blocks_per_req, block_size)
        self.sampling_params: dict[str, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.spec_token_ids: dict[str, list[int]] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req: CachedRequestState) -> int:
        row = len(self.req_ids)
        self.req_ids.append(req.req_id)
        self.req_id_to_index[req.req_id] = row
        n_prompt = len(req.prompt_token_ids)
        n = req.num_tokens
        self.token_ids_cpu[row, :n_prompt] = req.prompt_token_ids
        self.token_ids_cpu[row, n_prompt:n] = req.output_token_ids
        self.num_tokens[row] = self.num_tokens_no_spec[row] = n
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens_cpu[row] = req.num_computed_tokens
        self.block_table.add_row(req.block_ids, row)
        self.sampling_params[req.req_id] = req.sampling_params
        if req.generator is not None:
            self.generators[row] = req.generator
        return row

    def remove_requests(self, req_ids: set[str]) -> None:
        """Drop rows and compact the remaining ones to the front, keeping their order."""
        if not any(r in self.req_id_to_index for r in req_ids):
            return
        keep = [r for r in self.req_ids if r not in req_ids]
        old_index = dict(self.req_id_to_index)
        old_gens = self.generators
        self.req_ids, self.req_id_to_index, self.generators = [], {}, {}
        for new_row, req_id in enumerate(keep):
            src = old_index[req_id]
            if src != new_row:
                n = self.num_tokens[src]
                self.token_ids_cpu[new_row, :n] = self.token_ids_cpu[src, :n]
                for arr in (self.num_tokens, self.num_tokens_no_spec, self.num_prompt_tokens,
                            self.num_computed_tokens_cpu):
                    arr[new_row] = arr[src]
                self.block_table.move_row(src, new_row)
            self.req_ids.append(req_id)
            self.req_id_to_index[req_id] = new_row
            if src in old_gens:
                self.generators[new_row] = old_gens[src]
        for req_id in req_ids:
            self.sampling_params.pop(req_id, None)
            self.spec_token_ids.pop(req_id, None)
