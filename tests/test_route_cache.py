"""Linear route choices kept on disk (model_executor/route_cache.py): the first process times the
shapes and writes them; a later one reads them and times nothing; a file for another machine, or
one that cannot be read, is ignored (with a warning for the latter) and timed again."""
import json
import os
import subprocess
import sys

import pytest
import torch

from minivllm.model_executor import cpu_linear
from minivllm.model_executor import kernel_choice as kc
from minivllm.model_executor import route_timing as rt
from minivllm.model_executor import route_cache
from minivllm.model_executor.cpu_linear import process_weights_after_loading
from minivllm.model_executor.linear import Linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MINIVLLM_ROUTE_CACHE", raising=False)
    monkeypatch.delenv("MINIVLLM_LINEAR_ROUTE", raising=False)
    monkeypatch.setenv("MINIVLLM_TUNING_BUDGET_S", "inf")
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    timed = []
    real = rt._time_candidates
    monkeypatch.setattr(rt, "_time_candidates",
                        lambda x, ws, rounds=1, **kw: timed.append(tuple(ws[0].shape)) or
                        real(x, ws, 1, **kw))
    return tmp_path, timed


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(16, 24), Linear(24, 16)).requires_grad_(False)


def test_a_second_process_reads_the_choices_and_times_nothing(cache, monkeypatch):
    tmp, timed = cache
    process_weights_after_loading(model())
    assert len(timed) == 2 * len(kc.ROW_BUCKETS)          # two shapes, every row bucket
    files = [f for f in os.listdir(tmp) if f.startswith("linear-routes-")]
    assert len(files) == 1
    first = dict(kc.CHOICES.chosen)
    stored = json.load(open(tmp / files[0]))
    assert stored["machine"]["torch"] == torch.__version__
    assert {tuple(c[:5]): c[5] for c in stored["choices"]} == first
    # A new process: an empty in-memory table, the same file.
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    timed.clear()
    m = model()
    process_weights_after_loading(m)
    assert timed == [] and kc.CHOICES.chosen == first
    x = torch.randn(3, 16)
    torch.testing.assert_close(m(x), torch.nn.functional.linear(
        torch.nn.functional.linear(x, m[0].weight, m[0].bias), m[1].weight, m[1].bias),
        rtol=1e-5, atol=1e-5)


def test_another_machine_or_an_unreadable_file_is_timed_again(cache, monkeypatch, caplog):
    tmp, timed = cache
    key = route_cache.machine(kc.packing_allowed())
    path = route_cache.path_for(key)
    os.makedirs(tmp, exist_ok=True)
    with open(path, "w") as fh:          # same file name, another CPU inside: not ours
        json.dump({"format": 1, "machine": {**key, "cpu": "another"},
                   "choices": [["cpu", "float32", 24, 16, 1, "gemm_wx"]]}, fh)
    process_weights_after_loading(model())
    assert len(timed) == 2 * len(kc.ROW_BUCKETS)
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    timed.clear()
    with open(path, "w") as fh:
        fh.write('{"format": 1, "machine": ')   # truncated
    with caplog.at_level("WARNING", logger="minivllm.kernel_choice"):
        process_weights_after_loading(model())
    assert len(timed) == 2 * len(kc.ROW_BUCKETS)
    assert "ignoring the linear route cache" in caplog.text
    assert json.load(open(path))["machine"] == key    # rewritten whole


def test_the_key_names_what_a_choice_depends_on():
    key = route_cache.machine(True)
    assert set(key) == {"cpu", "flags", "torch", "threads", "packing"}
    assert route_cache.path_for(key) != route_cache.path_for({**key, "threads": key["threads"] + 1})
    assert route_cache.path_for(key) != route_cache.path_for({**key, "packing": False})


def test_off_switch_and_pinned_route(cache, monkeypatch):
    tmp, timed = cache
    monkeypatch.setenv("MINIVLLM_ROUTE_CACHE", "0")
    process_weights_after_loading(model())
    assert timed and not os.listdir(tmp)
    monkeypatch.delenv("MINIVLLM_ROUTE_CACHE")
    monkeypatch.setenv("MINIVLLM_LINEAR_ROUTE", "gemm_wx")
    m = model()
    process_weights_after_loading(m)
    assert not os.listdir(tmp) and m[0].quant_method.apply(m[0], torch.randn(2, 16)).shape == (2, 24)
    assert cpu_linear.choose(m[0].weight, 2) == "gemm_wx"


def test_llm_in_a_fresh_process_uses_the_stored_choices(tiny_llama_dir, tmp_path):
    """Two processes, one after the other, each building an LLM: the second times no shape."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "sys.path.insert(0, 'tests')\nfrom conftest import tiny_llm\n"
            f"llm = tiny_llm({tiny_llama_dir!r}, dtype='float32')\n"
            "print('CHOSEN', len(llm.llm_engine.engine_core.worker.model_runner.model"
            ".kernel_choices.chosen))\n")
    env = {**os.environ, "MINIVLLM_CACHE_DIR": str(tmp_path), "PYTHONPATH": ROOT,
           "MINIVLLM_TUNING_BUDGET_S": "inf"}
    env.pop("MINIVLLM_LINEAR_ROUTE", None)
    env.pop("MINIVLLM_ROUTE_CACHE", None)
    outs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    for out in outs:
        assert out.returncode == 0, out.stderr[-3000:]
    timed = [int(o.stdout.split(" shapes timed")[0].rsplit(", ", 1)[1]) for o in outs]
    assert timed[0] > 0 and timed[1] == 0, [o.stdout[-500:] for o in outs]
    assert outs[0].stdout.split("CHOSEN")[1] == outs[1].stdout.split("CHOSEN")[1]


def test_the_tuning_budget_leaves_the_rest_on_f_linear_for_a_later_process(cache, monkeypatch):
    """Budget 0: nothing is timed, every layer runs F.linear, nothing is stored; the next process
    (no limit) times all of it and stores it. Within a budget, decode rows (1) come first."""
    tmp, timed = cache
    monkeypatch.setenv("MINIVLLM_TUNING_BUDGET_S", "0")
    m = model()
    process_weights_after_loading(m)
    assert timed == [] and set(kc.CHOICES.chosen.values()) == {"f_linear"}
    assert kc.CHOICES.provisional == set(kc.CHOICES.chosen) and not os.listdir(tmp)
    x = torch.randn(2, 16)
    torch.testing.assert_close(m[0](x), torch.nn.functional.linear(x, m[0].weight, m[0].bias))
    monkeypatch.setattr(kc, "CHOICES", kc.KernelChoices())
    monkeypatch.setenv("MINIVLLM_TUNING_BUDGET_S", "inf")
    process_weights_after_loading(model())
    assert len(timed) == 2 * len(kc.ROW_BUCKETS) and not kc.CHOICES.provisional
    assert len(json.load(open(tmp / os.listdir(tmp)[0]))["choices"]) == 2 * len(kc.ROW_BUCKETS)
    order = [key[4] for key in kc.CHOICES.timings_us]      # dicts keep the timing order
    assert order == sorted(order) and order[:2] == [1, 1]
    monkeypatch.setenv("MINIVLLM_TUNING_BUDGET_S", "soon")
    with pytest.raises(ValueError, match="MINIVLLM_TUNING_BUDGET_S"):
        kc.tuning_budget()
