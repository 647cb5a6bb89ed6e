"""The CPU-routed linear layer gives F.linear's result for every row count and dtype."""
import pytest
import torch
import torch.nn.functional as F

from minivllm.model_executor.cpu_linear import linear
from minivllm.model_executor.linear import Linear


@pytest.mark.parametrize("route", [None, "f_linear", "gemm_wx", "pad2"])   # None: as measured
@pytest.mark.parametrize("rows", [1, 2, 4, 33, 300])
@pytest.mark.parametrize("shape", [(64, 48), (4096, 1100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear(rows, shape, dtype, route):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(shape, generator=g).to(dtype)
    b = torch.randn(shape[0], generator=g).to(dtype)
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for bias in (None, b):
        got, want = linear(x, w, bias, route), F.linear(x, w, bias)
        assert got.shape == want.shape and got.is_contiguous() and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * shape[1] ** 0.5)


def test_linear_module_keeps_nn_linear_parameters():
    layer = Linear(8, 5, bias=True)
    assert isinstance(layer, torch.nn.Linear)
    assert sorted(n for n, _ in layer.named_parameters()) == ["bias", "weight"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
