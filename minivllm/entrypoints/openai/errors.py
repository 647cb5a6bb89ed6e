"""OpenAI's error JSON for every refusal of the server and the P/D proxy, and the parts of
/openapi.json that say so. vLLM's counterparts are
``ErrorResponse`` and the exception handlers in vllm/entrypoints/openai/api_server.py.

- A body that does not validate is HTTP 400 (FastAPI's default is 422), ``error.param`` naming the
  field as the client wrote it (``messages.0.content``).
- Starlette's own refusals (a body that is not UTF-8, an unknown path) get the same JSON.
- ``without_422`` drops FastAPI's 422 and its schemas from the spec, since no route returns it.
"""
from __future__ import annotations

import json
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.entrypoints.openai.protocol import ErrorResponse, error_body

_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}

# One server-sent event, as OpenAPI 3.1 describes a stream's items; ``data`` is a JSON chunk of
# the response object (``*.chunk``), or ``[DONE]`` last.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def error_response(message: str, code: int = 400, param: Optional[str] = None) -> Response:
    """OpenAI's error JSON. Escaped to ASCII: a message quoting the client's text (which JSON lets
    carry lone surrogates) must still encode."""
    err_type = {404: "NotFoundError", 405: "MethodNotAllowedError",
                503: "ServiceUnavailableError"}.get(
        code, "InternalServerError" if code >= 500 else "BadRequestError")
    body = error_body(message, err_type, code, param)
    return Response(json.dumps(body, ensure_ascii=True), status_code=code,
                    media_type="application/json")


def field_path(loc: tuple) -> str:
    """pydantic's error location as the client wrote it: ``messages.0.content`` (no ``body`` and
    no union-branch tags such as ``str`` or ``list[TextContentPart]``)."""
    parts = [str(x) for x in loc if x != "body" and not (
        isinstance(x, str) and ("[" in x or x.lower() in _UNION_TAGS or x.startswith("function-")))]
    return ".".join(parts)


def validation_error_response(errors: list) -> Response:
    """The 400 for pydantic's errors. The deepest location wins: for a union (content as a string
    or a list of parts) that is the branch the client meant, ``messages.0.content.0.type``."""
    first = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    where = field_path(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid request body")
    if first.get("type") == "missing" and not where:
        msg = "missing; send a JSON object"
    elif first.get("type") == "json_invalid":
        msg, where = f"not valid JSON ({first.get('ctx', {}).get('error', msg)})", ""
    return error_response(f"{where}: {msg}" if where else f"the request body: {msg}", 400,
                          where or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _bad_body(_request: Request, exc: RequestValidationError):
        return validation_error_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        # e.g. a body that is not UTF-8 ("There was an error parsing the body"), an unknown path
        return error_response(str(exc.detail), exc.status_code)


def generation_responses(ok_model: type, server_fault: str = "the engine loop died",
                         overload: str = "more requests in flight than --max-pending-requests"
                         ) -> dict:
    """The ``responses`` of a generation route for /openapi.json: every status it really returns
    (a client that disconnects gets nothing, so its 499 is not listed)."""
    err = {"model": ErrorResponse}
    return {
        200: {"model": ok_model, "description": "The result; with `stream: true`, server-sent "
                                                "events ending in `data: [DONE]`",
              "content": {"text/event-stream": {"schema": SSE_EVENT}}},
        400: {**err, "description": "Malformed request; `error.param` names the field"},
        404: {**err, "description": "Unknown `model`"},
        500: {**err, "description": f"Server fault ({server_fault}); the message names it"},
        503: {**err, "description": f"Overloaded ({overload}); retry later"},
    }


def without_422(app: FastAPI) -> None:
    """FastAPI's spec minus its 422 (a bad body is a 400 here, as in vLLM and OpenAI)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in spec.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                spec.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
