"""The OpenAI-compatible HTTP server, mirroring vllm/entrypoints/openai/api_server.py and
``vllm serve``: FastAPI routes in front of one ``AsyncLLM`` (one engine loop, in the main thread,
that batches every HTTP request continuously), served by uvicorn in a second thread.

    python -m minivllm.serve --port 8000            # or: minivllm serve --port 8000

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream`` gives server-sent events ending in ``data: [DONE]``), ``GET /metrics``. A body that
does not validate is HTTP 400 with OpenAI's error JSON whose ``param`` names the field (FastAPI's
default would be 422). ``/openapi.json`` documents every status each route returns (200, 400, 404
for an unknown model, 500 for a dead engine loop, 503 for overload) and the error schema.

``--api-key`` (or ``VLLM_API_KEY``) guards ``/v1/*`` with a bearer key (auth.py); ``--ssl-keyfile``
and ``--ssl-certfile`` make uvicorn serve HTTPS.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.auth import api_keys_from, install_api_key, warn_if_open
from minivllm.entrypoints.openai.tls import ssl_config, stop_when_idle
from minivllm.entrypoints.openai.errors import (error_response, generation_responses,
                                                install_error_handlers, without_422)
from minivllm.entrypoints.openai.metrics import render_metrics
from minivllm.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                  CompletionRequest, CompletionResponse,
                                                  ErrorResponse, ModelList, now)
from minivllm.entrypoints.openai.serving import OpenAIServing
from minivllm.utils import keep_off_openmp

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def build_app(async_llm: AsyncLLM, served_model_name: str,
              api_keys: tuple[str, ...] = ()) -> FastAPI:
    app = FastAPI(title="minivllm OpenAI-compatible server")
    serving = OpenAIServing(async_llm, served_model_name)
    app.state.async_llm = async_llm

    install_error_handlers(app)

    @app.get("/health", responses={200: {"description": "The engine loop is running",
                                         "content": {"text/plain": {"schema": {"type": "string"}}}},
                                   503: {"model": ErrorResponse,
                                         "description": "The engine loop stopped; names why"}})
    async def health():
        if async_llm.is_running:
            return PlainTextResponse("")
        return error_response(f"engine loop stopped: {async_llm.errored!r}", 503)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": now(), "owned_by": "minivllm",
            "max_model_len": serving.max_model_len}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(render_metrics(async_llm, served_model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", responses=generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await serving.create_chat_completion(body, raw)

    without_422(app)
    install_api_key(app, api_keys)          # /v1/* needs a key when one is set (auth.py)
    return app


class _HelpWithDefaults(argparse.RawDescriptionHelpFormatter,
                        argparse.ArgumentDefaultsHelpFormatter):
    """``--help``: the module's text as written, and every option with its default."""


def make_arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minivllm serve", description=__doc__,
                                 formatter_class=_HelpWithDefaults)
    ap.add_argument("model_tag", nargs="?", default=None, help="the model, as in `vllm serve M`")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint: HF folder, .gguf, hub id")
    ap.add_argument("--served-model-name", default=None, help="the name /v1/models shows")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind")
    ap.add_argument("--port", type=int, default=8000, help="port to bind")
    ap.add_argument("--api-key", nargs="+", default=None,
                    help="/v1/* needs 'Authorization: Bearer KEY' (unset: $VLLM_API_KEY, "
                         "then $MINIVLLM_API_KEY; none of them: open)")
    ap.add_argument("--ssl-keyfile", default=None, help="TLS: the server's private key (PEM)")
    ap.add_argument("--ssl-certfile", default=None, help="TLS: the server's certificate (PEM)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="requests per step")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="token budget per step (None: the engine's)")
    ap.add_argument("--max-model-len", type=int, default=None, help="None: the model's")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--num-gpu-blocks-override", type=int, default=None,
                    help="KV blocks (None: sized from memory)")
    ap.add_argument("--dtype", default="auto", help="weights and activations (auto: the checkpoint's)")
    ap.add_argument("--device", default="auto", help="where the engine runs")
    ap.add_argument("--attention-backend", default="auto", help="the attention implementation")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse cached prompt blocks")
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                    default=True, help="split long prompts across steps")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 3}')
    ap.add_argument("--kv-transfer-config", type=json.loads, default=None,
                    help='JSON, e.g. {"kv_connector": "SharedStorageConnector", ...}')
    ap.add_argument("--max-pending-requests", type=int, default=256,
                    help="requests in flight (running + waiting) beyond which the server "
                         "answers 503")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch CPU threads for this instance (None: torch's choice)")
    ap.add_argument("--log-level", default="warning", help="uvicorn's")
    return ap


def build_async_llm(args: argparse.Namespace) -> AsyncLLM:
    """The server's engine, its loop not started (``main`` runs it: ``run_engine_loop``)."""
    from minivllm.entrypoints.llm import LLM
    if args.max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}.")
    if args.num_threads is not None:
        import torch
        torch.set_num_threads(args.num_threads)
    kv = args.kv_transfer_config
    if kv is not None and not isinstance(kv, dict):
        raise ValueError("--kv-transfer-config must be a JSON object.")
    llm = LLM(model=args.model, speculative_config=args.speculative_config,
              kv_transfer_config=kv,
              seed=args.seed, block_size=args.block_size,
              enable_prefix_caching=args.enable_prefix_caching,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_gpu_blocks_override=args.num_gpu_blocks_override, dtype=args.dtype,
              device=args.device, attention_backend=args.attention_backend,
              enable_chunked_prefill=args.enable_chunked_prefill)
    return AsyncLLM(llm, max_pending_requests=args.max_pending_requests)


def create_server_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the engine is built, as vLLM's ``run_server`` binds it with
    ``create_server_socket``: the port is held while the model loads, so nothing else takes it
    meanwhile (not this engine's own KV side channel, not another process), and a taken port
    fails at once, not after the load. uvicorn listens on it once the engine loop runs."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn's own bind
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: Optional[list[str]] = None) -> None:
    """The engine loop runs in this (the main) thread and uvicorn in a second one: on the CPU a
    model stepped from a second thread runs its OpenMP regions slower (engine/async_llm.py's
    docstring has the measurement). SIGINT/SIGTERM ask uvicorn to finish its requests and stop;
    then the engine loop stops. A second signal stops uvicorn without waiting."""
    import signal
    import threading

    import uvicorn
    args = make_arg_parser().parse_args(argv)
    try:
        tls = ssl_config(args.ssl_keyfile, args.ssl_certfile)
    except ValueError as e:
        make_arg_parser().error(str(e))
    if args.model_tag is not None:
        args.model = args.model_tag
    try:
        sock = create_server_socket(args.host, args.port)
    except OSError as e:
        sys.exit(f"minivllm cannot serve on {args.host}:{args.port}: {e}")
    try:
        async_llm = build_async_llm(args)
    except ValueError as e:   # a bad engine option: a usage error naming the field (exit 2)
        make_arg_parser().error(str(e))
    name = args.served_model_name or args.model
    keys = api_keys_from(args.api_key)
    warn_if_open(args.host, keys)
    # The app has no startup or shutdown work: without a lifespan task, a stop (which may not wait
    # for idle connections, tls.py) has no task to cancel and logs no CancelledError traceback.
    server = uvicorn.Server(uvicorn.Config(build_app(async_llm, name, tuple(keys)), host=args.host,
                                           port=args.port, log_level=args.log_level,
                                           lifespan="off", **tls))
    stop_when_idle(server)          # idle TLS connections must not hold up a stop (tls.py)

    def serve_http() -> None:
        keep_off_openmp()   # no OpenMP team beside the engine's (minivllm/utils.py keep_off_openmp)
        try:
            server.run(sockets=[sock])
        finally:               # also when uvicorn could not start (say, a bad certificate)
            async_llm.shutdown()

    http = threading.Thread(target=serve_http, name="minivllm-http", daemon=True)

    def on_signal(signum, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    scheme = "https" if args.ssl_certfile else "http"
    port = sock.getsockname()[1]                    # --port 0: the one the OS chose
    host = f"[{args.host}]" if ":" in args.host else args.host     # an IPv6 address in a URL
    print(f"minivllm serving {name} on {scheme}://{host}:{port} (pid {os.getpid()}, "
          f"API key {'required' if keys else 'not required'})", flush=True)
    async_llm.run_engine_loop(started=http.start)
    # The loop ends when uvicorn has stopped, or when a step raised: then the server stays up,
    # answering /health with 503 and why, until it is stopped.
    while http.is_alive():
        http.join(timeout=0.5)
    sys.exit(0 if server.started else 1)
