"""``python -m minivllm.disagg.proxy --prefill URL [URL ...] --decode URL [URL ...] --port P``: the
disaggregated-serving proxy, mirroring vLLM's example proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, ``_handle_completions``).

Every request is served in two stages, with the same ``X-Request-Id`` on both:

1. Prefill: the next prefill instance (round robin) gets a copy of the body with ``max_tokens=1``,
   ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true}``; it computes the prompt's
   KV, which its connector publishes, and answers with the ``kv_transfer_params`` a decode
   instance needs to find that KV. Its one generated token is dropped.
2. Decode: the next decode instance (round robin) gets the client's original body plus those
   ``kv_transfer_params``; it loads the prompt's KV, recomputes only the last prompt token, and
   its answer (a stream or not) goes back to the client as it comes.

Only those requests take a turn: ``GET /v1/models`` asks the decode instance next in turn (the
next one up, if it is down) and leaves the rotation where it is (a client that lists the models
before each chat still gets its chats spread over the decode instances).

Bodies are validated with the server's own request models first: a malformed one is a 400 from
the proxy (OpenAI's error JSON, ``error.param`` naming the field) and reaches no instance. A 4xx
from an instance (a prompt too long for the model, an unknown model) reaches the client unchanged.

Failures: a prefill instance that errors or times out is skipped and the request goes straight to
a decode instance, which then computes the prompt itself (slower, same output). A decode instance
that cannot be reached (or answers 5xx) is marked down for a while and the next one is tried; when
none answers the client gets a 503 naming them. Each answer carries headers saying which instances
served it; ``GET /proxy/requests`` lists the recent ones with their prefill times.

Across machines: ``--api-key`` guards ``/v1/*`` and ``/proxy/*`` (entrypoints/openai/auth.py);
the proxy sends the instances its own ``--backend-api-key`` (default: its own key), never the
client's header. ``--ssl-keyfile``/``--ssl-certfile`` serve HTTPS; ``--backend-ca`` is the CA that
signed the instances' certificates, for ``https://`` instance URLs.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from minivllm.entrypoints.openai.auth import api_keys_from, install_api_key, warn_if_open
from minivllm.entrypoints.openai.tls import ssl_config, stop_when_idle
from minivllm.entrypoints.openai.errors import (error_response, generation_responses,
                                                install_error_handlers, without_422)
from minivllm.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                  CompletionRequest, CompletionResponse,
                                                  ErrorResponse)


@dataclass
class Instance:
    url: str
    down_until: float = 0.0      # monotonic time before which it is skipped after a failure

    def mark_down(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds


class RoundRobin:
    """vLLM's ``itertools.cycle`` over a pool, skipping instances marked down (all down: try all)."""

    def __init__(self, urls: list[str]) -> None:
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self._next = 0

    def order(self) -> list[Instance]:
        """Every instance once, starting at the next in turn, the ones marked down last; a
        request takes the turn, so the next call starts one further on."""
        ring = self.peek()
        if self.instances:
            self._next = (self._next + 1) % len(self.instances)
        return ring

    def peek(self) -> list[Instance]:
        """The same list, the turn left where it is: for a call that is not a request to serve
        (``GET /v1/models``, which an OpenAI client sends before each chat in some code: were it
        to take a turn, every chat after it would land on the same instance)."""
        n = len(self.instances)
        ring = [self.instances[(self._next + i) % n] for i in range(n)]
        now = time.monotonic()
        return [i for i in ring if i.down_until <= now] + [i for i in ring if i.down_until > now]


def prefill_body(body: dict) -> dict:
    """The body a prefill instance gets: one token, no stream, and the request to keep its KV for
    a remote decode (``kv_transfer_params={"do_remote_decode": true}``)."""
    pbody = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in pbody:
        pbody["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):
        pbody.pop(key, None)
    return pbody


def _error(message: str, code: int) -> Response:
    return error_response(message, code)


class DisaggProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str],
                 prefill_timeout: float = 120.0, down_seconds: float = 5.0,
                 backend_api_key: Optional[str] = None, backend_ca: Optional[str] = None) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL.")
        self.prefill = RoundRobin(prefill_urls)
        self.decode = RoundRobin(decode_urls)
        self.prefill_timeout = prefill_timeout
        self.down_seconds = down_seconds
        self.records: collections.deque = collections.deque(maxlen=1000)
        # The proxy's own key for the instances; the client's Authorization never goes on.
        self.auth = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        # No overall timeout on decode: a long generation is not a failure. ``backend_ca``: the
        # CA that signed the instances' certificates (https:// instance URLs).
        verify = ssl.create_default_context(cafile=backend_ca) if backend_ca else True
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), verify=verify,
                                        limits=httpx.Limits(max_connections=None))

    async def _prefill_stage(self, path: str, body: dict, request_id: str, record: dict):
        """Returns (kv_transfer_params or None, a client-error response to pass back or None)."""
        pbody = prefill_body(body)
        ring = self.prefill.order()
        inst = ring[0] if ring else None
        if inst is None or inst.down_until > time.monotonic():   # none, or every one is down
            record["prefill_error"] = "all prefill instances down"
            return None, None
        record["prefill"] = inst.url
        t0 = time.perf_counter()
        try:
            resp = await self.client.post(inst.url + path, json=pbody, timeout=self.prefill_timeout,
                                          headers={"X-Request-Id": request_id, **self.auth})
        except httpx.HTTPError as e:
            inst.mark_down(self.down_seconds)
            record["prefill_error"] = f"{type(e).__name__}: {e}"
            return None, None
        record["prefill_s"] = time.perf_counter() - t0
        if 400 <= resp.status_code < 500:            # the request itself is bad: say so now
            return None, Response(resp.content, resp.status_code, media_type="application/json")
        if resp.status_code != 200:
            record["prefill_error"] = f"HTTP {resp.status_code}"
            return None, None
        return resp.json().get("kv_transfer_params"), None

    @staticmethod
    async def _read_request(raw: Request) -> tuple[Optional[dict], str, Optional[Response]]:
        """The body (a JSON object), the request id (the client's ``X-Request-Id``, else a new
        one), and the 400 to answer instead when the body is not a JSON object."""
        request_id = raw.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            body = await raw.json()
            assert isinstance(body, dict)
        except Exception:                             # noqa: BLE001
            return None, request_id, _error("the request body must be a JSON object.", 400)
        return body, request_id, None

    async def handle(self, path: str, raw: Request) -> Response:
        body, request_id, bad_request = await self._read_request(raw)
        if bad_request is not None:
            return bad_request
        record = {"request_id": request_id, "path": path, "prefill": None, "prefill_s": None,
                  "prefill_error": None, "decode": None, "kv_transfer_params": None}
        self.records.append(record)
        kv_params, client_error = await self._prefill_stage(path, body, request_id, record)
        if client_error is not None:
            return client_error
        record["kv_transfer_params"] = kv_params
        dbody = dict(body)
        if kv_params is not None:
            dbody["kv_transfer_params"] = kv_params
        tried = []
        for inst in self.decode.order():
            tried.append(inst.url)
            req = self.client.build_request("POST", inst.url + path, json=dbody,
                                            headers={"X-Request-Id": request_id, **self.auth})
            try:
                resp = await self.client.send(req, stream=True)
                if resp.status_code >= 500:          # overloaded or broken: try the next one
                    await resp.aclose()
                    continue
                if not body.get("stream"):
                    content = await resp.aread()
            except httpx.HTTPError:                  # unreachable or died: skip it for a while
                inst.mark_down(self.down_seconds)
                continue
            record["decode"] = inst.url
            headers = {"X-Request-Id": request_id, "X-Decode-Instance": inst.url,
                       "X-Prefill-Instance": str(record["prefill"]),
                       "X-Prefill-Status": "ok" if record["prefill_error"] is None else "failed",
                       "X-Prefill-Seconds": f"{record['prefill_s'] or 0.0:.6f}"}
            media = resp.headers.get("content-type", "application/json")
            if body.get("stream"):
                return StreamingResponse(_relay(resp), status_code=resp.status_code,
                                         media_type=media, headers=headers)
            return Response(content, resp.status_code, media_type=media, headers=headers)
        return _error(f"no decode instance answered (tried {', '.join(tried)}).", 503)

    async def models(self) -> Response:
        """``GET /v1/models``: the answer of the decode instance next in turn (or the next one
        up), asked without taking a request's turn (``RoundRobin.peek``)."""
        for inst in self.decode.peek():
            try:
                r = await self.client.get(inst.url + "/v1/models", timeout=5.0, headers=self.auth)
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return _error("no decode instance answered.", 503)

    async def health(self) -> Response:
        async def ok(inst: Instance) -> bool:
            try:
                return (await self.client.get(inst.url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False
        insts = self.prefill.instances + self.decode.instances
        states = await asyncio.gather(*(ok(i) for i in insts))
        down = [i.url for i, s in zip(insts, states) if not s]
        return _error(f"instances not ready: {down}", 503) if down else PlainTextResponse("")


async def _relay(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The decode instance's bytes as they come; a decode instance that dies mid-stream ends the
    stream with an OpenAI error event (the client sees a clear error, not a hang)."""
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        yield stream_error(f"decode instance failed mid-stream: {e!r}")
    finally:
        await resp.aclose()                     # also tells the decode instance to abort


def stream_error(message: str) -> bytes:
    """The end of a stream whose decode side failed: an OpenAI error event, then ``[DONE]``."""
    err = {"error": {"message": message, "type": "InternalServerError", "param": None,
                     "code": 502}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


def build_app(proxy: DisaggProxy, api_keys: tuple[str, ...] = (),
              guarded: tuple[str, ...] = ("/v1", "/proxy")) -> FastAPI:
    """The proxy's endpoints over ``proxy``: a ``DisaggProxy``, or anything with its ``handle``,
    ``models``, ``health`` and ``records`` (the fleet's ingress, fleet/ingress.py)."""
    app = FastAPI(title="minivllm P/D proxy")
    install_error_handlers(app)
    faults = dict(server_fault="never from the proxy itself; a decode instance's 5xx is retried "
                               "on the next one",
                  overload="no decode instance answered")

    # The bodies are checked with the server's own models before anything is forwarded; what
    # needs the model (the chat template, the context length) is checked by the prefill instance,
    # whose 4xx is passed back. The instances get the client's JSON as sent, unknown fields too.
    @app.post("/v1/completions", responses=generation_responses(CompletionResponse, **faults))
    async def completions(body: CompletionRequest, raw: Request):
        return await proxy.handle("/v1/completions", raw)

    @app.post("/v1/chat/completions",
              responses=generation_responses(ChatCompletionResponse, **faults))
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await proxy.handle("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models():
        return await proxy.models()

    @app.get("/health", responses={
        200: {"description": "Every instance is healthy",
              "content": {"text/plain": {"schema": {"type": "string"}}}},
        503: {"model": ErrorResponse, "description": "Some instance is not; names them"}})
    async def health():
        return await proxy.health()

    @app.get("/proxy/requests")
    async def requests():
        return list(proxy.records)

    without_422(app)
    install_api_key(app, api_keys, prefixes=guarded)   # /proxy/requests names blocks
    return app


def main(argv: Optional[list[str]] = None) -> None:
    import uvicorn
    ap = argparse.ArgumentParser(prog="python -m minivllm.disagg.proxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instance URLs")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instance URLs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill-timeout", type=float, default=120.0,
                    help="seconds before a prefill is given up and the decode instance recomputes")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--api-key", nargs="+", default=None,
                    help="clients must send 'Authorization: Bearer KEY' (default: $VLLM_API_KEY, "
                         "then $MINIVLLM_API_KEY)")
    ap.add_argument("--backend-api-key", default=None,
                    help="the key the proxy sends to the instances (default: "
                         "$MINIVLLM_BACKEND_API_KEY, else the proxy's own first key)")
    ap.add_argument("--ssl-keyfile", default=None, help="TLS: the proxy's private key (PEM)")
    ap.add_argument("--ssl-certfile", default=None, help="TLS: the proxy's certificate (PEM)")
    ap.add_argument("--backend-ca", default=None,
                    help="CA file (PEM) that signed the instances' certificates")
    args = ap.parse_args(argv)
    try:
        tls = ssl_config(args.ssl_keyfile, args.ssl_certfile)
    except ValueError as e:
        ap.error(str(e))
    keys = api_keys_from(args.api_key)
    backend_key = (args.backend_api_key or os.environ.get("MINIVLLM_BACKEND_API_KEY")
                   or (keys[0] if keys else None))
    warn_if_open(args.host, keys, "the P/D proxy")
    proxy = DisaggProxy(args.prefill, args.decode, prefill_timeout=args.prefill_timeout,
                        backend_api_key=backend_key, backend_ca=args.backend_ca)
    scheme = "https" if args.ssl_certfile else "http"
    print(f"minivllm P/D proxy on {scheme}://{args.host}:{args.port}: prefill {args.prefill}, "
          f"decode {args.decode} (API key {'required' if keys else 'not required'})", flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(proxy, tuple(keys)), host=args.host,
                                           port=args.port, log_level=args.log_level, **tls))
    stop_when_idle(server)          # idle TLS connections must not hold up a stop (tls.py)
    server.run()


if __name__ == "__main__":
    main()
