"""``bench vllm``'s cells that need no vLLM: Hugging Face's and minivllm's, on a tiny random Llama
with SmolLM2's tokenizer (float32, greedy): the same token ids and counts in both, as the
throughput table compares them."""
from __future__ import annotations

import pytest

from minivllm.bench.vllm import run_cell


def test_hf_and_minivllm_cells_agree_on_a_tiny_llama(tiny_chat_dir):
    model = tiny_chat_dir
    workloads = {"1 request:1": ([[5, 9, 3, 17]], [12], True),
                 "3 requests, mixed": ([[5, 9], [7, 1, 2, 3, 4, 8], [11]], [6, 10, 3], True)}
    cells = {e: run_cell({"engine": e, "kind": "throughput", "dtype": "float32", "model": model,
                          "workloads": workloads}) for e in ("hf", "minivllm")}
    for name, (_, max_tokens, _) in workloads.items():
        hf, mv = cells["hf"][name], cells["minivllm"][name]
        assert hf["tokens"] == mv["tokens"] == sum(max_tokens)
        assert [len(o) for o in hf["outputs"]] == max_tokens
        assert hf["outputs"] == mv["outputs"], name        # left padding changes nothing
        assert hf["seconds"] > 0 and mv["seconds"] > 0


def test_a_relative_vllm_venv_path_is_made_absolute(tmp_path, monkeypatch):
    """The cells run in another working directory, so ``MINIVLLM_VLLM_VENV=.venv-vllm`` (the
    README's command) must resolve against the caller's directory before they start."""
    from minivllm.bench.vllm import vllm_python
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".minivllm-vllm-ready").write_text("0.32.0")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIVLLM_VLLM_VENV", "venv")
    assert vllm_python() == str(venv / "bin" / "python")
    monkeypatch.setenv("MINIVLLM_VLLM_VENV", "missing")
    with pytest.raises(SystemExit, match="no vLLM venv"):
        vllm_python()


def test_rounds_rotate_the_engines_and_keep_each_workloads_fastest_run():
    from minivllm.bench.vllm import keep_fastest, plan_jobs
    cells = [("throughput", "float32"), ("throughput", "bfloat16"), ("grounded", "float32")]
    jobs = plan_jobs(cells, ["hf"], rounds=3)
    assert len(jobs) == 3 * (3 + 3 + 2)
    assert plan_jobs(cells, ["hf"]) == jobs[:8]             # one round: the order it always had
    firsts = [jobs[r * 8] for r in range(3)]                # first cell, each round
    assert [e for e, _, _ in firsts] == ["minivllm", "vllm", "hf"]
    assert sorted(jobs[:3]) == sorted(jobs[8:11])           # the same cell's engines, reordered
    best: dict = {}
    keep_fastest(best, {"a": {"seconds": 2.0, "run": 1}, "b": {"seconds": 1.0, "run": 1}})
    keep_fastest(best, {"a": {"seconds": 1.5, "run": 2}, "b": {"seconds": 3.0, "run": 2}})
    assert best == {"a": {"seconds": 1.5, "run": 2}, "b": {"seconds": 1.0, "run": 1}}


def test_a_profiled_cell_gives_its_torch_ops_and_the_table_splits_the_wall_time(tiny_chat_dir):
    """``--profile-ops``: a minivllm cell run under torch.profiler gives each op's own seconds
    (the linears among them), and the table puts each engine's wall time beside its ops' time."""
    from minivllm.bench.vllm import _ops_table
    res = run_cell({"engine": "minivllm", "kind": "throughput", "dtype": "float32",
                    "model": tiny_chat_dir, "profile_ops": True,
                    "workloads": {"2 requests": ([[5, 9, 3], [7, 1]], [6, 4], True)}})["2 requests"]
    ops = res["ops"]
    assert ops and all(s >= 0 for s in ops.values()) and 0 < sum(ops.values()) < res["seconds"]
    assert any("linear" in name or name in ("aten::mm", "aten::addmm") for name in ops)
    table = _ops_table("2 requests", {"minivllm": res, "vllm": {"seconds": 1.0,
                                                                 "ops": {"_C::onednn_mm": 0.6}}})
    top = max(ops, key=ops.get)
    assert f"outside them {res['seconds'] - sum(ops.values()):6.2f} s" in table
    assert top[:50] in table.splitlines()[4] and "_C::onednn_mm" in table.splitlines()[4]
