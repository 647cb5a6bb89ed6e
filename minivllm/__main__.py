"""``python -m minivllm``: the demo. Runs the default model (SmolLM2-135M-Instruct) on a few prompts,
plain and with n-gram speculative decoding, and prints what the engine did: first the number
speculation changes, target forward passes (engine steps) for the same greedy tokens, then wall
time, which on a shared or busy machine swings from run to run."""
from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu_attn", "triton"])
    args = ap.parse_args(argv)

    from minivllm import LLM, SamplingParams
    from minivllm.metrics import speculation_summary

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples,",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    runs = {}
    for title, spec in [("plain decoding", None),
                        ("n-gram speculative decoding (k=3)",
                         {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 3,
                          "num_speculative_tokens": 3})]:
        print(f"\n=== {title}, one prompt at a time (the article's batch size 1) ===")
        llm = LLM(model=args.model, speculative_config=spec,
                  attention_backend=args.attention_backend)
        core, outputs, forwards = llm.llm_engine.engine_core, [], []
        t0 = time.perf_counter()
        for prompt in prompts:
            before = core.step_index
            outputs += llm.generate([prompt], params, use_tqdm=False)
            forwards.append(core.step_index - before)
        dt = time.perf_counter() - t0
        for o, f in zip(outputs, forwards):
            print(f"{o.prompt!r} -> {o.outputs[0].text[:60]!r}...: {len(o.outputs[0].token_ids)} "
                  f"tokens in {f} target forwards")
        print("\n".join(speculation_summary(llm, outputs)[1:]))
        runs[title] = (sum(forwards), dt, [o.outputs[0].token_ids for o in outputs])
    (steps_p, dt_p, ids_p), (steps_s, dt_s, ids_s) = runs.values()
    n = sum(len(t) for t in ids_p)
    print("\n=== what speculation changed ===")
    print(f"same greedy tokens: {ids_p == ids_s}")
    print(f"{n} tokens in {steps_p} target forwards plain, {steps_s} with speculation: "
          f"{n / steps_p:.2f} against {n / steps_s:.2f} tokens per forward")
    print(f"wall time, one run: {n / dt_p:.1f} against {n / dt_s:.1f} tokens/s; a one-run ratio on a "
          "shared or busy machine is noise-prone (python -m minivllm.bench measures with rounds)")

if __name__ == "__main__":
    main()
