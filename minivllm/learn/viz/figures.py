"""Regenerate the README's figures from real runs:
``python -m minivllm.learn.viz.figures [--out DIR] [--fast]``.

Every picture is drawn from the step records of a run made here, on the default model
(SmolLM2-135M-Instruct) unless ``--model`` says otherwise; small settings keep the whole script
within a few minutes on a laptop CPU.

- ``block_table.png``: block tables over the paged KV cache at a step where a request is preempted
  (shared prefix blocks, the null block, the free-block queue, prefix-cache hits).
- ``spec_decode_step.png``: one verify step (article Figure 11): drafts accepted / rejected, the
  recovered or bonus token, and for one position p_target, p_draft and the uniform draw.
- ``acceptance_per_position.png``: acceptance rate per draft position, n-gram first vs last match.
- ``pd_flow.png`` and ``pd_timeline.png``: disaggregated prefill/decode (article Figure 12), from
  the connector calls a prefill and a decode instance recorded.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any, Optional

from minivllm.learn.viz.block_table import block_table_figure
from minivllm.learn.viz.pd import connector_timeline, pd_flow_figure
from minivllm.learn.viz.plots import acceptance_per_position_plot
from minivllm.learn.viz.records import output_tokens_before, steps_of
from minivllm.learn.viz.spec import find_spec_verify, spec_step_figure

FIGURES = ("block_table.png", "spec_decode_step.png", "acceptance_per_position.png",
           "pd_flow.png", "pd_timeline.png")
SYSTEM = ("You are a helpful assistant. Answer in one short sentence, plainly and politely. ")
PAGED_PROMPTS = [SYSTEM + "What is the capital of France?",
                 SYSTEM + "Name a colour of the sky.",
                 SYSTEM + "What do bees make?",
                 "Count: one, two, three,"]
# Prompts with repeated text give the n-gram drafter something to find.
SPEC_PROMPTS = [
    "Repeat the list exactly: red apple, green pear, yellow banana, red apple, green pear, "
    "yellow banana, red apple, green pear,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog",
    "List: red apple, green pear, yellow banana, red apple, green pear, purple grape, red apple, "
    "green pear, blue plum, red apple, green pear,",
]
# The article's two prompts, each behind a sentence of context: the connector stores whole blocks
# only (16 tokens each), and the article's prompts alone are shorter than one block.
PD_PROMPTS = [
    "Ada Lovelace published the first program for Babbage's Analytical Engine in 1843. "
    "Hello, my name is",
    "The White House in Washington, D.C. has been home to every American leader since 1800. "
    "The president of the United States is",
]


def _llm(model: Optional[str], **kw: Any):
    from minivllm import LLM
    return LLM(**({"model": model} if model else {}), **kw)


def run_paged(model: Optional[str] = None, max_tokens: int = 20):
    """Four requests (three share a 16-token prefix) on a 14-block cache: prefix hits, preemption."""
    from minivllm import SamplingParams
    llm = _llm(model, block_size=8, num_gpu_blocks_override=14, max_num_batched_tokens=48)
    engine = llm.llm_engine
    engine.tracer.enabled = True
    for i, p in enumerate(PAGED_PROMPTS):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                     ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return llm, engine.tracer


def spec_llm(model: Optional[str] = None, match: str = "first", **spec: Any):
    """An LLM with n-gram drafting (the article's config: k = 3, lookup 3..5), recording steps."""
    cfg = {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 3,
           "num_speculative_tokens": 3, "ngram_match": match, **spec}
    llm = _llm(model, speculative_config=cfg)
    llm.llm_engine.tracer.enabled = True
    return llm


def run_spec(llm, temperature: float = 0.8, max_tokens: int = 32, prompts=None):
    """Generate SPEC_PROMPTS (seeded per prompt); return (this run's step records, outputs)."""
    from minivllm import SamplingParams
    prompts = SPEC_PROMPTS if prompts is None else prompts
    tracer = llm.llm_engine.tracer
    tracer.clear()
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return list(tracer.steps), outputs


def run_pd(storage: str, model: Optional[str] = None, max_tokens: int = 8):
    """The article's P/D example in one process: P stores KV (max_tokens=1), D loads it."""
    from minivllm import SamplingParams
    from minivllm.config import KVTransferConfig
    ktc = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both",
                           kv_connector_extra_config={"shared_storage_path": storage})
    prefill = _llm(model, kv_transfer_config=ktc)
    prefill.llm_engine.tracer.enabled = True
    prefill.generate(PD_PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    decode = _llm(model, kv_transfer_config=ktc)
    decode.llm_engine.tracer.enabled = True
    outputs = decode.generate(PD_PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens),
                              use_tqdm=False)
    return prefill.llm_engine.tracer, decode.llm_engine.tracer, outputs


def pick_block_table_step(source) -> int:
    """The first step that preempted a request, else the step holding the most blocks."""
    steps = steps_of(source)
    for i, s in enumerate(steps):
        if s.of("preempt"):
            return i
    return max(range(len(steps)), key=lambda i: sum(
        len(b) for b in steps[i].first("kv_cache")["block_tables"].values()))


def _save(fig, out_dir: str, name: str, dpi: int) -> str:
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def main(out_dir: str = "figures", fast: bool = False, model: Optional[str] = None,
         dpi: int = 100) -> list[str]:
    """Run the four demos and write every figure in FIGURES to ``out_dir``; return their paths.

    ``fast`` shortens every run (fewer tokens) for tests."""
    import matplotlib
    matplotlib.use("Agg")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    t0 = time.perf_counter()

    llm, tracer = run_paged(model, max_tokens=12 if fast else 20)
    step = tracer.steps[pick_block_table_step(tracer)]
    written.append(_save(block_table_figure(step), out_dir, "block_table.png", dpi))
    del llm

    n = 12 if fast else 32
    llm = spec_llm(model, match="first")
    steps, outputs = run_spec(llm, temperature=0.8, max_tokens=n)
    found = (find_spec_verify(steps) or find_spec_verify(steps, need_rejection=False)
             or find_spec_verify(steps, need_accept=False))
    if found is None:
        raise RuntimeError("the speculative run verified no drafts; nothing to draw.")
    i, req_id = found
    # Request ids are the prompts' positions in generate(); the context is prompt + sampled so far.
    context = outputs[int(req_id)].prompt_token_ids + output_tokens_before(steps, i, req_id)
    fig = spec_step_figure(steps[i], req_id=req_id, tokenizer=llm.get_tokenizer(), context=context)
    written.append(_save(fig, out_dir, "spec_decode_step.png", dpi))
    # Greedy runs for the first vs last comparison: their acceptance depends only on the rule.
    first, _ = run_spec(llm, temperature=0.0, max_tokens=n)
    del llm
    last, _ = run_spec(spec_llm(model, match="last"), temperature=0.0, max_tokens=n)
    fig = acceptance_per_position_plot({"first match": first, "last match": last})
    fig.axes[0].set_title("n-gram drafts (k=3, lookup 3..5), greedy: acceptance per position",
                          fontsize=10)
    written.append(_save(fig, out_dir, "acceptance_per_position.png", dpi))

    with tempfile.TemporaryDirectory() as storage:
        tp, td, _ = run_pd(storage, model, max_tokens=4 if fast else 8)
    written.append(_save(pd_flow_figure(tp, td), out_dir, "pd_flow.png", dpi))
    written.append(_save(connector_timeline(tp, td), out_dir, "pd_timeline.png", dpi))
    print(f"wrote {len(written)} figures to {out_dir} in {time.perf_counter() - t0:.0f} s")
    return written


def cli(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="figures", help="output folder (default: figures)")
    parser.add_argument("--fast", action="store_true", help="shorter runs (for tests)")
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    main(args.out, fast=args.fast, model=args.model, dpi=args.dpi)


if __name__ == "__main__":
    cli()
