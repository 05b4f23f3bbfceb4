"""The OpenAI-compatible HTTP API: a Starlette app around an AsyncLLM.

`build_app(llm, ServerConfig(...))` returns the ASGI app (llm may be None while the model loads: call
`app.state.api.attach(llm)` once it is ready). Routes (routes.py): POST /v1/completions, POST /v1/chat/completions
(both stream as server-sent events ending with `data: [DONE]`), GET /v1/models, /health, /metrics, /version,
/openapi.json, POST /tokenize, /detokenize. Every error is OpenAI's {"error": {...}} with its status; bad input is
never a 500 and never touches other requests. A client that disconnects (streaming or not) aborts its engine
requests. One access-log line per request (logger "kiln.access") carries the request id, status and timings
(transport.py: that middleware, SSE, error mapping, and the bounded uvicorn protocol `http_protocol`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln.serving.routes import Routes, kiln_version
from kiln.serving.schemas import APIError
from kiln.serving.transport import ClientDisconnected, Guard, entry, error_response, log_text

log = logging.getLogger("kiln.server")
__all__ = ["ServerConfig", "build_app", "kiln_version"]


@dataclass(frozen=True)
class ServerConfig:
    """What `kiln serve` configures about the HTTP layer (the defaults are `kiln serve`'s)."""

    served_model_names: tuple[str, ...] = ()  # empty: the engine's model_name
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    max_waiting_requests: int = 1024  # engine waiting queue bound; beyond it new requests get 429 + Retry-After
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    source: str | None = None  # shown as the model's `root` in /v1/models
    body_timeout: float = 30.0  # seconds a request body may take to arrive (408 after)
    tool_call_parser: str | None = None  # kiln.serving.tool_parsers name; None: from the chat template
    reasoning_parser: str | None = None  # kiln.serving.reasoning name; None: reasoning stays in content


def build_app(llm: Any | None, config: ServerConfig | None = None) -> Starlette:
    """The Starlette app serving `llm` (an AsyncLLM, or None while it loads: /health and /v1 answer 503 until
    `app.state.api.attach(llm)`). The app never shuts the engine down; its owner does."""
    config = config or ServerConfig()
    api = Routes(llm, config)

    def handle(fn: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
        async def endpoint(request: Request) -> Any:
            try:
                return await fn(request)
            except APIError as e:
                entry(request)["error"] = e.code or e.type
                return error_response(e)
            except ClientDisconnected:
                entry(request)["disconnected"] = 1
                return Response(status_code=499)

        return endpoint

    routes = [
        Route("/v1/completions", handle(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", handle(api.chat), methods=["POST"]),
        Route("/v1/models", handle(api.models), methods=["GET"]),
        Route("/tokenize", handle(api.tokenize), methods=["POST"]),
        Route("/detokenize", handle(api.detokenize), methods=["POST"]),
        Route("/health", handle(api.health), methods=["GET"]),
        Route("/metrics", handle(api.metrics_route), methods=["GET"]),
        Route("/version", handle(api.version_route), methods=["GET"]),
        Route("/openapi.json", handle(api.openapi_route), methods=["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {log_text(request.url.path)}: {exc.detail}."
        return error_response(APIError(msg, exc.status_code, code=kind, headers=dict(exc.headers or {})))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", log_text(request.url.path), exc_info=exc)
        return error_response(APIError("Internal server error.", 500, type="server_error"))

    middleware = []
    if config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),  # type: ignore[arg-type]
                                     allow_methods=["*"], allow_headers=["*"]))  # fmt: skip
    middleware.append(Middleware(Guard, api_key=config.api_key))  # type: ignore[arg-type]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: http_error, Exception: server_error})  # fmt: skip
    app.state.api = api
    return app
