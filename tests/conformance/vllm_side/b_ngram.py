"""Case b, vLLM side: n-gram speculative decoding, one engine per k, one after another.

Input: ``{"model", "prompts", "max_tokens", "ks": [k...], "lookup_min", "lookup_max"}``.
Output ``{"runs": {k: {"batch": {"outputs", "counters"}, "per_request": [{"outputs",
"counters"}]}}, "seconds": {k: ...}}``, from one ``generate`` of all prompts at once per k (greedy,
``ignore_eos``):
- ``batch.counters``: differences of ``LLM.get_metrics()``'s ``vllm:spec_decode_num_*`` around it;
- ``per_request[i].counters``: the same four counters for prompt i alone, from vLLM 0.32's
  per-request metrics (``per_request_spec_decode_metrics="detailed"``: each finished
  ``CompletionOutput.spec_decode_metrics`` holds a histogram of accepted drafts per verify step,
  observed under the same condition as the counters, scheduler.py ``update_from_output``).
"""
from common import (Timer, counter_diff, make_llm, read_input, shutdown, spec_counters,
                    write_output)

NAMES = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
         "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def request_counters(metrics) -> dict:
    """``RequestSpecDecodeMetrics`` -> the four counters: histogram[j] = verify steps that accepted
    j drafts, so position p was accepted in the steps that accepted more than p."""
    hist = list(metrics.histogram)
    per_pos = [sum(hist[p + 1:]) for p in range(len(hist) - 1)]
    return dict(zip(NAMES, (sum(hist), int(metrics.num_draft_tokens),
                            sum(j * c for j, c in enumerate(hist)), per_pos)))


def measured(llm, prompts, max_tokens) -> tuple[dict, list[dict]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    before = spec_counters(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    batch = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
             "counters": counter_diff(spec_counters(llm), before)}
    per_request = [{"outputs": [list(o.outputs[0].token_ids)],
                    "counters": request_counters(o.outputs[0].spec_decode_metrics)} for o in outs]
    return batch, per_request


if __name__ == "__main__":
    args = read_input()
    runs, seconds = {}, {}
    for k in args["ks"]:
        timer = Timer()
        llm = make_llm(args["model"], per_request_spec_decode_metrics="detailed",
                       speculative_config={
                           "method": "ngram", "num_speculative_tokens": k,
                           "prompt_lookup_min": args["lookup_min"],
                           "prompt_lookup_max": args["lookup_max"]})
        start = timer()
        batch, per_request = measured(llm, args["prompts"], args["max_tokens"])
        runs[str(k)] = {"batch": batch, "per_request": per_request}
        seconds[str(k)] = {"start": start, "total": timer()}
        shutdown(llm)
    write_output({"runs": runs, "seconds": seconds})
