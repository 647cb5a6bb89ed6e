"""SpecDecodeMetadata.make_dummy shapes and SpecDecodingStats arithmetic."""
import math

import pytest
import torch

from minivllm.spec_decode.metadata import SpecDecodeMetadata
from minivllm.spec_decode.metrics import SpecDecodingStats


def test_make_dummy_shapes():
    md = SpecDecodeMetadata.make_dummy([[1, 2, 3], [], [4, 5], [6]], device="cpu")
    assert md.draft_token_ids.dtype == torch.int32 and md.draft_token_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert md.num_draft_tokens == [3, 0, 2, 1]
    assert md.cu_num_draft_tokens.tolist() == [3, 3, 5, 6]
    assert md.cu_num_sampled_tokens.tolist() == [4, 5, 8, 10]
    assert md.max_spec_len == 3
    assert md.target_logits_indices.shape == (6,) and md.bonus_logits_indices.shape == (4,)
    assert md.logits_indices.shape == (10,)
    for t in (md.cu_num_draft_tokens, md.cu_num_sampled_tokens, md.target_logits_indices,
              md.bonus_logits_indices, md.logits_indices):
        assert t.dtype == torch.int32
    assert not md.logits_indices.any()


def test_make_dummy_without_drafts():
    md = SpecDecodeMetadata.make_dummy([[], []], device="cpu")
    assert md.max_spec_len == 0 and md.draft_token_ids.shape == (0,)
    assert md.cu_num_sampled_tokens.tolist() == [1, 2] and md.logits_indices.shape == (2,)


def test_explicit_max_spec_len():
    md = SpecDecodeMetadata.make_dummy([[1, 2]])
    args = (md.draft_token_ids, md.num_draft_tokens, md.cu_num_draft_tokens, md.cu_num_sampled_tokens,
            md.target_logits_indices, md.bonus_logits_indices, md.logits_indices)
    assert SpecDecodeMetadata(*args).max_spec_len == 2
    assert SpecDecodeMetadata(*args, max_spec_len=4).max_spec_len == 4
    with pytest.raises(ValueError):
        SpecDecodeMetadata(*args, max_spec_len=1)


def test_spec_decoding_stats():
    stats = SpecDecodingStats(num_spec_tokens=3)
    assert stats.num_accepted_tokens_per_pos == [0, 0, 0]
    assert math.isnan(stats.mean_acceptance_length)
    for drafted, accepted in ((3, 2), (3, 0), (3, 3), (2, 1)):
        stats.observe_draft(drafted, accepted)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 11, 6)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1]
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert stats.acceptance_rate_per_pos == pytest.approx([0.75, 0.5, 0.25])
    assert stats.draft_acceptance_rate == pytest.approx(600 / 11)
    with pytest.raises(ValueError):
        stats.observe_draft(2, 3)
    with pytest.raises(ValueError):
        stats.observe_draft(4, 1)
    assert SpecDecodingStats.new(2).num_accepted_tokens_per_pos == [0, 0]
