"""``python -m minivllm.bench roofline``: the roofline of speculation, measured on this machine.

Speculative decoding pays when a verify pass over ``k + 1`` tokens per request costs little more
than a plain one-token step. This measures that cost and predicts each drafter from it:

1. **The target's forward time as a function of tokens per request** ``q = 1..8``, at batch 1 and
   8: SmolLM2's ``LlamaForCausalLM`` (float32), a paged KV cache holding ``--context`` tokens per
   request, one forward plus ``compute_logits`` on every row (verification needs logits at all
   ``k + 1`` positions). Sizes take turns round by round; the median is kept.
2. **Each drafter, run**: plain, n-gram, Medusa, EAGLE, EAGLE-3 and a draft model (the first
   ``--draft-layers`` layers), ``k`` drafts, on ``bench spec``'s prompts at batch 1 (a short run:
   ``--prompts`` grounded and as many open prompts, ``--max-tokens`` each). ``bench profile``'s
   timers give the drafting time per step, the metrics ``tau``, tokens per target pass. All
   engines are loaded first and take turns run by run (``--spec-rounds``).
3. **Prediction**: with ``V(k+1)`` the verify step in plain steps (plain step + the forward's
   extra time at ``k + 1`` tokens, over the plain step) and ``D`` the drafting time in plain steps,
   ``speed-up = tau / (V(k+1) + D)``; the break-even acceptance length is ``V(k+1) + D``.

It prints predicted against measured speed-ups and writes ``--json`` (the numbers) and ``--figure``
(the curve and the comparison).
Only this machine's curve is measured; no GPU curve is drawn unless one is run here.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def forward_curve(model, batches=(1, 8), max_q: int = 8, context: int = 256,
                  rounds: int = 5) -> dict[int, list[float]]:
    """``{batch: [ms for q = 1..max_q]}``: median of ``rounds`` forward + logits passes."""
    from minivllm.attention.layer import bind_kv_caches
    from minivllm.attention.metadata import AttentionMetadata
    from minivllm.forward_context import set_forward_context
    block = 16
    per_req = -(-(context + max_q) // block)
    layers = model.attn_layers()
    bind_kv_caches(layers.values(), max(batches) * per_req, block, torch.float32, torch.device("cpu"))
    for layer in layers.values():
        layer.kv_cache.normal_(0, 0.02)   # plausible keys/values (the cache is left unset)
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(rounds):
        for b in batches:
            for q in range(1, max_q + 1):
                pos = torch.arange(context, context + q).repeat(b)
                reqs = torch.arange(b).repeat_interleave(q)
                table = torch.arange(b * per_req, dtype=torch.int32).view(b, per_req)
                slots = (reqs * per_req * block + pos).long()
                md = AttentionMetadata(b * q, torch.arange(b + 1, dtype=torch.int32) * q,
                                       torch.full((b,), context + q, dtype=torch.int32), table,
                                       slots, q, context + q)
                ids = torch.randint(0, model.config.vocab_size, (b * q,))
                with torch.no_grad(), set_forward_context(md, layers):
                    t0 = time.perf_counter()
                    model.compute_logits(model(ids, pos))
                    times.setdefault((b, q), []).append(time.perf_counter() - t0)
    return {b: [sorted(times[(b, q)])[rounds // 2] * 1e3 for q in range(1, max_q + 1)]
            for b in batches}


def run_drafters(path: str, names: list[str], k: int, n_prompts: int, max_tokens: int,
                 draft_layers: int, rounds: int = 2) -> dict[str, dict]:
    """Each drafter's tokens/s, tokens per target pass and drafting ms per step at batch 1, summed
    over ``rounds`` in which the engines take turns."""
    from minivllm.bench.profile import StepTimers, install
    from minivllm.bench.spec import GROUNDED, OPEN, MiniVLLMRunner, ngram
    from minivllm.model_executor.model_loader import load_tokenizer
    from minivllm.spec_decode.heads import shipped_head_dir
    tok = load_tokenizer(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                       add_generation_prompt=True)
               for t in GROUNDED[:n_prompts] + OPEN[:n_prompts]]
    specs = {"plain": None, "n-gram": ngram(k, 3, 5, "first"),
             "draft model": dict(method="draft_model", num_speculative_tokens=k,
                                 draft_num_layers=draft_layers)}
    for method, label in (("medusa", "Medusa"), ("eagle", "EAGLE"), ("eagle3", "EAGLE-3")):
        specs[label] = dict(method=method, num_speculative_tokens=k, model=shipped_head_dir(method))
    specs = {n: s for n, s in specs.items() if n == "plain" or n in names}
    longest = max(len(tok.encode(p)) for p in prompts)
    blocks = -(-(longest + max_tokens + k) // 16) + 2
    runners, timers = {}, {}
    for name, spec in specs.items():   # all loaded first, so the runs can take turns
        runners[name] = MiniVLLMRunner(path, spec, max_tokens, blocks)
        timers[name] = StepTimers()
        install(runners[name].llm, timers[name])
    sums = {name: dict(tokens=0, seconds=0.0, passes=0.0) for name in specs}
    for _ in range(rounds):   # engines alternate run by run: load drift hits them all alike
        for name, runner in runners.items():
            res = runner.run(prompts, 1)
            s = sums[name]
            s["tokens"] += res["tokens"]
            s["seconds"] += res["time"]
            s["passes"] += res["tokens"] / res["tok_fwd"]   # one target pass per step at batch 1
    out = {}
    for name, s in sums.items():
        t = timers[name]
        out[name] = dict(tokens=s["tokens"], seconds=s["seconds"],
                         tokens_per_s=s["tokens"] / s["seconds"], tok_fwd=s["tokens"] / s["passes"],
                         step_ms=t.inclusive["step"] / s["passes"] * 1e3,
                         draft_ms=t.inclusive.get("drafter", 0.0) / s["passes"] * 1e3)
    return out


def predict(curve: list[float], drafters: dict[str, dict], k: int) -> dict[str, dict]:
    """Break-even acceptance length and predicted speed-up per drafter (batch-1 curve)."""
    plain = drafters["plain"]
    extra = curve[k] - curve[0]   # forward at k + 1 tokens minus forward at 1
    verify = (plain["step_ms"] + extra) / plain["step_ms"]
    out = {}
    for name, d in drafters.items():
        if name == "plain":
            continue
        draft = d["draft_ms"] / plain["step_ms"]
        # tok/fwd (tokens per target pass) is the acceptance length the speed-up sees: it also
        # counts the steps that had no drafts (tau = 1 there).
        tau = d["tok_fwd"]
        out[name] = dict(verify_steps=verify, draft_steps=draft, break_even=verify + draft,
                         tau=tau, predicted=tau / (verify + draft),
                         measured=d["tokens_per_s"] / plain["tokens_per_s"])
    return out


def draw(result: dict, figure: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for batch, ms in result["curve_ms"].items():
        q = range(1, len(ms) + 1)
        a.plot(q, [m / ms[0] for m in ms], "o-", label=f"batch {batch} (1 token: {ms[0]:.0f} ms)")
    a.plot([1, 8], [1, 8], ":", color="grey", label="compute-bound (linear)")
    a.axhline(1, color="grey", lw=0.5)
    a.set(xlabel="tokens per request in the forward", ylabel="forward time / 1-token forward",
          title=f"Target forward, measured on {result['device']}")
    a.legend(fontsize=8)
    names = list(result["predicted"])
    pred = [result["predicted"][n]["predicted"] for n in names]
    meas = [result["predicted"][n]["measured"] for n in names]
    x = range(len(names))
    b.bar([i - 0.2 for i in x], pred, 0.4, label="predicted: tau / (V(k+1) + D)")
    b.bar([i + 0.2 for i in x], meas, 0.4, label="measured (bench spec run)")
    b.axhline(1, color="grey", lw=0.5)
    b.set_xticks(list(x), names)
    b.set(ylabel="speed-up over plain, batch 1", title=f"k={result['k']}, {result['workload']}")
    b.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(figure)), exist_ok=True)
    fig.savefig(figure, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=1, help="grounded and open prompts each")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--spec-rounds", type=int, default=2, help="turns of the drafter runs")
    ap.add_argument("--drafters", default="n-gram,Medusa,EAGLE,EAGLE-3,draft model")
    ap.add_argument("--json", default="figures/roofline_spec.json")
    ap.add_argument("--figure", default="figures/roofline_spec.png")
    args = ap.parse_args(argv)
    if not 1 <= args.k <= 7:
        ap.error("--k must be in 1..7 (the curve goes to 8 tokens per request)")
    from minivllm.model_executor.model_loader import load_model, resolve_model_path
    path = resolve_model_path(args.model)
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    model = load_model(path, torch.float32, torch.device("cpu"))
    curve = forward_curve(model, context=args.context, rounds=args.rounds)
    del model
    for batch, ms in curve.items():
        print(f"batch {batch}: forward ms at 1..8 tokens per request: "
              + " ".join(f"{m:.1f}" for m in ms), flush=True)
    drafters = run_drafters(path, args.drafters.split(","), args.k, args.prompts, args.max_tokens,
                            args.draft_layers, args.spec_rounds)
    pred = predict(curve[1], drafters, args.k)
    print(f"\nk={args.k}, batch 1; V = verify step / plain step, D = drafting / plain step")
    print(f"{'drafter':<12}{'tau':>6}{'V':>6}{'D':>6}{'break-even':>11}{'predicted':>10}{'measured':>9}")
    for name, p in pred.items():
        print(f"{name:<12}{p['tau']:6.2f}{p['verify_steps']:6.2f}{p['draft_steps']:6.2f}"
              f"{p['break_even']:11.2f}{p['predicted']:9.2f}x{p['measured']:8.2f}x")
    result = dict(device="CPU (%d torch threads)" % torch.get_num_threads(), k=args.k,
                  context=args.context, curve_ms={str(b): ms for b, ms in curve.items()},
                  workload=f"{2 * args.prompts} prompts x {args.max_tokens} tokens x {args.spec_rounds} "
                  "rounds, batch 1",
                  drafters=drafters, predicted=pred, gpu_curve=None)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    draw(result, args.figure)
    print(f"wrote {args.json} and {args.figure}")


if __name__ == "__main__":
    main()
