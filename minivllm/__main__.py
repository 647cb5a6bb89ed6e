"""``python -m minivllm``: the demo. Runs the default model (SmolLM2-135M-Instruct) on a few prompts,
plain and with n-gram speculative decoding, and prints what the engine did."""
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

    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples,",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for title, spec in [("plain decoding", None),
                        ("n-gram speculative decoding (k=3)",
                         {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 3,
                          "num_speculative_tokens": 3})]:
        print(f"\n=== {title} ===")
        llm = LLM(model=args.model, speculative_config=spec,
                  attention_backend=args.attention_backend)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outputs)
        for o in outputs:
            print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
        print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s, "
              f"{llm.llm_engine.engine_core.step_index} engine steps)")
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                print(f"  {m.name} = {getattr(m, 'value', None) if hasattr(m, 'value') else m.values}")


if __name__ == "__main__":
    main()
