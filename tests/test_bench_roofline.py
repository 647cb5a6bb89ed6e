"""bench roofline: the forward-time curve runs the paged model at every size, and the prediction
is tau / (verify + drafting) with the break-even where that is 1."""
import pytest
import torch

from minivllm.bench import roofline


def test_forward_curve_on_a_tiny_model(tiny_gqa_dir):
    from minivllm.model_executor.model_loader import load_model
    model = load_model(tiny_gqa_dir, torch.float32, torch.device("cpu"))
    curve = roofline.forward_curve(model, batches=(1, 3), max_q=4, context=20, rounds=1)
    assert set(curve) == {1, 3} and all(len(v) == 4 and min(v) > 0 for v in curve.values())


def test_predict_break_even_and_speed_up():
    curve = [10.0, 11.0, 12.0, 14.0]                 # forward ms at 1..4 tokens
    drafters = {"plain": dict(step_ms=20.0, tokens_per_s=50.0, draft_ms=0.0, tok_fwd=1.0),
                "x": dict(step_ms=30.0, tokens_per_s=80.0, draft_ms=5.0, tok_fwd=2.0)}
    p = roofline.predict(curve, drafters, k=3)["x"]
    assert p["verify_steps"] == pytest.approx((20 + 4) / 20)   # 4 tokens: 4 ms more than 1
    assert p["draft_steps"] == pytest.approx(0.25)
    assert p["break_even"] == pytest.approx(1.45)
    assert p["predicted"] == pytest.approx(2.0 / 1.45) and p["measured"] == pytest.approx(1.6)
