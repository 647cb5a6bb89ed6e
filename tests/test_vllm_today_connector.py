"""vLLM 0.32 names the article's debug connector ``ExampleConnector``
(vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py); minivllm accepts both names."""
from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer import KVConnectorFactory, validate_kv_transfer_config

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 8


def _llm(model, name, path):
    ktc = KVTransferConfig(name, "kv_both", {"shared_storage_path": str(path)})
    return LLM(model=model, kv_transfer_config=ktc, block_size=BS, num_gpu_blocks_override=64,
               skip_tokenizer_init=True)


def test_example_connector_is_the_shared_storage_connector():
    from minivllm.distributed.kv_transfer.shared_storage_connector import (
        ExampleConnector, ExampleConnectorMetadata, SharedStorageConnector,
        SharedStorageConnectorMetadata)
    assert KVConnectorFactory.get_connector_class("ExampleConnector") is SharedStorageConnector
    assert ExampleConnector is SharedStorageConnector
    assert ExampleConnectorMetadata is SharedStorageConnectorMetadata
    with pytest.raises(ValueError, match="shared_storage_path"):
        validate_kv_transfer_config({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})


@pytest.mark.parametrize("p_name,d_name", [("ExampleConnector", "ExampleConnector"),
                                           ("SharedStorageConnector", "ExampleConnector")])
def test_pd_with_example_connector(tmp_path, tiny_llama_dir, p_name, d_name):
    """P stores under one name, D loads under the other: same folders, same output."""
    prompts = [{"prompt_token_ids": list(range(1, 20))}, {"prompt_token_ids": list(range(40, 57))}]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(
        model=tiny_llama_dir, block_size=BS, num_gpu_blocks_override=64,
        skip_tokenizer_init=True).generate(prompts, greedy, use_tqdm=False)]
    _llm(tiny_llama_dir, p_name, tmp_path).generate(
        prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    d = _llm(tiny_llama_dir, d_name, tmp_path)
    out = d.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert [o.num_cached_tokens for o in out] == [16, 16]
