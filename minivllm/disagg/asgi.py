"""One HTTP request through an ASGI app in this process, streamed: how an engine replica runs the
OpenAI server's own app for a request that reached it through a ``DeploymentHandle``, with no
socket between them.

``httpx.ASGITransport`` would do the same but reads the whole body before it returns, and a
stream's events must leave as the engine makes them; this passes them on as the app sends them.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Optional


async def call_asgi(app: Any, path: str, body: Optional[dict], headers: dict,
                    method: str = "POST") -> AsyncIterator[Any]:
    """``method`` ``path`` with ``body`` (JSON; None: no body): yields ``{"status", "headers"}``, then each body chunk
    (bytes). Closing the generator early (the caller went away) tells the app the client
    disconnected, so the server aborts the request as it would for a closed socket."""
    payload = json.dumps(body).encode() if body is not None else b""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(b"content-type", b"application/json")] +
                        [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": {k.decode(): v.decode() for k, v in message["headers"]}}
            elif message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]
        task.result()                   # the app's own failure, if it raised
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5.0)
            except (asyncio.TimeoutError, Exception):      # noqa: BLE001  it is being aborted
                task.cancel()
