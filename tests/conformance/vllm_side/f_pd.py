"""Case f, vLLM side: the article's P/D example with vLLM 0.32 (CPU), every connector call logged.

Two instances, one after the other in this process (two ~7 GB engines at once do not fit beside
other work): prefill (``max_tokens=1``) stores the prompt's KV through LoggingExampleConnector in a
shared folder, then decode loads it and generates. IN: {"model", "prompt_token_ids", "max_tokens",
"storage"}; OUT: per instance the call log (f_calllog.py), the output ids and num_cached_tokens.
"""
import gc
import json
import os
import sys


def run_instance(model: str, prompt: list[int], max_tokens: int, storage: str, log: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    os.environ["MINIVLLM_CONF_CALLLOG"] = log     # inherited by EngineCore and worker
    ktc = KVTransferConfig(kv_connector="LoggingExampleConnector",
                           kv_connector_module_path="f_connector_vllm", kv_role="kv_both",
                           kv_connector_extra_config={"shared_storage_path": storage})
    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=1024,
              kv_transfer_config=ktc)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       use_tqdm=False)[0]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    from f_calllog import read_log
    return {"token_ids": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens, "calls": read_log(log)}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        p = json.load(f)
    work = os.path.dirname(os.path.abspath(sys.argv[2]))
    result = {
        "prefill": run_instance(p["model"], p["prompt_token_ids"], 1, p["storage"],
                                os.path.join(work, "prefill.jsonl")),
        "decode": run_instance(p["model"], p["prompt_token_ids"], p["max_tokens"], p["storage"],
                               os.path.join(work, "decode.jsonl")),
    }
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
