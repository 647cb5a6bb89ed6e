"""Case j, vLLM side, the engine: suffix decoding (``method="suffix"``), one engine per k.

Input: ``{"model", "prompts", "max_tokens", "ks": [k...], "options": {suffix_decoding_*}}``.
Output: ``{"runs": {k: [{"outputs", "counters"} per prompt]}, "seconds": {k: ...}}``: the prompts
one ``generate`` after another on the same engine (greedy, ``ignore_eos``), so each request can
draft from the earlier ones' outputs in the global tree; ``counters``: the differences of
``LLM.get_metrics()``'s ``vllm:spec_decode_num_*`` around that request's ``generate``.
"""
from common import (Timer, counter_diff, generate_ids, make_llm, read_input, shutdown,
                    spec_counters, write_output)

if __name__ == "__main__":
    args = read_input()
    runs, seconds = {}, {}
    for k in args["ks"]:
        timer = Timer()
        llm = make_llm(args["model"], speculative_config={
            "method": "suffix", "num_speculative_tokens": k, **args["options"]})
        start = timer()
        rows = []
        for prompt in args["prompts"]:
            before = spec_counters(llm)
            outputs, _ = generate_ids(llm, [prompt], args["max_tokens"])
            rows.append({"outputs": outputs[0], "counters": counter_diff(spec_counters(llm),
                                                                         before)})
        runs[str(k)] = rows
        seconds[str(k)] = {"start": start, "total": timer()}
        shutdown(llm)
    write_output({"runs": runs, "seconds": seconds})
