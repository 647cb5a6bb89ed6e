"""One copy of each weight: a layer whose route reads a packed copy holds only that copy (as vLLM's
CPU build does), and ``layer.weight`` still reads, writes, saves and shares as the plain matrix."""
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F

from conftest import generate_tokens, runner_of, tiny_llm
from minivllm.model_executor import kernel_choice as kc
from minivllm.model_executor.cpu_linear import (CPUUnquantizedLinearMethod, plain_route,
                                                process_weights_after_loading)
from minivllm.model_executor.linear import Linear
from minivllm.model_executor.packed_weight import PackedWeight
from minivllm.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not kc.PREPARE, reason="this PyTorch build has no oneDNN packing")
ROUTE = next(iter(kc.PREPARE), None)


@pytest.fixture(autouse=True)
def no_route_cache(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ROUTE_CACHE", "0")
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())


def tensors_held(layer: Linear) -> list[torch.Tensor]:
    """Every tensor the layer or its method holds: parameters, buffers, attributes."""
    found = list(layer._parameters.values()) + list(layer._buffers.values())
    stack = list(vars(layer).values()) + list(vars(layer.quant_method).values())
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return [t for t in found if t is not None]


def plain_bytes(layer: Linear) -> int:
    """Bytes of plain (strided, not packed) storage the layer holds in weight-sized tensors."""
    seen, total = set(), 0
    for t in tensors_held(layer):
        if type(t) is PackedWeight or t.layout != torch.strided or t.dim() != 2:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_of(*layers):
    return torch.nn.Sequential(*layers).requires_grad_(False)


@pytest.mark.parametrize("how", ["forced", "timed", "cached"])
def test_a_packed_layer_holds_one_copy_and_reads_as_the_plain_weight(monkeypatch, how):
    """Forced, chosen by the load's timing (its packed copies adopted) or read from the route
    cache (packed at load): the plain weight is freed, ``weight`` equals it, outputs equal
    F.linear on it, the state dict is unchanged."""
    torch.manual_seed(0)
    model = model_of(Linear(48, 40, bias=True), Linear(40, 48), Linear(40, 48))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    if how == "forced":
        monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", ROUTE)
    else:
        monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
        monkeypatch.setenv("MINIVLLM_TUNING_BUDGET_S", "inf")
        for mod in model:
            for m in kc.ROW_BUCKETS:   # what a cache (or a timing, below) chose: 1 row plain
                key = kc.shape_key(mod.weight, m)
                if how == "cached":
                    kc.CHOICES.chosen[key] = "gemm_wx" if m == 1 else ROUTE
        if how == "timed":
            from minivllm.model_executor import route_timing as rt
            monkeypatch.setattr(rt, "_time_candidates", lambda x, ws, rounds=3, prepared=None: {
                "f_linear": 10.0, "gemm_wx": 1.0 if x.shape[0] == 1 else 20.0, ROUTE: 2.0})
    plain = [weakref.ref(mod.weight) for mod in model]
    process_weights_after_loading(model)
    gc.collect()
    assert all(ref() is None for ref in plain)             # the plain tensors are gone
    for mod in model:
        assert type(mod.weight) is PackedWeight and plain_bytes(mod) == 0
    assert set(model.state_dict()) == set(original)
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k]), k
    for m in (1, 3, 40):                                    # 1 row runs the packed route too
        for i, mod in enumerate(model):
            x = torch.randn(m, mod.in_features)
            with torch.no_grad():
                torch.testing.assert_close(mod(x), F.linear(x, original[f"{i}.weight"],
                                                            original.get(f"{i}.bias")),
                                           rtol=1e-5, atol=1e-4)
    fresh = model_of(torch.nn.Linear(48, 40), torch.nn.Linear(40, 48), torch.nn.Linear(40, 48))
    fresh.load_state_dict(model.state_dict())               # a plain model from the state dict
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in original.items())
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert type(loaded["0.weight"]) is torch.Tensor and torch.equal(loaded["0.weight"],
                                                                    original["0.weight"])


def test_before_this_change_a_layer_held_both_copies_now_one(monkeypatch):
    """The accounting the test above relies on: a plain weight counts, a packed one does not."""
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", ROUTE)
    layer = Linear(64, 32).requires_grad_(False)
    assert plain_bytes(layer) == 64 * 32 * 4
    process_weights_after_loading(layer)
    with torch.no_grad():
        layer(torch.randn(2, 64))
    assert plain_bytes(layer) == 0
    assert not any(t.layout == torch._mkldnn for t in tensors_held(layer))   # none beside it


def test_a_weight_tied_to_the_embeddings_stays_plain_and_shared(tiny_llama_dir, monkeypatch):
    """The tiny model's lm_head is the embedding table: it stays the embedding's plain tensor
    (the embedding reads rows of it) and runs the plain counterpart of the packed route; the
    projections are packed."""
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", ROUTE)
    from minivllm.model_executor.model_loader import load_model
    model = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.lm_head.weight) is not PackedWeight
    layer = model.model.layers[0]
    assert type(layer.self_attn.qkv_proj.weight) is PackedWeight
    assert type(layer.mlp.down_proj.weight) is PackedWeight
    h = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(model.compute_logits(h), h @ model.lm_head.weight.T,
                                   rtol=1e-5, atol=1e-4)
    assert model.lm_head.quant_method._route_by_rows[3] == plain_route(ROUTE)
    assert plain_route(ROUTE) not in kc.PREPARE


def test_layers_sharing_one_weight_share_one_packed_copy(monkeypatch):
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", ROUTE)
    a, b = Linear(16, 8, bias=False), Linear(16, 8, bias=False)
    b.weight = a.weight
    model = model_of(a, b)
    process_weights_after_loading(model)
    assert a.weight is b.weight and type(a.weight) is PackedWeight


def test_writes_through_the_weight_and_its_views_reach_the_packed_copy(monkeypatch):
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", ROUTE)
    torch.manual_seed(0)
    layer = Linear(32, 24, bias=False).requires_grad_(False)
    want = layer.weight.detach().clone()
    process_weights_after_loading(layer)
    w = layer.weight
    with torch.no_grad():
        w.data.copy_(want * 2)                  # .data is an alias of the packed copy
        want *= 2
        w[3] = 0.0
        want[3] = 0.0
        w.narrow(0, 10, 4).copy_(torch.ones(4, 32))   # what a shard weight_loader does
        want[10:14] = 1.0
        torch.add(want, 1.0, out=w)
        want += 1.0
    assert type(layer.weight) is PackedWeight and torch.equal(layer.weight, want)
    x = torch.randn(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, want), rtol=1e-5, atol=1e-4)
    with pytest.raises(TypeError, match="PackedWeight"):
        layer.to(torch.bfloat16)                # no silent dtype change of a packed copy
    layer.to("cpu")                             # a no-op conversion is fine
    assert torch.equal(layer.weight, want)


def test_a_module_sharing_the_packed_weight_runs_the_route(monkeypatch):
    """A module that borrows the weight (a self-draft built from the target's state dict) calls
    plain F.linear on it, which runs the route on the packed copy, not an unpack per call."""
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", ROUTE)
    layer = Linear(32, 24).requires_grad_(False)
    process_weights_after_loading(layer)
    borrower = torch.nn.Linear(32, 24, device="meta")
    borrower.load_state_dict(layer.state_dict(), assign=True)
    assert borrower.weight._box is layer.weight._box
    unpacked = []
    monkeypatch.setitem(kc.UNPACK, ROUTE, lambda p: unpacked.append(1) or p.to_dense())
    x = torch.randn(5, 32)
    with torch.inference_mode():
        y = borrower(x)
    assert unpacked == []
    torch.testing.assert_close(y, F.linear(x, layer.weight.dense(), layer.bias),
                               rtol=1e-5, atol=1e-4)


def test_greedy_outputs_equal_f_linear_with_packed_weights(tiny_gqa_dir, monkeypatch):
    """An untied tiny model (every projection and the LM head packed) generates the same greedy
    tokens as with F.linear, and its runner's model holds no plain projection weight."""
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "f_linear")
    want = generate_tokens(tiny_llm(tiny_gqa_dir, dtype="float32"), prompts, params)
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", ROUTE)
    llm = tiny_llm(tiny_gqa_dir, dtype="float32")
    model = runner_of(llm).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(type(m.weight) is PackedWeight and
                           isinstance(m.quant_method, CPUUnquantizedLinearMethod) for m in linears)
    assert generate_tokens(llm, prompts, params) == want
