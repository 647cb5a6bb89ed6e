"""qkv_proj / gate_up_proj: the checkpoint's separate tensors are stacked at load, and the fused
model computes what separate projections compute."""
import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.linear import MergedColumnParallelLinear, QKVParallelLinear
from minivllm.model_executor.models.llama import LlamaForCausalLM, checkpoint_parameters


def test_qkv_shards_and_weight_loader():
    layer = QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=True)
    assert layer.weight.shape == (16, 8) and layer.output_sizes == [8, 4, 4]
    parts = {s: torch.randn(n, 8) for s, n in zip("qkv", (8, 4, 4))}
    for s, t in parts.items():
        layer.weight_loader(layer.weight, t, s)
    assert torch.equal(layer.weight, torch.cat([parts[s] for s in "qkv"]))
    x = torch.randn(3, 8)
    q, k, v = layer.split(layer(x))
    torch.testing.assert_close(k, F.linear(x, parts["k"], layer.bias[8:12]))
    with pytest.raises(ValueError, match="shard_id must be 'q', 'k' or 'v'"):
        layer.shard(layer.weight, 0)
    with pytest.raises(ValueError, match="shard 'v'"):
        layer.weight_loader(layer.weight, torch.randn(5, 8), "v")


def test_merged_shard_ids():
    layer = MergedColumnParallelLinear(4, [3, 5])
    assert layer.shard_range(1) == (3, 5)
    with pytest.raises(ValueError, match="shard_id must be in 0..1"):
        layer.shard_range(2)


def test_checkpoint_names_map_to_views(tiny_gqa_dir):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(tiny_gqa_dir)
    model = LlamaForCausalLM(cfg)
    names = checkpoint_parameters(model)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    q = names["model.layers.0.self_attn.q_proj.weight"]
    fused = model.model.layers[0].self_attn.qkv_proj.weight
    assert q.data_ptr() == fused.data_ptr() and q.shape[0] < fused.shape[0]   # a view, no copy
    up = names["model.layers.0.mlp.up_proj.weight"]
    assert up.shape == (cfg.intermediate_size, cfg.hidden_size)


def test_fused_model_equals_hf_separate_projections(tiny_gqa_dir):
    """Logits of the fused model (loaded from the HF checkpoint) match transformers' model, which
    keeps q/k/v and gate/up separate."""
    from transformers import AutoModelForCausalLM

    from minivllm.model_executor.model_loader import load_model
    hf = AutoModelForCausalLM.from_pretrained(tiny_gqa_dir, dtype=torch.float32).eval()
    ours = load_model(tiny_gqa_dir, torch.float32, torch.device("cpu"))
    sd = hf.state_dict()
    attn = ours.model.layers[1].self_attn
    want = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, want)
    mlp = ours.model.layers[1].mlp
    want = torch.cat([sd[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, want)
    x = torch.randn(5, hf.config.hidden_size)
    hf_mlp = hf.model.layers[1].mlp
    torch.testing.assert_close(mlp(x), hf_mlp(x), rtol=1e-5, atol=1e-5)
