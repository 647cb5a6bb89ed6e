"""Case k, vLLM side: KV events. One in-process engine publishes its events (``kv_events_config``,
ZMQ) while it prefills the prompts one after another; this script subscribes, and also decodes
minivllm's stream (given as raw payloads) with vLLM's own ``KVEventBatch`` decoder.

Input: ``{"model", "prompts": [[ids]], "block_size", "num_gpu_blocks", "minivllm_payloads":
[hex]}``. Output: ``{"vllm": [batch as builtins], "minivllm": [batch as builtins, decoded by
vLLM's classes]}``; hashes as hex strings.
"""
import socket
import time

import msgspec
import zmq
from common import make_llm, read_input, shutdown, write_output


def _builtins(batch) -> dict:
    """A batch as JSON: each event's fields by name, hashes as hex."""
    def plain(v):
        if isinstance(v, bytes):
            return v.hex()
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    events = [{"type": type(e).__name__, **{f: plain(getattr(e, f)) for f in e.__struct_fields__}}
              for e in batch.events]
    return {"ts": batch.ts, "events": events}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":            # vLLM may spawn processes: the guard is required
    from vllm import SamplingParams
    from vllm.distributed.kv_events import KVEventBatch
    args = read_input()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    theirs_of_ours = [_builtins(decoder.decode(bytes.fromhex(p)))
                      for p in args["minivllm_payloads"]]
    port = _free_port()
    llm = make_llm(args["model"], block_size=args["block_size"], enable_prefix_caching=True,
                   max_model_len=args["max_model_len"],
                   num_gpu_blocks_override=args["num_gpu_blocks"],
                   kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                     "endpoint": f"tcp://*:{port}"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)                   # a PUB socket drops what it sends before SUB joins
    got = []
    for ids in args["prompts"]:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
        while sub.poll(1000):
            _, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), _builtins(decoder.decode(payload))))
    assert [s for s, _ in got] == list(range(len(got))), "lost a batch"
    write_output({"vllm": [b for _, b in got], "minivllm": theirs_of_ours})
    shutdown(llm)
