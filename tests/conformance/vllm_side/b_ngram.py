"""Case b, vLLM side: n-gram speculative decoding, one engine per k, one after another.

Input: ``{"model", "prompts", "max_tokens", "ks": [k...], "lookup_min", "lookup_max"}``.
Output ``{"runs": {k: {"batch": {"outputs", "counters"}, "per_request": [{"outputs",
"counters"}]}}, "seconds": {k: ...}}``. ``counters`` are differences of ``LLM.get_metrics()``'s
``vllm:spec_decode_num_*`` around one ``generate``: all prompts at once (``batch``), then each
prompt alone (``per_request``). Greedy, ``ignore_eos``.
"""
from common import (Timer, counter_diff, generate_ids, make_llm, read_input, shutdown,
                    spec_counters, write_output)


def measured(llm, prompts, max_tokens) -> dict:
    before = spec_counters(llm)
    outputs, _ = generate_ids(llm, prompts, max_tokens)
    return {"outputs": outputs, "counters": counter_diff(spec_counters(llm), before)}


if __name__ == "__main__":
    args = read_input()
    runs, seconds = {}, {}
    for k in args["ks"]:
        timer = Timer()
        llm = make_llm(args["model"], speculative_config={
            "method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": args["lookup_min"], "prompt_lookup_max": args["lookup_max"]})
        start = timer()
        batch = measured(llm, args["prompts"], args["max_tokens"])
        per_request = [measured(llm, [p], args["max_tokens"]) for p in args["prompts"]]
        runs[str(k)] = {"batch": batch, "per_request": per_request}
        seconds[str(k)] = {"start": start, "total": timer()}
        shutdown(llm)
    write_output({"runs": runs, "seconds": seconds})
