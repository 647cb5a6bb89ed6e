"""``python -m minivllm.bench pd`` has the pull column: D's TTFT with the prompt pulled from P's
blocks, the tokens pulled and the MiB/s, with every instance agreeing on the first token."""
from __future__ import annotations


def test_pd_benchmark_pull_column(tiny_gqa_dir, capsys):
    from minivllm.bench.pd import main
    rows = main(["--model", tiny_gqa_dir, "--lengths", "24,40", "--block-size", "8", "--no-redis"])
    assert [(r["prompt_tokens"], r["pull_loaded_tokens"]) for r in rows] == [(24, 24), (40, 40)]
    assert all(r["same_first_token"] and r["ttft_pull"] > 0 and r["pull_mb_s"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "pull/recompute" in out and "pull MiB/s" in out
