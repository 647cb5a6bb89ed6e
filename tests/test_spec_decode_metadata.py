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


def test_calc_spec_decode_metadata_worked_example():
    """The worked example in ``ModelRunner._calc_spec_decode_metadata``'s docstring is what it
    returns, and every index tensor is int32, as the table in spec_decode/metadata.py says."""
    import re
    from types import SimpleNamespace

    import numpy as np

    from minivllm.worker.model_runner import ModelRunner
    token_ids = np.zeros((3, 16), dtype=np.int32)
    token_ids[1, 6:9] = [71, 72, 73]     # request 1: 6 real tokens, then its 3 drafts
    token_ids[2, 8] = 81                 # request 2: 8 real tokens, then its draft
    runner = SimpleNamespace(device=torch.device("cpu"), input_batch=SimpleNamespace(
        token_ids_cpu=token_ids, num_tokens_no_spec=np.array([5, 6, 8])))
    md = ModelRunner._calc_spec_decode_metadata(runner, np.array([0, 3, 1]), np.array([5, 9, 11]))
    doc = ModelRunner._calc_spec_decode_metadata.__doc__
    expected = {name: [int(x) for x in re.findall(r"\d+", values)]
                for name, values in re.findall(r"(\w+):\s+\[([\d, ]+)\]", doc)}
    assert expected["num_draft_tokens"] == md.num_draft_tokens == [0, 3, 1]
    for name in ("logits_indices", "target_logits_indices", "bonus_logits_indices",
                 "cu_num_sampled_tokens", "cu_num_draft_tokens"):
        assert getattr(md, name).tolist() == expected[name], name
        assert getattr(md, name).dtype == torch.int32, name
    assert md.draft_token_ids.tolist() == [71, 72, 73, 81] and md.draft_token_ids.dtype == torch.int32
    assert md.max_spec_len == 3
