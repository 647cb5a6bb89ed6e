"""HTTPS for the server and the P/D proxy: vLLM's ``--ssl-keyfile`` / ``--ssl-certfile``, handed
to uvicorn (``serve_http`` in vllm/entrypoints/launcher.py), and one fix for stopping.

Over TLS, closing a connection sends ``close_notify`` and waits for the peer's answer (asyncio
waits up to 30 s). A client that keeps an idle keep-alive connection open (an ``openai`` client,
the proxy's pool) does not answer until it next uses it, so uvicorn's graceful stop would wait on
it: SIGTERM would take 30 s. ``stop_when_idle`` lets uvicorn stop once no request is in flight;
requests still running are waited for, as without TLS.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional


def ssl_config(keyfile: Optional[str], certfile: Optional[str]) -> dict[str, Any]:
    """uvicorn.Config's TLS arguments (empty: plain HTTP); both files or neither."""
    if bool(keyfile) != bool(certfile):
        raise ValueError("give both --ssl-keyfile and --ssl-certfile, or neither")
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile} if certfile else {}


def stop_when_idle(server: Any) -> None:
    """A daemon thread: once ``server`` (a ``uvicorn.Server``) is asked to exit and none of its
    request tasks is left, stop waiting for idle connections (``force_exit``)."""
    def watch() -> None:
        while not server.force_exit:
            if server.should_exit and server.started and not server.server_state.tasks:
                server.force_exit = True
            time.sleep(0.1)
    threading.Thread(target=watch, name="minivllm-http-stop", daemon=True).start()
