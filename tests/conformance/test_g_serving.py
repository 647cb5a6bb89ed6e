"""Case g: serving, measured by a client nobody here wrote. vLLM's own ``vllm bench serve
--backend openai --dataset-name random`` (8 prompts, 128 tokens in, 64 out, ``--ignore-eos``,
greedy) runs against ``minivllm serve`` (default model, float32) and must complete every request
with every output token; the same client also runs against ``vllm serve`` (same model, float32,
eager; measured first, each server alone) for a side-by-side row: TTFT, TPOT, output tok/s. The
row is printed (``pytest -s``) and written as JSON to ``$MINIVLLM_CONFORMANCE_OUT`` (or the
test's tmp dir).

The vLLM side (vllm_side/g_bench.py) runs the client both times and owns ``vllm serve``; this file
owns the minivllm server (tests/server_utils.py, stopped by its PID).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from server_utils import free_port, start_server, stop  # noqa: E402

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 128, 64
NAME = "SmolLM2-135M-Instruct"
FIELDS = ("completed", "failed", "total_output_tokens", "mean_ttft_ms", "median_ttft_ms",
          "mean_tpot_ms", "median_tpot_ms", "output_throughput", "request_throughput", "duration")


def test_vllm_bench_serve_against_both_servers(vllm_side, conformance_model, tmp_path):
    # The vLLM side starts first (`vllm serve` boots for ~25 s) and measures vLLM, then minivllm:
    # the minivllm server boots meanwhile, on a port chosen here.
    port = free_port()
    job = ("g_bench.py", {"minivllm_url": f"http://127.0.0.1:{port}", "model": conformance_model,
                          "served_model_name": NAME, "num_prompts": NUM_PROMPTS,
                          "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "timeout": 300})
    vllm_side.start(*job)
    url, proc = start_server(["--served-model-name", NAME, "--dtype", "float32",
                              "--max-model-len", "1024", "--host", "127.0.0.1"],
                             str(tmp_path / "minivllm_serve.log"), timeout=240, port=port)
    try:
        res = vllm_side(*job)
    finally:
        stop(proc)
    row = {engine: {k: res[engine].get(k) for k in FIELDS} for engine in ("minivllm", "vllm")}
    row["vllm_serve_start_s"] = res["vllm_serve_start_s"]
    out = Path(os.environ.get("MINIVLLM_CONFORMANCE_OUT") or tmp_path) / "g_serving.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=2))
    print(f"\nvllm bench serve, {NUM_PROMPTS} prompts, random {INPUT_LEN} in / {OUTPUT_LEN} out, "
          f"float32, 2 cores ({out}):")
    print(f"{'server':<10} {'done':>5} {'TTFT mean ms':>13} {'TPOT mean ms':>13} {'out tok/s':>10}")
    for engine in ("minivllm", "vllm"):
        r = row[engine]
        print(f"{engine:<10} {r['completed']:>2}/{NUM_PROMPTS} {r['mean_ttft_ms']:>13.1f} "
              f"{r['mean_tpot_ms']:>13.1f} {r['output_throughput']:>10.1f}")
    for engine in ("minivllm", "vllm"):
        r = row[engine]
        assert r["completed"] == NUM_PROMPTS and r["failed"] == 0, (engine, r)
        assert r["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, (engine, r)
        assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0 and r["output_throughput"] > 0
