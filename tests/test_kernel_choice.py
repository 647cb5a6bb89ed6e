"""Few-row linear routes are chosen by timing, cached per shape, visible, and can be fixed."""
import pytest
import torch

from minivllm.model_executor import kernel_choice as kc
from minivllm.model_executor.linear import Linear


def test_choice_is_timed_once_per_shape_and_bucket(monkeypatch):
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    calls = []
    real = kc._time_candidates

    def spy(x, w, rounds=3):
        calls.append((x.shape[0], tuple(w.shape)))
        return real(x, w, rounds)

    monkeypatch.setattr(kc, "_time_candidates", spy)
    w = torch.randn(40, 24)
    for m in (3, 4, 3, 1, 1):
        assert kc.choose(w, m) in kc.CANDIDATES
    assert calls == [(4, (40, 24)), (1, (40, 24))]   # rows 3 and 4 share the bucket of 4
    key = ("cpu", "float32", 40, 24, 4)
    assert set(kc.CHOICES.timings_us[key]) == {"f_linear", "gemm_wx"}   # pad2 is for 1 row only
    assert "pad2" in kc.CHOICES.timings_us[("cpu", "float32", 40, 24, 1)]
    assert any(line.startswith("40x24 float32 on cpu: 1:") for line in kc.CHOICES.summary())


def test_a_candidate_must_beat_f_linear_clearly(monkeypatch):
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    fake = {2: {"f_linear": 100.0, "gemm_wx": 90.0},    # 10 % faster: noise, keep the default
            4: {"f_linear": 100.0, "gemm_wx": 40.0}}    # 2.5x faster: take it
    monkeypatch.setattr(kc, "_time_candidates", lambda x, w, rounds=3: dict(fake[x.shape[0]]))
    w = torch.randn(8, 8)
    assert kc.choose(w, 2) == "f_linear" and kc.choose(w, 4) == "gemm_wx"


def test_forced_route_and_bad_value(monkeypatch):
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "gemm_wx")
    assert kc.choose(torch.randn(8, 8), 1) == "gemm_wx"
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "fast")
    with pytest.raises(ValueError, match="MINIVLLM_LINEAR_ROUTE"):
        kc.choose(torch.randn(8, 8), 1)


def test_module_caches_route_per_row_count(monkeypatch):
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "pad2")
    layer = Linear(8, 6, bias=True)
    x = torch.randn(1, 8)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer._route_by_rows[1] == "pad2" and layer._route_by_rows[2] is None


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
