"""The P/D proxy's round robin (minivllm/disagg/proxy.py) counts requests only: an OpenAI client
that lists the models before each chat, as notebook 06 does, still gets its chats spread over the
decode instances in turn. The proxy runs as ``python -m minivllm.disagg.proxy`` (a child process,
stopped by its PID); the prefill and decode instances are small HTTP servers in this process, on
127.0.0.1, that answer the way ``minivllm.serve`` does and name themselves in each reply."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from server_utils import start_proxy, stop

MODEL = "fake-model"


def _chat_reply(text: str, kv_transfer_params=None) -> dict:
    reply = {"id": "chatcmpl-0", "object": "chat.completion", "created": int(time.time()),
             "model": MODEL, "choices": [{"index": 0, "finish_reason": "length",
                                          "message": {"role": "assistant", "content": text}}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    if kv_transfer_params is not None:
        reply["kv_transfer_params"] = kv_transfer_params
    return reply


def _instance(name: str) -> tuple[ThreadingHTTPServer, str]:
    """An instance named ``name``: /health, /v1/models, and chats answered with its name (a
    prefill request, ``do_remote_decode``, gets the ``kv_transfer_params`` a decode one needs)."""
    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                        "created": 0, "owned_by": name}]})
            else:
                self._send({})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prefill = (body.get("kv_transfer_params") or {}).get("do_remote_decode")
            self._send(_chat_reply(name, {"do_remote_prefill": True} if prefill else None))

        def log_message(self, *args) -> None:    # no request log on stderr
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    servers = {name: _instance(name) for name in ("prefill", "decode0", "decode1")}
    urls = {name: url for name, (_, url) in servers.items()}
    log = str(tmp_path_factory.mktemp("proxy") / "proxy.log")
    url, proc = start_proxy([urls["prefill"]], [urls["decode0"], urls["decode1"]], log)
    try:
        yield url, urls
    finally:
        stop(proc)
        for server, _ in servers.values():
            server.shutdown()
            server.server_close()


def test_listing_the_models_takes_no_turn(proxy):
    url, urls = proxy
    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=30)
    served = []
    for i in range(4):
        model = client.models.list().data[0].id          # notebook 06's chat loop, as written
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=1, messages=[{"role": "user", "content": f"chat {i}"}])
        served.append(raw.parse().choices[0].message.content)
        assert raw.headers["x-decode-instance"] == urls[served[-1]]
    assert served == ["decode0", "decode1", "decode0", "decode1"]
    # The proxy's own log of the chats agrees.
    records = httpx.get(url + "/proxy/requests").json()[-4:]
    assert [r["decode"] for r in records] == [urls[n] for n in served]
