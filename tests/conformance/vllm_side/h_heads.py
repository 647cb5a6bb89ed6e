"""Case h, vLLM side: do minivllm's shipped EAGLE, EAGLE-3 and Medusa heads load in vLLM 0.32 (CPU)?

IN: {"model", "heads": {name: [method, head_dir]}, "prompts": [[token ids]], "max_tokens", "k"}.
For each head, one engine with ``speculative_config={"method": m, "model": head_dir,
"num_speculative_tokens": k}``; where it starts, greedy outputs (``ignore_eos``) and vLLM's
``vllm:spec_decode_*`` counters around that one ``generate``; where it does not, the refusal: the
exception's message, its traceback's tail, and the last error lines the engine printed (the suite
runs the EngineCore in this process; a spawned one would report a failure here only as "Engine
core initialization failed").
"""
import gc
import json
import os
import sys
import tempfile
import traceback


def counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num"):
            out[m.name] = [int(v) for v in m.values] if hasattr(m, "values") else int(m.value)
    return out


def last_error_lines(text: str) -> list[str]:
    keep = []
    for ln in text.splitlines():
        body = ln.split("] ", 1)[-1].strip()     # drop vLLM's "(Worker pid=..) ERROR ... [file:n]"
        if ("Error" in body or "assert " in body or "not supported" in body) and \
                "Traceback" not in body:
            keep.append(body)
    return keep[-8:]


def run_method(p: dict, method: str, head: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = {"method": method, "model": head, "num_speculative_tokens": p["k"]}
    # Capture what the EngineCore and worker (children sharing our stdout and stderr; vLLM logs
    # to stdout) print while they start.
    log = tempfile.TemporaryFile(mode="w+")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    for fd in saved:
        os.dup2(log.fileno(), fd)
    try:
        try:
            llm = LLM(model=p["model"], dtype="float32", enforce_eager=True, seed=0,
                      max_model_len=1024, disable_log_stats=False, speculative_config=spec)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in saved.items():
                os.dup2(old, fd)
                os.close(old)
    except Exception as e:  # noqa: BLE001  (the refusal is the result)
        log.seek(0)
        text = log.read()
        sys.stderr.write(text[-4000:])
        return {"loaded": False, "error_type": type(e).__name__, "error": str(e),
                "engine_errors": last_error_lines(text),
                "traceback_tail": traceback.format_exc()[-1500:]}
    log.seek(0)
    sys.stderr.write(log.read()[-2000:])
    try:
        before = counters(llm)
        outs = llm.generate([TokensPrompt(prompt_token_ids=q) for q in p["prompts"]],
                            SamplingParams(temperature=0.0, max_tokens=p["max_tokens"],
                                           ignore_eos=True), use_tqdm=False)
        after = counters(llm)
        diff = {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))]
                    if isinstance(v, list) else v - before.get(k, 0)) for k, v in after.items()}
        return {"loaded": True, "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "counters": diff}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        payload = json.load(f)
    result = {}
    for name, (method, head) in payload["heads"].items():
        result[name] = run_method(payload, method, head)
        with open(sys.argv[2] + ".partial", "w") as f:     # what a timeout leaves behind
            json.dump(result, f)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
