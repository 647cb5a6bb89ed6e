"""RMSNorm's two paths (vLLM's CustomOp dispatch): ``forward_native``, Hugging Face's formula, and
``forward_cuda``, the fused ``F.rms_norm``, give the formula's numbers, to 1e-6 in float32 and
within one bfloat16 rounding step in bfloat16. ``F.rms_norm`` runs on a CPU too, so both paths are
called here directly; the GPU only decides which one ``forward`` is."""
from __future__ import annotations

import copy

import pytest
import torch

from minivllm.model_executor.layernorm import RMSNorm

HIDDEN, EPS = 96, 1e-5


def formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's ``LlamaRMSNorm.forward``, written out."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def bf16_step(v: torch.Tensor) -> torch.Tensor:
    """One bfloat16 rounding step (unit in the last place) at the magnitude of ``v``: 8 bits of
    mantissa, so 2 ** (exponent - 8) for ``|v| = m * 2 ** exponent``, ``m`` in [0.5, 1)."""
    _, exponent = torch.frexp(v.float().abs())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), exponent - 8)


def norm_and_inputs(dtype: torch.dtype) -> tuple[RMSNorm, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(HIDDEN, EPS)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(HIDDEN, generator=g))
    x = 3 * torch.randn(13, HIDDEN, generator=g)
    residual = torch.randn(13, HIDDEN, generator=g)
    return norm.to(dtype), x.to(dtype), residual.to(dtype)


@pytest.mark.parametrize("path", ["forward_native", "forward_cuda"])
def test_float32_paths_give_the_formulas_numbers(path):
    norm, x, residual = norm_and_inputs(torch.float32)
    forward = getattr(norm, path)
    with torch.no_grad():
        out = forward(x)
        out_r, summed = forward(x, residual)
    torch.testing.assert_close(out, formula(x, norm.weight, EPS), atol=1e-6, rtol=1e-6)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(out_r, formula(x + residual, norm.weight, EPS), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("path", ["forward_native", "forward_cuda"])
def test_bfloat16_paths_are_within_one_rounding_step(path):
    norm, x, residual = norm_and_inputs(torch.bfloat16)
    forward = getattr(norm, path)
    with torch.no_grad():
        out = forward(x)
        out_r, summed = forward(x, residual)
    assert out.dtype == out_r.dtype == torch.bfloat16
    assert torch.equal(summed, x + residual)
    for got, want in ((out, formula(x, norm.weight, EPS)),
                      (out_r, formula(x + residual, norm.weight, EPS))):
        err = (got.float() - want.float()).abs()
        step = torch.maximum(bf16_step(got), bf16_step(want))
        assert (err <= step).all(), f"{path}: {int((err > step).sum())} values off by more"
    if path == "forward_native":   # the formula itself, bit for bit
        assert torch.equal(out, formula(x, norm.weight, EPS))


def test_the_path_is_chosen_from_the_weights_device():
    norm = RMSNorm(HIDDEN, EPS)
    assert norm.forward == norm.forward_native   # built on the CPU
    with torch.device("meta"):
        meta = RMSNorm(HIDDEN, EPS)
    assert meta.to_empty(device="cpu").forward == meta.forward_native
    # forward is an instance attribute: norm(x) runs the chosen method, and so does a copy.
    x = torch.randn(2, HIDDEN)
    with torch.no_grad():
        assert torch.equal(norm(x), norm.forward_native(x))
    clone = copy.deepcopy(norm)
    assert clone.forward.__self__ is clone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_fused_path_is_chosen():
    with torch.device("meta"):
        norm = RMSNorm(HIDDEN, EPS)
    norm = norm.to_empty(device="cuda")   # as the model loader materialises a model
    assert norm.forward == norm.forward_cuda
    with torch.no_grad():
        norm.weight.fill_(1.5)
        for dtype, atol in ((torch.float32, 1e-6), (torch.bfloat16, None)):
            n = norm.to(dtype)
            x = torch.randn(7, HIDDEN, device="cuda").to(dtype)
            want = formula(x, n.weight, EPS)
            if atol is None:
                err = (n(x).float() - want.float()).abs()
                assert (err <= torch.maximum(bf16_step(n(x)), bf16_step(want))).all()
            else:
                torch.testing.assert_close(n(x), want, atol=atol, rtol=atol)
    assert norm.cpu().forward == norm.forward_native
