"""Few-row linear routes are chosen by timing, cached per shape, visible, and can be fixed."""
import pytest
import torch

from minivllm.model_executor import cpu_linear
from minivllm.model_executor import kernel_choice as kc
from minivllm.model_executor import route_timing as rt
from minivllm.model_executor.cpu_linear import process_weights_after_loading
from minivllm.model_executor.linear import Linear
from minivllm.model_executor.packed_weight import PackedWeight


@pytest.fixture(autouse=True)
def no_route_cache(monkeypatch):
    """These tests watch the timing itself: no choices from (or into) the on-disk cache."""
    monkeypatch.setenv("MINIVLLM_ROUTE_CACHE", "0")
    monkeypatch.setenv("MINIVLLM_TUNING_BUDGET_S", "inf")


def test_choice_is_timed_once_per_shape_and_bucket(monkeypatch):
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    calls = []
    real = rt._time_candidates

    def spy(x, ws, rounds=3, **kw):
        calls.append((x.shape[0], tuple(ws[0].shape), len(ws)))
        return real(x, ws, rounds, **kw)

    monkeypatch.setattr(rt, "_time_candidates", spy)
    w = torch.randn(40, 24)
    for m in (3, 4, 3, 1, 1):
        assert cpu_linear.choose(w, m) in kc.CANDIDATES
    assert calls == [(4, (40, 24), 1), (1, (40, 24), 1)]   # rows 3 and 4 share the bucket of 4
    key = ("cpu", "float32", 40, 24, 4)
    superseded = {kc.SUPERSEDES[n] for n in kc.PREPARE}    # packed oneDNN replaces plain oneDNN
    assert set(kc.CHOICES.timings_us[key]) == set(kc.CANDIDATES) - {"pad2"} - superseded  # pad2: 1 row
    assert "pad2" in kc.CHOICES.timings_us[("cpu", "float32", 40, 24, 1)]
    assert any(line.startswith("40x24 float32 on cpu: 1:") for line in kc.CHOICES.summary())


def test_a_candidate_must_beat_f_linear_clearly(monkeypatch):
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    fake = {2: {"f_linear": 100.0, "gemm_wx": 90.0},    # 10 % faster: noise, keep the default
            4: {"f_linear": 100.0, "gemm_wx": 40.0}}    # 2.5x faster: take it
    monkeypatch.setattr(rt, "_time_candidates", lambda x, ws, rounds=3, **kw: dict(fake[x.shape[0]]))
    w = torch.randn(8, 8)
    assert cpu_linear.choose(w, 2) == "f_linear" and cpu_linear.choose(w, 4) == "gemm_wx"


def test_forced_route_and_bad_value(monkeypatch):
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "gemm_wx")
    assert cpu_linear.choose(torch.randn(8, 8), 1) == "gemm_wx"
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "fast")
    with pytest.raises(ValueError, match="MINIVLLM_LINEAR_ROUTE"):
        cpu_linear.choose(torch.randn(8, 8), 1)


def test_module_caches_route_per_row_count(monkeypatch):
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "pad2")
    layer = Linear(8, 6, bias=True).requires_grad_(False)   # as after load_model
    process_weights_after_loading(layer)
    x = torch.randn(1, 8)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    routes = layer.quant_method._route_by_rows
    assert routes[1] == "pad2" and routes[2] is None


def test_choices_reachable_from_llm_engine(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    from conftest import tiny_llm
    llm = tiny_llm(tiny_llama_dir, dtype="float32")
    choices = llm.llm_engine.engine_core.worker.model_runner.model.kernel_choices
    model = llm.llm_engine.engine_core.worker.model_runner.model
    for mod in model.modules():
        if isinstance(mod, Linear):
            for m in kc.ROW_BUCKETS:
                key = ("cpu", "float32", *mod.weight.shape, m)
                assert choices.chosen[key] in kc.CANDIDATES


def test_tune_model_times_each_shape_over_all_its_weights(monkeypatch):
    """Every weight of one shape is timed in turn (streamed from memory, as a forward reads them),
    not one matrix over and over from the cache."""
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    seen = []
    monkeypatch.setattr(rt, "_time_candidates",
                        lambda x, ws, rounds=3, **kw: seen.append((x.shape[0], len(ws))) or
                        {"f_linear": 1.0})
    model = torch.nn.Sequential(*[Linear(16, 16) for _ in range(5)], Linear(16, 8))
    process_weights_after_loading(model)
    assert sorted(seen) == sorted([(m, 5) for m in kc.ROW_BUCKETS] + [(m, 1) for m in kc.ROW_BUCKETS])


@pytest.mark.parametrize("route", sorted(kc.CANDIDATES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_route_equals_f_linear(route, dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 48).to(dtype)
    for m in (1, 3, 32):
        x = torch.randn(m, 48).to(dtype)
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        operand = kc.PREPARE[route](w) if route in kc.PREPARE else w   # e.g. oneDNN's packed copy
        torch.testing.assert_close(kc.CANDIDATES[route](x, operand),
                                   torch.nn.functional.linear(x, w), **tol)


@pytest.mark.skipif(not kc.PREPARE, reason="this PyTorch build has no oneDNN weight packing")
def test_packed_weight_follows_writes_and_replacement_and_stays_one_parameter(monkeypatch):
    """A route on a prepared (packed) copy never computes with a stale copy: the copy *is* the
    weight, so writing it in place repacks it; a replaced plain parameter runs a plain route (no
    second copy). The state dict holds the weight and bias only, as plain values."""
    route = next(iter(kc.PREPARE))
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", route)
    torch.manual_seed(0)
    layer = Linear(48, 40, bias=True).requires_grad_(False)   # as after load_model
    process_weights_after_loading(layer)
    assert type(layer.weight) is PackedWeight and layer.weight.route == route
    x = torch.randn(3, 48)

    def check():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(
            x, layer.weight.detach().clone(), layer.bias), rtol=1e-5, atol=1e-4)
    check()
    with torch.no_grad():
        layer.weight.mul_(-2.0)                              # in place: repacked
    check()
    layer.weight = torch.nn.Parameter(torch.randn(40, 48), requires_grad=False)   # replaced
    check()
    assert layer.quant_method._route_by_rows[3] == cpu_linear.plain_route(route)
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert [n for n, _ in layer.named_buffers()] == []


@pytest.mark.skipif(not kc.PREPARE, reason="this PyTorch build has no oneDNN weight packing")
def test_gradients_reach_the_weight_whatever_the_route(monkeypatch):
    """Training through a ``Linear`` (an exercise fine-tuning a layer, say) must get the weight's
    gradient, also when the weight is held packed: with autograd on, the forward takes F.linear
    on the plain matrix; an optimizer step writes the packed weight."""
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", next(iter(kc.PREPARE)))
    torch.manual_seed(0)
    layer, ref = Linear(16, 8), torch.nn.Linear(16, 8)
    process_weights_after_loading(layer)
    assert type(layer.weight) is PackedWeight and layer.weight.requires_grad
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(40, 16)
    layer(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    for m in (layer, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    torch.testing.assert_close(layer.weight, ref.weight)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-4)


def test_many_rows_are_timed_on_a_few_weights_and_only_against_prepared_routes(monkeypatch):
    """Above MAX_TUNED_ROWS (a prefill chunk) a product is compute-bound: the bucket is timed over
    MANY_ROWS_WEIGHTS matrices of the shape, F.linear against the prepared-weight routes only."""
    seen = []
    monkeypatch.setitem(kc.CANDIDATES, "f_linear", lambda x, w: seen.append(id(w)) or x @ w.T)
    weights = [torch.randn(8, 16) for _ in range(5)]
    timings = rt._time_candidates(torch.randn(kc.MANY_ROWS, 16), weights, rounds=1)
    assert set(seen) == {id(w) for w in weights[:kc.MANY_ROWS_WEIGHTS]}
    assert set(timings) == {"f_linear"} | set(kc.prepare_operands(weights[:1]))


def test_packing_can_be_switched_off(monkeypatch):
    """``MINIVLLM_LINEAR_PACK=0``: routes are still timed, but no prepared copy is made or held."""
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    monkeypatch.setenv("MINIVLLM_LINEAR_PACK", "0")
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    model = torch.nn.Sequential(Linear(32, 24), Linear(24, 32)).requires_grad_(False)
    process_weights_after_loading(model)
    assert all(type(mod.weight) is not PackedWeight for mod in model)
    for timings in kc.CHOICES.timings_us.values():
        assert not set(timings) & set(kc.PREPARE) and "f_linear" in timings
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref = x
        for mod in model:
            ref = torch.nn.functional.linear(ref, mod.weight, mod.bias)
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("MINIVLLM_LINEAR_PACK", "maybe")
    with pytest.raises(ValueError, match="MINIVLLM_LINEAR_PACK"):
        kc.prepare_operands([torch.randn(4, 4)])
