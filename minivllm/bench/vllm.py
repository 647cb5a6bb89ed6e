"""``python -m minivllm.bench vllm``: minivllm beside the real vLLM 0.32 (CPU build), same inputs.

Two tables, on SmolLM2-135M-Instruct, greedy, every prompt given to both engines as the same
token ids:
- throughput, float32 and bfloat16: one request of 64 tokens, and ``bench throughput``'s 32 mixed
  requests (prompts of 1-6 sentences, 16-96 output tokens, ``ignore_eos``), tokens/s of
  ``generate`` after a warm-up;
- n-gram speculative decoding with the article's config (k=3, prompt_lookup 3..5) on
  ``bench spec``'s prompts (input-grounded and open, 2 prompts one at a time and 8 at once, up to
  ``--max-tokens``, stopping at EOS): tokens/s and vLLM's counters (drafts, draft tokens,
  accepted, per-position acceptance, mean acceptance length ``1 + accepted / drafts``); the
  same for suffix decoding (k=3, vLLM's defaults) on ``bench spec``'s repeated workload.

The throughput table also has Hugging Face ``generate()`` (one left-padded batch for the 32
requests, counting only the tokens each asked for, as ``bench throughput``; ``--no-hf`` drops it)
and, with ``--vllm-compiled``, vLLM without ``enforce_eager`` (its torch.compile path: a start of a
minute or two more per cell).

Each cell, (engine, dtype) for throughput and (engine, prompt kind) for spec, runs in its own
process; the cells alternate between the engines, so a change in machine load hits all alike.
``--rounds N`` runs every cell N times (the order rotating each round) and keeps each workload's
fastest run: on a machine whose speed swings from one process to the next, one run per cell can
land on a slow spell.
vLLM runs from its own venv (``bash tests/conformance/setup_vllm.sh``; ``MINIVLLM_VLLM_VENV``)
with ``enforce_eager=True`` and a 1 GiB KV cache, under ``flock /tmp/minivllm-vllm.lock``. This
file is also the vLLM-side script: run by the vLLM venv's python it imports only vLLM.
Ratios from one run are what count, not absolute numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3,
         "prompt_lookup_max": 5}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}   # vLLM's suffix_decoding_* defaults
METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
           "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


# ---------------------------------------------------------------------------------------------
# One cell, in either engine. ``cell``: {"engine", "kind": "throughput"|"spec"|"suffix", "dtype",
# "model", "workloads": {name: [[prompt ids], [max_tokens], ignore_eos]}}.

def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in METRICS:
            out[m.name] = list(m.values) if hasattr(m, "values") else int(m.value)
    return out


def run_hf_cell(cell: dict) -> dict:
    """Hugging Face ``generate()``: each workload as one left-padded greedy batch run to its longest
    output (no EOS), counting the tokens each prompt asked for (``bench throughput``'s rule)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(cell["model"],
                                                 dtype=getattr(torch, cell["dtype"])).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def batch(prompts):
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return {"input_ids": ids, "attention_mask": mask}
    results = {}
    with torch.no_grad():
        model.generate(**batch([[1, 2, 3]]), max_new_tokens=4, do_sample=False)   # warm-up
        for name, (prompts, max_tokens, _) in cell["workloads"].items():
            enc = batch(prompts)
            t0 = time.perf_counter()
            out = model.generate(**enc, do_sample=False, max_new_tokens=max(max_tokens),
                                 eos_token_id=None, pad_token_id=pad)
            seconds = time.perf_counter() - t0
            new = out[:, enc["input_ids"].shape[1]:]
            results[name] = {"seconds": seconds, "tokens": sum(max_tokens),
                             "outputs": [new[i, :n].tolist() for i, n in enumerate(max_tokens)]}
    return results


def _op_profiler():
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU])


def _op_times(profiler) -> dict:
    """Seconds per torch op (self time, the op's own work), from ``torch.profiler``."""
    return {e.key: e.self_cpu_time_total / 1e6 for e in profiler.key_averages()}


def run_cell(cell: dict) -> dict:
    spec = {"spec": NGRAM, "suffix": SUFFIX}.get(cell["kind"])
    if cell["engine"] == "hf":
        return run_hf_cell(cell)
    if cell["engine"].startswith("vllm"):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=cell["model"], dtype=cell["dtype"], enforce_eager=cell["engine"] == "vllm",
                  disable_log_stats=False, speculative_config=spec, max_model_len=2048, seed=0)

        def gen(prompts, params):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        from minivllm import LLM, SamplingParams
        llm = LLM(model=cell["model"], dtype=cell["dtype"], speculative_config=spec)

        def gen(prompts, params):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    gen([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8))       # warm-up
    results = {}
    for name, (prompts, max_tokens, ignore_eos) in cell["workloads"].items():
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
                  for n in max_tokens]
        groups = [[i] for i in range(len(prompts))] if name.endswith(":1") else \
            [list(range(len(prompts)))]
        before = _counters(llm) if spec else {}
        profiler = _op_profiler() if cell.get("profile_ops") else None
        t0 = time.perf_counter()
        outputs = []
        with profiler or contextlib.nullcontext():
            for g in groups:
                outputs += gen([prompts[i] for i in g], [params[i] for i in g])
        seconds = time.perf_counter() - t0
        res = {"seconds": seconds, "tokens": sum(map(len, outputs)), "outputs": outputs}
        if profiler is not None:
            res["ops"] = _op_times(profiler)
        if spec:
            after = _counters(llm)
            res["counters"] = {n: ([a - b for a, b in zip(after[n], before[n])]
                                   if isinstance(after[n], list) else after[n] - before[n])
                               for n in METRICS}
        results[name] = res
    return results


# ---------------------------------------------------------------------------------------------
# The driver (minivllm's venv).

def vllm_python() -> str:
    # Absolute: the cells run with another working directory.
    venv = os.path.abspath(os.environ.get("MINIVLLM_VLLM_VENV") or os.path.join(ROOT, ".venv-vllm"))
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(os.path.join(venv, ".minivllm-vllm-ready")):
        raise SystemExit(f"no vLLM venv at {venv}: create it with "
                         "`bash tests/conformance/setup_vllm.sh` (or set MINIVLLM_VLLM_VENV)")
    return python


def vllm_env() -> dict:
    """vLLM's CPU build on a small machine: all cores bound to its worker, none reserved, a 1 GiB
    KV cache, nothing from a hub; no minivllm on its path."""
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else \
        ",".join(map(str, cpus))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=bind,
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_USE_AOT_COMPILE="0",
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def run_in_group(cmd: list[str], env: Optional[dict], cwd: str, log, timeout: float) -> Optional[int]:
    """Run ``cmd`` in its own process group and return its exit status (``None`` on timeout);
    the whole group (a vLLM engine's spawned processes too) is killed by id either way."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return rc


def run_in_process(cell: dict, timeout: float) -> dict:
    """One cell in a fresh process (vLLM's venv for vLLM), its whole process group killed by id
    on timeout."""
    with tempfile.TemporaryDirectory(prefix="minivllm-bench-vllm-") as tmp:
        inp, out = os.path.join(tmp, "cell.json"), os.path.join(tmp, "out.json")
        with open(inp, "w") as f:
            json.dump(cell, f)
        if cell["engine"].startswith("vllm"):
            cmd, env = [vllm_python(), os.path.abspath(__file__), "--cell", inp, out], vllm_env()
            if cell.get("profile_ops"):     # the engine core in this process, where the profiler is
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            cmd, env = [sys.executable, "-m", "minivllm.bench", "vllm", "--cell", inp, out], None
        log = open(os.path.join(tmp, "log.txt"), "w+")
        rc = run_in_group(cmd, env, tmp, log, timeout)
        log.seek(0)
        if rc != 0 or not os.path.exists(out):
            raise SystemExit(f"cell {cell['engine']} {cell['kind']} {cell['dtype']} failed "
                             f"(rc={rc}):\n{log.read()[-3000:]}")
        with open(out) as f:
            return json.load(f)


def _cli_cell(argv: list[str]) -> None:
    with open(argv[0]) as f:
        cell = json.load(f)
    with open(argv[1], "w") as f:
        json.dump(run_cell(cell), f)


def _workloads(tok, kind: str, max_tokens: int) -> dict:
    """name -> (prompt ids, max_tokens per prompt, ignore_eos); names ending ":1" run one at a time."""
    if kind == "throughput":
        from minivllm.bench.throughput import BASE_TEXT, QUESTIONS, make_workload
        single = [(BASE_TEXT * 2 + QUESTIONS[0], 64)]
        return {name: ([tok.encode(p) for p, _ in work], [n for _, n in work], True)
                for name, work in (("1 request:1", single),
                                   ("32 requests, mixed", make_workload(32)))}
    from minivllm.bench.spec import GROUNDED, OPEN, REPEATED

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                  tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    texts = {"grounded": GROUNDED, "open": OPEN, "repeated": REPEATED}[kind]
    first = 4 if kind == "repeated" else 2   # one after another: later ones reuse earlier outputs
    return {f"{kind}:1": ([chat(t) for t in texts[:first]], [max_tokens] * first, False),
            f"{kind}:8": ([chat(t) for t in texts[:8]], [max_tokens] * 8, False)}


def _spec_row(engine: str, name: str, res: dict) -> str:
    c = res["counters"]
    drafts, accepted = c[METRICS[0]], c[METRICS[2]]
    per_pos = " ".join(f"{n / drafts:.2f}" for n in c[METRICS[3]]) if drafts else "-"
    acc = f"{1 + accepted / drafts:.2f}" if drafts else "-"
    kind, batch = name.split(":")
    return (f"{kind:<9}{batch:>6}  {engine:<9}{res['tokens'] / res['seconds']:>8.1f}{drafts:>8}"
            f"{c[METRICS[1]]:>8}{accepted:>9}  {per_pos:<15}{acc:>8}")


def plan_jobs(cells: list[tuple[str, str]], extra: list[str],
              rounds: int = 1) -> list[tuple[str, str, str]]:
    """(engine, kind, dtype) in the order they run: per round, every cell's engines one after
    another, which engine goes first rotating from cell to cell and from round to round, so that
    a drift in the machine's speed falls on every engine alike."""
    jobs = []
    for r in range(rounds):
        for i, (kind, dtype) in enumerate(cells):
            engines = ["minivllm", "vllm"] + (extra if kind == "throughput" else [])
            k = (i + r) % len(engines)
            jobs += [(engine, kind, dtype) for engine in engines[k:] + engines[:k]]
    return jobs


def keep_fastest(best: dict, res: dict) -> None:
    """Merge one run of a cell (workload name -> result) into ``best``, per workload the run with
    the fewest seconds. Greedy outputs and counters are the same in every run."""
    for name, r in res.items():
        if name not in best or r["seconds"] < best[name]["seconds"]:
            best[name] = r


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--cell"]:
        return _cli_cell(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128, help="spec table: tokens per request")
    ap.add_argument("--no-spec", action="store_true", help="skip the n-gram table")
    ap.add_argument("--kinds", default="grounded,open,repeated", help="the spec table's prompt "
                    "kinds (repeated: suffix decoding's cells)")
    ap.add_argument("--no-throughput", action="store_true", help="skip the throughput table")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    ap.add_argument("--no-hf", action="store_true", help="no Hugging Face column")
    ap.add_argument("--vllm-compiled", action="store_true",
                    help="also vLLM without enforce_eager (torch.compile) in the throughput table")
    ap.add_argument("--profile-ops", action="store_true",
                    help="run the spec cells under torch.profiler (slower) and print, per "
                         "workload, each engine's time in torch ops, outside them, and its top ops")
    ap.add_argument("--rounds", type=int, default=1,
                    help="every cell this many times, the engines' order rotating each round; "
                         "each cell's workload keeps its fastest run")
    args = ap.parse_args(argv)
    vllm_python()                                   # fail now, with the fix, if vLLM is absent
    from tqdm.auto import tqdm

    from minivllm.model_executor.model_loader import load_tokenizer, resolve_model_path
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    cells = []
    if not args.no_throughput:
        cells += [("throughput", d) for d in args.dtypes.split(",")]
    if not args.no_spec:
        cells += [(kind, "float32") for kind in args.kinds.split(",")]
    extra = ([] if args.no_hf else ["hf"]) + (["vllm_compiled"] if args.vllm_compiled else [])
    results: dict = {}
    for engine, kind, dtype in tqdm(plan_jobs(cells, extra, args.rounds),
                                    desc="cells (one process each)", dynamic_ncols=True):
        cell = {"engine": engine,
                "kind": {"throughput": kind, "repeated": "suffix"}.get(kind, "spec"),
                "dtype": dtype, "model": path, "profile_ops": args.profile_ops,
                "workloads": _workloads(tok, kind, args.max_tokens)}
        keep_fastest(results.setdefault((engine, kind, dtype), {}),
                     run_in_process(cell, args.timeout))

    rounds = f"; the fastest of {args.rounds} runs per cell" if args.rounds > 1 else ""
    print(f"\n{args.model} on the CPU ({len(os.sched_getaffinity(0))} cores, load average "
          f"{os.getloadavg()[0]:.1f}), greedy; vLLM 0.32.0 CPU build, enforce_eager{rounds}")
    if not args.no_throughput:
        others = ["vllm"] + extra
        label = {"vllm": "vLLM eager", "vllm_compiled": "vLLM compiled", "hf": "HF"}
        print(f"\n{'dtype':9} {'workload':19}{'minivllm':>9}" +
              "".join(f"{label[e]:>14}" for e in others) +
              "".join(f"{'/ ' + label[e]:>17}" for e in others) + "  same as vLLM eager")
        for dtype in args.dtypes.split(","):
            mv = results[("minivllm", "throughput", dtype)]
            for name in mv:
                tps = {e: results[(e, "throughput", dtype)][name]["tokens"] /
                       results[(e, "throughput", dtype)][name]["seconds"]
                       for e in ["minivllm"] + others}
                vl = results[("vllm", "throughput", dtype)][name]
                same = sum(x == y for x, y in zip(mv[name]["outputs"], vl["outputs"]))
                print(f"{dtype:9} {name.replace(':1', ''):19}{tps['minivllm']:9.1f}" +
                      "".join(f"{tps[e]:14.1f}" for e in others) +
                      "".join(f"{tps['minivllm'] / tps[e]:16.2f}x" for e in others) +
                      f"  {same}/{len(mv[name]['outputs'])}")
    if not args.no_spec:
        print(f"\nn-gram, k={NGRAM['num_speculative_tokens']}, prompt_lookup "
              f"{NGRAM['prompt_lookup_min']}..{NGRAM['prompt_lookup_max']}, float32, up to "
              f"{args.max_tokens} tokens (EOS stops)")
        print(f"{'prompts':<9}{'batch':>6}  {'engine':<9}{'tok/s':>8}{'drafts':>8}{'drafted':>8}"
              f"{'accepted':>9}  {'acc per pos':<15}{'acc len':>8}")
        for kind in args.kinds.split(","):
            if kind == "repeated":
                print(f"suffix, k={SUFFIX['num_speculative_tokens']}, vLLM's defaults, the same "
                      "edit on similar code (bench spec's repeated workload)")
            for name in results[("minivllm", kind, "float32")]:
                for engine in ("minivllm", "vllm"):
                    print(_spec_row(engine, name, results[(engine, kind, "float32")][name]))
            print()
        if args.profile_ops:
            for kind in args.kinds.split(","):
                for name in results[("minivllm", kind, "float32")]:
                    print(_ops_table(name, {e: results[(e, kind, "float32")][name]
                                            for e in ("minivllm", "vllm")}))


def _ops_table(name: str, runs: dict, top: int = 10) -> str:
    """Where each engine's time went in one profiled workload: wall seconds, the torch ops' own
    seconds, the rest (Python: scheduling, input preparation, drafting, module calls; and the
    profiler's own cost, which grows with the number of ops), and each engine's ``top`` ops, side
    by side."""
    lines = [f"{name}, under torch.profiler:"]
    for e, r in runs.items():
        ops = sum(r["ops"].values())
        lines.append(f"  {e:<9} wall {r['seconds']:6.2f} s   torch ops {ops:6.2f} s   outside "
                     f"them {r['seconds'] - ops:6.2f} s")
    ranked = {e: sorted(r["ops"].items(), key=lambda kv: -kv[1])[:top] for e, r in runs.items()}
    lines.append("  " + "".join(f"{e + ' op':<52}{'s':>6}   " for e in ranked))
    for i in range(top):
        lines.append("  " + "".join(f"{ops[i][0][:50]:<52}{ops[i][1]:6.3f}   " if i < len(ops)
                                    else " " * 61 for ops in ranked.values()))
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cell"]:
        # The vLLM venv runs this file directly. Its folder (minivllm/bench, first on sys.path)
        # holds this vllm.py, which would shadow the real vllm package.
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
        _cli_cell(sys.argv[2:])
    else:
        main(sys.argv[1:])
