"""Case a, vLLM side: plain greedy decoding (no speculation), float32, one engine.

Input: ``{"model", "prompts": [[ids]], "max_tokens", "dtype"}``. Output: ``{"outputs": [[ids]],
"top2": [[[(id, logprob)] * 2 per position]], "start_s", "generate_s"}``; ``top2`` is vLLM's own
top-2 log-probabilities (of the raw logits), so a split can be judged by vLLM's top-2 gap.
The same plain outputs are the reference of case b ("spec decode equals plain decoding").
"""
from common import Timer, generate_ids, make_llm, read_input, shutdown, write_output

if __name__ == "__main__":            # vLLM spawns its engine processes: the guard is required
    args = read_input()
    timer = Timer()
    llm = make_llm(args["model"], dtype=args.get("dtype", "float32"))
    start = timer()
    outputs, top2 = generate_ids(llm, args["prompts"], args["max_tokens"], logprobs=2)
    write_output({"outputs": outputs, "top2": top2, "start_s": start,
                  "generate_s": round(timer() - start, 2)})
    shutdown(llm)
