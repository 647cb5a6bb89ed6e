"""API keys on the HTTP doors: ``--api-key`` (or ``VLLM_API_KEY``, vLLM's name; also
``MINIVLLM_API_KEY``) for the server and the P/D proxy. vLLM's counterpart is
``AuthenticationMiddleware`` in vllm/entrypoints/serve/middleware/authenticate.py.

- Every path under a guarded prefix (``/v1``; the proxy adds ``/proxy``) needs
  ``Authorization: Bearer KEY``. ``/health`` and ``/metrics`` stay open, as in vLLM, so that load
  balancers and Prometheus need no key.
- A missing or wrong key is HTTP 401 with OpenAI's error JSON, answered before the body is read.
- Keys are compared as SHA-256 digests with ``hmac.compare_digest``: constant time, and equal
  lengths whatever the client sends.
- ``/openapi.json`` carries the bearer scheme and the 401 on every guarded operation, so that a
  client generator (or the fuzzer) knows to send the key.

The key never reaches a log line: only whether one is set.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
from typing import Optional, Sequence

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.responses import Response

from minivllm.entrypoints.openai.protocol import error_body

logger = logging.getLogger(__name__)
API_KEY_ENVS = ("VLLM_API_KEY", "MINIVLLM_API_KEY")
SCHEME = "bearerAuth"


def api_keys_from(flag: Optional[Sequence[str]]) -> list[str]:
    """The keys to accept: ``--api-key`` (one or more) wins over ``VLLM_API_KEY``, which wins over
    ``MINIVLLM_API_KEY``; empty strings mean none (vLLM's precedence)."""
    if flag:
        return [k for k in flag if k]
    for env in API_KEY_ENVS:
        if os.environ.get(env):
            return [os.environ[env]]
    return []


def generate_api_key() -> str:
    """A fresh random key (32 bytes, URL-safe), for ``--api-key auto``."""
    return "sk-minivllm-" + secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:             # a host name: it may resolve to anything
        return False


def warn_if_open(host: str, keys: Sequence[str], what: str = "the server") -> None:
    """A warning, not a refusal: binding beyond loopback without a key opens the door to anyone
    who can reach the address."""
    if not keys and not is_loopback(host):
        logger.warning("%s binds %s without an API key: anyone who can reach it may use it; "
                       "pass --api-key KEY (or set VLLM_API_KEY).", what, host)


def unauthorized() -> Response:
    body = error_body("Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                      "AuthenticationError", 401)
    return Response(json.dumps(body), status_code=401, media_type="application/json",
                    headers={"WWW-Authenticate": "Bearer"})


class APIKeyMiddleware:
    """Pure ASGI middleware (streams pass through untouched): 401 unless the bearer token is one
    of ``keys``, for paths starting with one of ``prefixes``; OPTIONS and other paths pass."""

    def __init__(self, app, keys: Sequence[str], prefixes: tuple[str, ...] = ("/v1",)) -> None:
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self.prefixes = prefixes

    def allowed(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for d in self._digests:           # no early exit: every key is compared
            ok |= hmac.compare_digest(digest, d)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith(self.prefixes) and not self.allowed(Headers(scope=scope)):
                await unauthorized()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def document_api_key(app: FastAPI, prefixes: tuple[str, ...]) -> None:
    """Add the bearer scheme, and a 401 answer, to every guarded operation of ``app``'s spec."""
    build = app.openapi

    def openapi() -> dict:
        spec = build()
        schemes = spec.setdefault("components", {}).setdefault("securitySchemes", {})
        if SCHEME not in schemes:
            schemes[SCHEME] = {"type": "http", "scheme": "bearer",
                               "description": "the server's --api-key"}
            error = {"description": "Missing or invalid API key",
                     "content": {"application/json": {
                         "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for path, ops in spec.get("paths", {}).items():
                if path.startswith(prefixes):
                    for op in ops.values():
                        op["security"] = [{SCHEME: []}]
                        op.setdefault("responses", {})["401"] = error
        return spec

    app.openapi = openapi


def install_api_key(app: FastAPI, keys: Sequence[str],
                    prefixes: tuple[str, ...] = ("/v1",)) -> None:
    """Guard ``app`` with ``keys`` (nothing to do when there are none)."""
    if keys:
        app.add_middleware(APIKeyMiddleware, keys=list(keys), prefixes=prefixes)
        document_api_key(app, prefixes)
