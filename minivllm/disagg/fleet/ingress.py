"""The fleet's ingress: the P/D proxy's endpoints (proxy.build_app: the same validation, 400s and
API key) over ``DeploymentHandle``s, plus ``GET /fleet`` and ``GET /fleet/records``. It plays the
part of Ray Serve LLM's P/D orchestrator (``PDOrchestratorMixin`` in Ray 2.60's
``ray/llm/_internal/serve/serving_patterns/prefill_decode/pd_server.py``), which prefills through
a handle and then decodes, from its own deployment rather than from the decode engine's.

Per request, decode first (llm-d's ``disagg-profile-handler`` and ``prefix-based-pd-decider``):

1. Tokenize the prompt (the chat template included), so that the ingress hashes the same blocks
   the engines' prefix caches hold.
2. With ``--router kv``, pick the decode replica from the decode pool's KV index
   (kv_pool.PoolView.choose: Dynamo's score, lowest wins). When it holds all but at most
   ``--pd-min-uncached-tokens`` of the prompt, it computes the rest itself. Otherwise a prefill
   replica, picked the same way, prefills, and its ``kv_transfer_params`` go to the decode call.
3. Stream the decode call back (``handle.options(stream=True)``) and record the route (the
   candidates, the blocks each held, their scores, the pick, whether the prefill was remote).

A replica that dies is Serve's to notice and replace: the request goes to another (before its
first byte) or ends with an OpenAI error event (mid-stream).
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from collections import Counter
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from minivllm.disagg.fleet.kv_index import needs_remote_prefill
from minivllm.disagg.fleet.replicas import NAMESPACE, ROLES, readable
from minivllm.disagg.proxy import (DisaggProxy, _error, build_app, prefill_body,
                                   stream_error)

HEALTH_TIMEOUT_S = 10.0


class FleetIngress:
    """The ingress deployment, built with ``serve.ingress()`` and no app: Serve calls
    ``__serve_build_asgi_app__`` once the replica runs, and proxy.build_app's endpoints call
    ``handle``, ``models`` and ``health``. ``prefill``, ``decode``: the engine deployments'
    handles (Serve passes a bound deployment to a constructor as its handle)."""

    def __init__(self, config: dict, prefill: Any, decode: Any) -> None:
        import ray

        from minivllm.disagg.fleet.kv_pool import pool_view
        from minivllm.model_executor.model_loader import load_tokenizer, resolve_model_path
        self.config, self.handles = config, {"prefill": prefill, "decode": decode}
        self.state = state = ray.get_actor(config["state_actor"], namespace=NAMESPACE)
        self.tokenizer = load_tokenizer(resolve_model_path(config["model"]))
        self.records: collections.deque = collections.deque(maxlen=1000)  # /proxy/requests
        # In flight per replica, as this ingress placed them: the score's load term (Dynamo's
        # router counts its active sequences the same way). Requests, and their prompt blocks.
        self.ongoing = {role: Counter() for role in ROLES}
        self.blocks_in_flight = {role: Counter() for role in ROLES}
        self.pools = {role: pool_view(role) for role in ROLES}
        for role, pool in self.pools.items():      # a replica gone without draining: "lost"
            pool.on_left = (lambda r: lambda uid: state.record_event.remote(r, uid, "lost"))(role)

    async def __serve_build_asgi_app__(self) -> Any:
        keys = await self.state.keys.remote()
        app = build_app(self, tuple(keys["api_keys"]), guarded=("/v1", "/proxy", "/fleet"))

        @app.get("/fleet")
        async def fleet():
            return await self.state.view.remote()

        @app.get("/fleet/records")
        async def records():
            return await self.state.records.remote()
        return app

    def prompt_token_ids(self, path: str, body: dict) -> Optional[list]:
        """The prompt as the engine will see it, or None (a batch, or a body the replica will
        refuse with its own 400)."""
        try:
            if path.endswith("chat/completions"):
                from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
                chat = ChatCompletionRequest(**body)
                text = self.tokenizer.apply_chat_template(
                    chat.template_messages(), add_generation_prompt=chat.add_generation_prompt,
                    tokenize=False)
            else:
                text = body.get("prompt")
            if isinstance(text, list) and text and all(isinstance(t, int) for t in text):
                return list(text)
            # As LLMEngine.tokenize_prompt encodes a text prompt, so both hash the same blocks.
            return self.tokenizer.encode(text) if isinstance(text, str) else None
        except Exception:                                # noqa: BLE001  the replica says why
            return None

    def _choose(self, role: str, token_ids: Optional[list]) -> tuple[Optional[str], dict]:
        if self.config["router"] != "kv" or not token_ids:
            return None, {}
        return self.pools[role].choose(token_ids, dict(self.ongoing[role]),
                                       dict(self.blocks_in_flight[role]),
                                       float(self.config["overlap_score_weight"]))

    def _count(self, role: str, uid: str, num_blocks: int, sign: int) -> None:
        self.ongoing[role][uid] += sign
        self.blocks_in_flight[role][uid] += sign * num_blocks

    async def _call(self, role: str, path: str, body: Optional[dict], request_id: str,
                    replica: Optional[str], num_blocks: int = 0,
                    method: str = "POST") -> AsyncIterator[Any]:
        """The role's ``generate`` through its handle, streamed; counted in flight on ``replica``
        (the pick) from now, so that the next pick sees it, else on the replica that answers."""
        # A GET (the models list) takes no round-robin turn: it is not a request to balance.
        gen = self.handles[role].options(stream=True).generate.remote(
            path, body, request_id, routing={"replica": replica, "turn": method != "GET"},
            method=method)
        uid, done = replica, False
        if uid is not None:
            self._count(role, uid, num_blocks, +1)
        try:
            async for item in gen:
                if isinstance(item, dict) and uid is None:
                    uid = item["replica"]
                    self._count(role, uid, num_blocks, +1)
                yield item
            done = True
        finally:
            if uid is not None:
                self._count(role, uid, num_blocks, -1)
            if not done:
                gen.cancel()              # the client went away: the replica aborts the request

    async def handle(self, path: str, raw: Request) -> Response:
        body, request_id, bad_request = await DisaggProxy._read_request(raw)
        if bad_request is not None:
            return bad_request
        token_ids = self.prompt_token_ids(path, body)
        if token_ids and path == "/v1/completions" and not body.get("echo"):
            body = dict(body, prompt=token_ids)      # the engines hash exactly these tokens
        pick, droute = self._choose("decode", token_ids)
        remote = pick is None or needs_remote_prefill(
            len(token_ids), droute["cached_blocks"], droute["block_size"],
            int(self.config["pd_min_uncached_tokens"]))
        now = time.time()
        route = {"time": now, "at": readable(now), "request_id": request_id,
                 "prompt_tokens": len(token_ids) if token_ids else None,
                 "prompt_blocks": droute.get("prompt_blocks"), "weight": droute.get("weight"),
                 "candidates": droute.get("candidates", []), "pick": pick,
                 "remote_prefill": remote, "prefill": None}
        self.records.append(route)
        if remote:
            # The decode pick counts as in flight through the prefill too, so that the picks made
            # meanwhile see it; its decode call counts it again, from its start.
            held = (pick, route["prompt_blocks"] or 0)
            if pick is not None:
                self._count("decode", *held, +1)
            try:
                kv_params, client_error = await self._prefill(path, body, request_id, token_ids,
                                                              route)
            finally:
                if pick is not None:
                    self._count("decode", *held, -1)
            if client_error is not None:
                return client_error
            if kv_params is not None:
                body = dict(body, kv_transfer_params=kv_params)
        try:
            return await self._decode(path, body, request_id, pick, route)
        finally:
            self.state.record_routes.remote([route])          # fire and forget

    async def _prefill(self, path: str, body: dict, request_id: str, token_ids: Optional[list],
                       route: dict) -> tuple[Optional[dict], Optional[Response]]:
        """The proxy's prefill stage through the prefill handle: (kv_transfer_params or None,
        a client-error response to pass back or None). A failed prefill is skipped: the decode
        replica then computes the prompt itself (slower, the same output)."""
        pick, proute = self._choose("prefill", token_ids)
        prefill = route["prefill"] = dict(proute, served_by=None, error=None)
        status, content = 0, b""
        try:
            async for item in self._call("prefill", path, prefill_body(body), request_id, pick,
                                         proute.get("prompt_blocks", 0)):
                if isinstance(item, dict):
                    status, prefill["served_by"] = item["status"], item["replica"]
                else:
                    content += item
        except Exception as e:                            # noqa: BLE001  Serve replaces it
            prefill["error"] = f"{type(e).__name__}: {e}"[:300]
            return None, None
        if 400 <= status < 500:                           # the request itself is bad: say so
            return None, Response(content, status, media_type="application/json")
        if status != 200:
            prefill["error"] = f"HTTP {status}"
            return None, None
        answer = json.loads(content)
        prefill["usage"] = answer.get("usage")            # its prompt tokens and cache hits
        return answer.get("kv_transfer_params"), None

    async def _decode(self, path: str, body: dict, request_id: str, pick: Optional[str],
                      route: dict) -> Response:
        """The decode call; a replica that fails before its first byte is skipped once (Serve
        routes the retry to another, the pick no longer pinned). Serve's HTTP proxy puts the
        ``X-Request-Id`` on the answer."""
        for replica in (pick, None):
            gen = self._call("decode", path, body, request_id, replica,
                             route["prompt_blocks"] or 0)
            try:
                head = await gen.__anext__()
            except Exception as e:                        # noqa: BLE001  died before answering
                route["decode_error"] = f"{type(e).__name__}: {e}"[:300]
                continue
            route["served_by"] = head["replica"]
            media = head["headers"].get("content-type", "application/json")
            headers = {"X-Decode-Instance": head["replica"],
                       "X-Prefill-Instance": str((route["prefill"] or {}).get("served_by")),
                       "X-Remote-Prefill": str(route["remote_prefill"]).lower()}
            if body.get("stream"):
                return StreamingResponse(_relay(gen), status_code=head["status"],
                                         media_type=media, headers=headers)
            content = b"".join([chunk async for chunk in gen])
            return Response(content, head["status"], media_type=media, headers=headers)
        return _error(f"no decode replica answered ({route.get('decode_error')}).", 503)

    async def models(self) -> Response:
        items = [x async for x in self._call("decode", "/v1/models", None, uuid.uuid4().hex,
                                             None, method="GET")]
        return Response(b"".join(items[1:]), items[0]["status"], media_type="application/json")

    async def health(self) -> Response:
        """200 once each pool has a replica that answers."""
        try:
            for role in ROLES:
                await asyncio.wait_for(self.handles[role].ready.remote(), HEALTH_TIMEOUT_S)
        except Exception as e:                            # noqa: BLE001
            return _error(f"not ready: {type(e).__name__}: {e}", 503)
        return PlainTextResponse("")


async def _relay(gen: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """The decode replica's bytes as they come; one that dies mid-stream ends the stream with an
    OpenAI error event (the client sees a clear error, not a hang)."""
    try:
        async for chunk in gen:
            yield chunk
    except Exception as e:                                # noqa: BLE001  the replica died
        yield stream_error(f"decode replica failed mid-stream: {type(e).__name__}")
    finally:
        await gen.aclose()                                # Serve cancels the replica's call
