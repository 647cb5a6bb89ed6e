"""The article's disaggregated prefill/decode script ("Disaggregated P/D"), run with minivllm:
``python -m minivllm.examples.disaggregated_prefill``.

Two processes, two ``LLM`` instances sharing the folder ``local_storage`` through
``SharedStorageConnector``: the prefill instance computes each prompt's KV (``max_tokens=1``) and
stores it; the decode instance loads it instead of recomputing it, then generates.

Changes from the article, all marked ``# minivllm:``: imports from ``minivllm``; the default model
(SmolLM2-135M-Instruct) instead of TinyLlama; the decode process prints its outputs; the parent
joins the terminated prefill process (no zombie), stops the decode process if the prefill process
dies before its KV is ready (no hang), and removes ``local_storage`` if it created it. On a machine
with a single GPU, ``CUDA_VISIBLE_DEVICES="1"`` leaves the decode instance on the CPU (float32):
it then finds the prefill's bfloat16 KV incompatible, warns, and recomputes.

Note: the article's two prompts (5 and 7 tokens with SmolLM2's tokenizer) are shorter than one
KV block (16 tokens). Only whole blocks move and the last prompt token is always recomputed, so
here, as in vLLM, the files hold nothing to load ("KV loaded for 0 of 5 prompt tokens"). Add a
prompt of 17+ tokens to see a transfer.
"""
import os
import time
from multiprocessing import Event, Process
import multiprocessing as mp  # noqa: F401  (kept from the article)

from minivllm import LLM, SamplingParams  # minivllm: was vllm
from minivllm.config import KVTransferConfig  # minivllm: was vllm.config

prompts = [
    "Hello, my name is",
    "The president of the United States is",
]


def run_prefill(prefill_done):
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"

    sampling_params = SamplingParams(temperature=0, top_p=0.95, max_tokens=1)

    ktc = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": "local_storage"},
    )

    llm = LLM(kv_transfer_config=ktc)  # minivllm: default model
    llm.generate(prompts, sampling_params)

    prefill_done.set()  # notify decode instance that KV cache is ready

    # To keep the prefill node running in case the decode node is not done;
    # otherwise, the script might exit prematurely, causing incomplete decoding.
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("Script stopped by user.")


def run_decode(prefill_done):
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"

    sampling_params = SamplingParams(temperature=0, top_p=0.95)

    ktc = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": "local_storage"},
    )

    llm = LLM(kv_transfer_config=ktc)  # minivllm: default model

    prefill_done.wait()  # block waiting for KV cache from prefill instance

    # Internally it'll first fetch KV cache before starting the decoding loop
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:  # minivllm: show the result
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}, "
              f"KV loaded for {output.num_cached_tokens} of {len(output.prompt_token_ids)} "
              f"prompt tokens")


if __name__ == "__main__":
    created_storage = not os.path.exists("local_storage")  # minivllm: clean up after ourselves
    prefill_done = Event()
    prefill_process = Process(target=run_prefill, args=(prefill_done,))
    decode_process = Process(target=run_decode, args=(prefill_done,))

    prefill_process.start()
    decode_process.start()

    # minivllm: decode_process.join(), but stop waiting if the prefill process died early.
    while decode_process.is_alive():
        decode_process.join(timeout=1)
        if not prefill_process.is_alive() and not prefill_done.is_set():
            decode_process.terminate()
    prefill_process.terminate()
    prefill_process.join()  # minivllm: reap it
    if created_storage:
        import shutil
        shutil.rmtree("local_storage", ignore_errors=True)
    raise SystemExit(decode_process.exitcode or 0)  # minivllm: report a failed decode
