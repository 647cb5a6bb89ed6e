"""The linear seam (vLLM's ``quant_method.apply``): a fresh layer computes with plain F.linear, the
CPU's measured routes are a method set once after loading, and ``linear.py`` does not know them."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.cpu_linear import (CPUUnquantizedLinearMethod,
                                                process_weights_after_loading)
from minivllm.model_executor.linear import Linear, QKVParallelLinear, UnquantizedLinearMethod


@pytest.fixture(autouse=True)
def no_route_cache(monkeypatch):
    monkeypatch.setenv("MINIVLLM_ROUTE_CACHE", "0")   # choices timed here, none from disk


def test_a_fresh_layer_is_plain_f_linear():
    layer = QKVParallelLinear(16, head_size=4, total_num_heads=4, total_num_kv_heads=2, bias=True)
    assert type(layer.quant_method) is UnquantizedLinearMethod
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_processing_sets_the_cpu_method_once_and_keeps_shared_layers(monkeypatch):
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    shared = Linear(16, 8)
    target = torch.nn.Sequential(Linear(8, 16), shared).requires_grad_(False)
    process_weights_after_loading(target)
    assert all(isinstance(mod.quant_method, CPUUnquantizedLinearMethod) for mod in target)
    method = shared.quant_method
    draft = torch.nn.Sequential(Linear(8, 16), shared).requires_grad_(False)   # borrows `shared`
    process_weights_after_loading(draft)
    assert shared.quant_method is method and isinstance(draft[0].quant_method,
                                                        CPUUnquantizedLinearMethod)
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = F.linear(F.linear(x, target[0].weight, target[0].bias), shared.weight, shared.bias)
        torch.testing.assert_close(target(x), want, rtol=1e-5, atol=1e-4)


def test_f_linear_route_leaves_every_layer_plain(monkeypatch):
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "f_linear")
    model = torch.nn.Sequential(Linear(8, 16), Linear(16, 8)).requires_grad_(False)
    process_weights_after_loading(model)
    assert all(type(mod.quant_method) is UnquantizedLinearMethod for mod in model)


def test_loaded_model_layers_have_the_cpu_method(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    from minivllm.model_executor.model_loader import load_model
    model = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"))
    layers = [mod for mod in model.modules() if isinstance(mod, Linear)]
    assert layers and all(isinstance(m.quant_method, CPUUnquantizedLinearMethod) for m in layers)


def test_linear_does_not_import_the_fast_path():
    code = ("import sys, minivllm.model_executor.linear; "
            "print([m for m in sys.modules if 'kernel_choice' in m or 'cpu_linear' in m])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
