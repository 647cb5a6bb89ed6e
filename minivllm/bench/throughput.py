"""``python -m minivllm.bench throughput``: minivllm against Hugging Face ``generate()``.

Two workloads on the same model and prompts, each in float32 and bfloat16:
- one request (batch 1, greedy, fixed output length);
- 32 concurrent requests of mixed prompt and output lengths. minivllm gets them all at once;
  Hugging Face gets one left-padded batch and must run until the longest output is done, so only the
  tokens each request asked for are counted for either engine.

``--sampling plain,logprobs,penalties`` adds minivllm cells whose requests also ask for
``logprobs=5``, or for penalties (frequency 0.5, presence 0.5, repetition 1.1), and prints their
throughput as a ratio to the plain cell: what vLLM 0.32's sampling options cost here.

Each (engine, dtype, workload) cell runs in its own subprocess, so its peak memory (max RSS on the
CPU, ``torch.cuda.max_memory_allocated`` on a GPU) is its own. Greedy outputs of the two engines
are compared token for token on the single request, as a sanity check of what is being timed.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

BASE_TEXT = ("The history of the printing press begins in the fifteenth century, when movable type "
             "changed how books were made, how ideas travelled and who could read them. ")
QUESTIONS = ["Summarise this.", "What came next?", "Write a short poem about it.",
             "List three consequences.", "Explain it to a child.", "Give a title for it."]


def make_workload(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, output length) pairs: prompts of 1-6 base sentences, outputs of 16-96 tokens."""
    rng = random.Random(seed)
    return [(BASE_TEXT * rng.randint(1, 6) + rng.choice(QUESTIONS), rng.randint(16, 96))
            for _ in range(n)]


def _peak_memory_mb(device: str) -> float:
    import resource

    import torch
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


SAMPLING = {"plain": {}, "logprobs": {"logprobs": 5},
            "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5,
                          "repetition_penalty": 1.1}}


def run_cell(engine: str, dtype: str, workload: str, single_tokens: int,
             sampling: str = "plain") -> dict:
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = [(BASE_TEXT * 2 + QUESTIONS[0], single_tokens)] if workload == "single" \
        else make_workload(32)
    useful = sum(n for _, n in work)
    if engine == "minivllm":
        from minivllm import LLM, SamplingParams
        llm = LLM(dtype=dtype)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **SAMPLING[sampling])
                  for _, n in work]
        llm.generate([p for p, _ in work[:1]], params[:1], use_tqdm=False)   # warm-up
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        first = outs[0].outputs[0].token_ids
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from minivllm.model_executor.model_loader import DEFAULT_MODEL, resolve_model_path
        path = resolve_model_path(DEFAULT_MODEL)
        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype)).to(device).eval()
        enc = tok([p for p, _ in work], return_tensors="pt", padding=True).to(device)
        max_new = max(n for _, n in work)
        # No EOS for either engine (minivllm: ignore_eos), so both produce every requested token.
        gen = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=None,
                   pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            model.generate(**tok([work[0][0]], return_tensors="pt").to(device),
                           max_new_tokens=4, do_sample=False)   # warm-up
            t0 = time.perf_counter()
            out = model.generate(**enc, **gen)
            elapsed = time.perf_counter() - t0
        produced = useful
        first = out[0, enc["input_ids"].shape[1]:][:work[0][1]].tolist()
    return {"engine": engine, "dtype": dtype, "workload": workload, "sampling": sampling,
            "requests": len(work),
            "tokens": produced, "seconds": elapsed, "tokens_per_s": useful / elapsed,
            "peak_mb": _peak_memory_mb(device), "first_output": first, "device": device}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workloads", default="single,batch32")
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--sampling", default="plain",
                    help=f"comma-separated, from {','.join(SAMPLING)} (minivllm only besides plain)")
    ap.add_argument("--cell", help=argparse.SUPPRESS)   # internal: run one cell, print JSON
    args = ap.parse_args(argv)
    if args.cell:
        engine, dtype, workload, sampling = (args.cell.split(":") + ["plain"])[:4]
        print("RESULT " + json.dumps(run_cell(engine, dtype, workload, args.single_tokens,
                                              sampling)))
        return
    variants = [v for v in args.sampling.split(",") if v != "plain"]
    unknown = set(variants) - set(SAMPLING)
    if unknown:
        raise SystemExit(f"--sampling: unknown {sorted(unknown)}; use {','.join(SAMPLING)}")

    cells = [(e, d, w, v) for d in args.dtypes.split(",") for w in args.workloads.split(",")
             for e, v in [("hf", "plain"), ("minivllm", "plain")] + [("minivllm", v) for v in variants]]
    results = {}
    for i, (e, d, w, v) in enumerate(cells, 1):
        print(f"[{i}/{len(cells)}] {e} {d} {w} {v} ...", flush=True)
        proc = subprocess.run([sys.executable, "-m", "minivllm.bench", "throughput",
                               "--cell", f"{e}:{d}:{w}:{v}", "--single-tokens",
                               str(args.single_tokens)], capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stderr[-3000:])
            raise SystemExit(f"cell {e}:{d}:{w}:{v} failed")
        results[(e, d, w, v)] = json.loads(line[0][len("RESULT "):])

    device = next(iter(results.values()))["device"]
    print(f"\nSmolLM2-135M-Instruct on {device}, greedy; tokens/s counts requested output tokens")
    head = f"{'dtype':9} {'workload':18} {'HF tok/s':>9} {'minivllm tok/s':>15} {'ratio':>6} " \
           f"{'HF peak MB':>11} {'minivllm peak MB':>17}"
    print(head)
    print("-" * len(head))
    for d in args.dtypes.split(","):
        for w in args.workloads.split(","):
            hf, mv = results[("hf", d, w, "plain")], results[("minivllm", d, w, "plain")]
            label = "1 request" if w == "single" else "32 requests, mixed"
            print(f"{d:9} {label:18} {hf['tokens_per_s']:9.1f} {mv['tokens_per_s']:15.1f} "
                  f"{mv['tokens_per_s'] / hf['tokens_per_s']:5.2f}x {hf['peak_mb']:11.0f} "
                  f"{mv['peak_mb']:17.0f}")
            if w == "single":
                same = hf["first_output"] == mv["first_output"]
                print(f"{'':9} {'':18} greedy outputs identical: {same}")
    if variants:
        print("\nminivllm with sampling options, tokens/s (ratio to plain, same run)")
        for d in args.dtypes.split(","):
            for w in args.workloads.split(","):
                plain = results[("minivllm", d, w, "plain")]["tokens_per_s"]
                label = "1 request" if w == "single" else "32 requests, mixed"
                row = "  ".join(f"{v} {results[('minivllm', d, w, v)]['tokens_per_s']:.1f} "
                                f"({results[('minivllm', d, w, v)]['tokens_per_s'] / plain:.2f}x)"
                                for v in variants)
                print(f"{d:9} {label:18} plain {plain:.1f}  {row}")


if __name__ == "__main__":
    main()
