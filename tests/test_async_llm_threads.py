"""Which thread runs ``AsyncLLM``'s engine loop: ``run_engine_loop`` runs it in the caller's thread
(``minivllm serve`` uses the main thread, the HTTP server a second one), ``start()`` in a
background thread. Either way, callers on an event loop in another thread get the offline
greedy outputs. And the server process exits, with status 1, when uvicorn cannot start."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading

import pytest

from conftest import generate_tokens, tiny_llm
from server_utils import child_env, stop

PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 8, 1, 6], [4]]


def _params():
    from minivllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _clients(async_llm, results: dict) -> None:
    """Every prompt at once from an event loop in this thread; then stop the engine loop."""
    async def one(i, prompt):
        last = None
        async for out in async_llm.generate(f"r{i}", {"prompt_token_ids": prompt}, _params()):
            last = out
        assert last.finished
        return list(last.outputs[0].token_ids)

    async def all_of_them():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])
    try:
        results["tokens"] = asyncio.run(all_of_them())
    finally:
        async_llm.shutdown()


def _after_each_step(async_llm, record) -> None:
    """Call ``record()`` in the engine loop's thread after every ``LLMEngine.step()``."""
    plain = async_llm.engine.step

    def step():
        out = plain()
        record()
        return out
    async_llm.engine.step = step


def _record_step_threads(async_llm) -> set:
    threads: set = set()
    _after_each_step(async_llm, lambda: threads.add(threading.get_ident()))
    return threads


def test_engine_loop_in_the_calling_thread(tiny_llama_dir):
    from minivllm.engine.async_llm import AsyncLLM
    llm = tiny_llm(tiny_llama_dir)
    expected = generate_tokens(llm, PROMPTS, _params())
    async_llm = AsyncLLM(llm)
    stepped_in = _record_step_threads(async_llm)
    results: dict = {}
    caller = threading.Thread(target=_clients, args=(async_llm, results))
    async_llm.run_engine_loop(started=caller.start)    # returns once the caller shut it down
    caller.join(timeout=60)
    assert results["tokens"] == expected
    assert stepped_in == {threading.get_ident()}
    assert not async_llm.is_running


def test_side_threads_keep_off_openmp_and_the_engine_thread_keeps_its_count(tiny_llama_dir):
    """``keep_off_openmp`` (KV loader, side channel, HTTP thread) makes that thread's torch ops
    single-threaded, without touching the caller's count. It also lowers the default of threads
    started later, so ``start()``'s engine thread sets the count of the thread that started it."""
    import torch

    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.utils import keep_off_openmp
    mine = torch.get_num_threads()
    seen = {}

    def side():
        keep_off_openmp()
        torch.randn(300_000).add(1.0)          # large enough for a parallel region
        seen["side"] = torch.get_num_threads()
    t = threading.Thread(target=side)
    t.start()
    t.join()
    assert seen["side"] == 1 and torch.get_num_threads() == mine
    async_llm = AsyncLLM(tiny_llm(tiny_llama_dir))
    _after_each_step(async_llm, lambda: seen.__setitem__("engine", torch.get_num_threads()))
    try:
        async_llm.start()
        _clients(async_llm, {})
    finally:
        torch.set_num_threads(mine)           # this process's default for later threads, again
    assert seen["engine"] == mine


def test_engine_loop_in_a_background_thread(tiny_llama_dir):
    from minivllm.engine.async_llm import AsyncLLM
    llm = tiny_llm(tiny_llama_dir)
    expected = generate_tokens(llm, PROMPTS, _params())
    async_llm = AsyncLLM(llm)
    stepped_in = _record_step_threads(async_llm)
    async_llm.start()
    with pytest.raises(RuntimeError, match="already running"):
        async_llm.start()
    with pytest.raises(RuntimeError, match="already running"):
        async_llm.run_engine_loop()
    results: dict = {}
    _clients(async_llm, results)                      # here: the event loop in this thread
    assert results["tokens"] == expected
    assert threading.get_ident() not in stepped_in and len(stepped_in) == 1
    assert not async_llm.is_running


def test_server_exits_with_1_when_its_port_is_taken(tiny_chat_dir, tmp_path):
    """The server binds its port before it builds the engine (api_server.create_server_socket,
    as vLLM's run_server does): a taken port ends the process with 1 at once, naming the port,
    and no engine loop is left running with no server in front of it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = open(tmp_path / "server.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "minivllm.serve", "--model", tiny_chat_dir,
                                 "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
                                 "--max-model-len", "256"],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env())
        try:
            assert proc.wait(timeout=180) == 1
        finally:
            stop(proc)
    text = (tmp_path / "server.log").read_text()
    assert "address already in use" in text.lower() and f"127.0.0.1:{port}" in text
    assert "minivllm serving" not in text            # it stopped before loading the model
