"""The GPU check script runs its checks (interpreted, small shapes) and passes on the CPU, so a task
that is lent a GPU can run it as one command."""
from minivllm.bench import gpu


def test_gpu_checks_pass_interpreted(capsys):
    gpu._results.clear()
    gpu.main(["--quick"])
    out = capsys.readouterr().out
    assert "0 failed" in out and "[FAIL]" not in out
    names = [n for n, _, _ in gpu._results]
    assert any(n.startswith("attention") for n in names)
    assert any(n.startswith("rejection sampler") for n in names)
    assert "engine greedy: triton == torch backend" in names
