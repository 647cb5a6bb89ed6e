"""Case i, vLLM side: greedy decoding under the sampling fields, float32; run by ``ai_float32.py``
on the engine it shares with case a.

Job: ``{"prompts": [[ids]], "max_tokens", "cases": [{"name", "params": {...}}]}``; each case runs
every prompt with ``SamplingParams(temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=5,
**params)``. Result: ``{name: {"outputs": [[ids]], "logprobs": [[[(id, logprob)] top 5 per
position]], "sampled": [[logprob per position]], "prompt_logprobs": [[None | {"token": logprob,
"top": [(id, logprob)]}]]}}``.
"""


def top(pos, k=5):
    return sorted(((int(t), float(lp.logprob)) for t, lp in pos.items()), key=lambda x: -x[1])[:k]


def run_sampling(llm, job: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    result = {}
    for case in job["cases"]:
        params = case["params"]
        if "logit_bias" in params:
            params = {**params, "logit_bias": {int(k): v for k, v in params["logit_bias"].items()}}
        sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            logprobs=5, prompt_logprobs=5, **params)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        result[case["name"]] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[top(pos) for pos in o.outputs[0].logprobs] for o in outs],
            "sampled": [[float(pos[t].logprob) for t, pos in zip(o.outputs[0].token_ids,
                                                                  o.outputs[0].logprobs)]
                        for o in outs],
            "prompt_logprobs": [[None if pos is None else
                                 {"token": float(pos[t].logprob), "top": top(pos)}
                                 for t, pos in zip(o.prompt_token_ids, o.prompt_logprobs)]
                                for o in outs]}
    return result
