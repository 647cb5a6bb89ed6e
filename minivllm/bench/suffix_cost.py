"""``python -m minivllm.bench.suffix_cost``: what suffix decoding's readable trees cost per engine
step, against the target forward pass a step runs anyway.

Per step, for each of ``B`` running requests, the proposer appends the tokens the request sampled
(1 to k + 1) to its own tree and to the global tree, then speculates in both (suffix_decoding.py).
This replays that on real token streams: the ``bench spec`` repeated workload's chat prompts,
each followed by its code snippet as the "output", with a global tree already holding
``--cached`` earlier outputs. It prints the mean time of one step's proposer work at each batch
size, the one-time cost of a prompt's tree, and a plain decode step of the default model at the same
batch size (minivllm, greedy: the difference of two ``generate`` lengths, per step).
"""
from __future__ import annotations

import argparse
import random
import time

from minivllm.utils import frozen_gc_heap


def _streams(tok, n: int) -> list[tuple[list[int], list[int]]]:
    from minivllm.bench.spec import CODE, EDIT, RENAMES
    out = []
    for i in range(n):
        f, v = RENAMES[i % len(RENAMES)]
        code = CODE.replace("parse_config", f).replace("config", v)
        chat = tok.apply_chat_template([{"role": "user", "content": EDIT + code}],
                                       tokenize=False, add_generation_prompt=True)
        out.append((tok.encode(chat, add_special_tokens=False),
                    tok.encode(code, add_special_tokens=False)))
    return out


@frozen_gc_heap()
def tree_step_ms(streams, k: int, cached: int, steps: int) -> tuple[float, float]:
    """(mean ms of one step's proposer work for all requests, mean ms to start one request).
    The heap that exists before is frozen, as ``LLM.generate`` freezes it around the engine's
    steps: the collector's passes over the tokenizer's objects are not the trees' cost."""
    from minivllm.spec_decode.suffix_decoding import SuffixDecodingCache
    rng = random.Random(0)
    cache = SuffixDecodingCache(24, 10000)
    for j in range(cached):                     # earlier requests' outputs in the global tree
        prompt, output = streams[j % len(streams)]
        cache.start_request(f"old{j}", prompt)
        cache.add_active_response(f"old{j}", output)
        cache.stop_request(f"old{j}")
    t0 = time.perf_counter()
    for i, (prompt, output) in enumerate(streams):
        cache.start_request(i, prompt)
        cache.add_active_response(i, output[:1])
    start_ms = (time.perf_counter() - t0) * 1e3 / len(streams)
    pos = [1] * len(streams)
    elapsed = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        for i, (prompt, output) in enumerate(streams):
            n = rng.randint(1, k + 1)
            cache.add_active_response(i, output[pos[i] % len(output):][:n])
            pos[i] += n
            context = prompt + output[:pos[i] % len(output)]
            cache.speculate(i, context[-24:], max_spec_tokens=k)
        elapsed += time.perf_counter() - t0
    return elapsed * 1e3 / steps, start_ms


def forward_step_ms(path: str, prompts: list[list[int]]) -> float:
    from minivllm import LLM, SamplingParams
    llm = LLM(model=path, max_num_seqs=len(prompts))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    times: dict[int, list[float]] = {8: [], 40: []}
    for n in (8, 40) * 3:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        times[n].append(time.perf_counter() - t0)
    # 32 more decode steps, fastest of three each: the prefill and the start cancel out. On a
    # loaded machine the difference can still come out at or below zero: no number then.
    step_ms = (min(times[40]) - min(times[8])) * 1e3 / 32
    return step_ms if step_ms > 0 else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench.suffix_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--cached", type=int, default=64, help="outputs already in the global tree")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--no-forward", action="store_true", help="skip the forward-pass column")
    args = ap.parse_args(argv)
    from minivllm.model_executor.model_loader import load_tokenizer, resolve_model_path
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    print(f"k={args.k}, max_tree_depth 24, {args.cached} outputs in the global tree, "
          f"mean of {args.steps} steps")
    print(f"{'batch':>5}  {'trees ms/step':>13}  {'start ms/request':>16}  {'forward ms/step':>15}"
          f"  {'trees / forward':>15}")
    for b in map(int, args.batches.split(",")):
        streams = _streams(tok, b)
        trees, start = tree_step_ms(streams, args.k, args.cached, args.steps)
        fwd = float("nan") if args.no_forward else forward_step_ms(path, [p for p, _ in streams])
        print(f"{b:>5}  {trees:>13.2f}  {start:>16.2f}  {fwd:>15.1f}  {trees / fwd:>14.1%}",
              flush=True)


if __name__ == "__main__":
    main()
