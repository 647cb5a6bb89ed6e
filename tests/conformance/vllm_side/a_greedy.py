"""Case a, vLLM side: plain greedy decoding (no speculation), float32; run by ``ai_float32.py``
on the engine it shares with case i.

Job: ``{"prompts": [[ids]], "max_tokens"}``. Result: ``{"outputs": [[ids]], "top2": [[[(id,
logprob)] * 2 per position]]}``; ``top2`` is vLLM's own top-2 log-probabilities (of the raw
logits), so a split can be judged by vLLM's top-2 gap. The same plain outputs are the reference of
case b ("spec decode equals plain decoding").
"""
from common import generate_ids


def run_greedy(llm, job: dict) -> dict:
    outputs, top2 = generate_ids(llm, job["prompts"], job["max_tokens"], logprobs=2)
    return {"outputs": outputs, "top2": top2}
