"""HTTP transport under the OpenAI routes: what every request goes through whatever its route.

* `Guard` (pure ASGI middleware): the request id (X-Request-Id, echoed back), the Bearer API key (compared as the
  bytes of its UTF-8 encoding; two Authorization headers are refused), one access-log line per request with every
  client-controlled string escaped and bounded.
* `read_json` : a JSON body read with a byte limit and a time limit, parsed into a pydantic request model.
* `EventStream`: a server-sent-event response that watches for the client's disconnect while streaming.
* Error mapping: `APIError` (schemas.py) is the one error type a route raises; `engine_error` maps what the engine
  raises onto it, `validation_error` maps pydantic's first error onto one sentence.
* `http_protocol(...)`: uvicorn's h11 protocol with a deadline for a request's headers, a cap on open connections,
  and OpenAI-shaped bodies for the errors uvicorn answers itself (malformed or oversized headers).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import h11
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.models.errors import KilnError
from kiln.serving.schemas import APIError

access_log = logging.getLogger("kiln.access")
log = logging.getLogger("kiln.server")
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
LOG_FIELD_CHARS = 200  # a client-controlled string in a log line is cut to this many characters
MAX_HEADER_BYTES = 16 * 1024  # a request line and headers larger get a 400 (h11 bounds only those arriving in pieces)


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


def log_text(value: object, limit: int = LOG_FIELD_CHARS) -> str:
    """`value` safe to put in one log line: control and non-ASCII characters escaped (a newline cannot start a forged
    line), cut to about `limit` characters."""
    s = str(value)
    out = s[: limit + 1].encode("unicode_escape").decode("ascii").replace('"', '\\"')
    return out if len(s) <= limit and len(out) <= limit else f"{out[:limit]}...({len(s)} chars)"


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def entry(request: Request | Scope) -> dict[str, Any]:
    """The extra key=value fields of this request's access-log line."""
    scope = request.scope if isinstance(request, Request) else request
    return scope.setdefault("state", {}).setdefault("log", {})


# ---- the guard: request id, auth, access log --------------------------------------------------------------------


class Guard:
    """Assigns a request id (X-Request-Id, echoed back), checks the Bearer key, writes the access-log line."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode("utf-8") if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"x-request-id"), "")
        rid = given if 0 < len(given) <= 128 and given.isascii() and given.isprintable() else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        start = time.perf_counter()
        status = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        try:
            if self.key and scope["path"].startswith(PROTECTED_PREFIXES) and scope["method"] != "OPTIONS":
                err = self.check_key(scope)
                if err is not None:
                    return await error_response(err)(scope, receive, send_with_id)
            await self.app(scope, receive, send_with_id)
        finally:
            extra = " ".join(f"{k}={log_text(v, 80)}" for k, v in state.get("log", {}).items())
            access_log.info("%s %s %s %s %d %.1fms %s", rid, _client(scope), log_text(scope["method"], 16),
                            log_text(scope["path"]), status[0] or 499, 1000 * (time.perf_counter() - start),
                            extra)  # fmt: skip

    def check_key(self, scope: Scope) -> APIError | None:
        """None when the one Authorization header holds `Bearer <key>` (the key's UTF-8 bytes, compared in constant
        time), else the error to answer."""
        auths = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        if len(auths) > 1:
            return APIError(f"The request has {len(auths)} Authorization headers; send exactly one.", 400,
                            code="duplicate_authorization")  # fmt: skip
        auth = auths[0] if auths else b""
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        if hmac.compare_digest(token, self.key or b""):
            return None
        return APIError("Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.", 401,
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip


def _client(scope: Scope) -> str:
    c = scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "-"


# ---- request bodies ---------------------------------------------------------------------------------------------


async def read_json(request: Request, model: type[BaseModel], limit: int, timeout: float) -> Any:
    """Read the body (at most `limit` bytes, all of it within `timeout` seconds), parse and validate it into `model`.
    A client that hangs up meanwhile raises ClientDisconnected."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(f"Content-Type must be application/json, not {log_text(ctype, 60)!r}.", 415,
                       code="unsupported_media_type")  # fmt: skip
    too_big = APIError(f"The request body is larger than the server's limit of {limit} bytes.", 413,
                       code="request_too_large")  # fmt: skip
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(f"The request body did not arrive within {timeout:g} seconds.", 408,
                       code="request_timeout") from None  # fmt: skip
    except ClientDisconnect:
        raise ClientDisconnected from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None
    if req.model_extra:
        names = sorted(req.model_extra)
        log.info("ignoring %d unknown request field(s): %s", len(names), log_text(", ".join(names[:20])))
    return req


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as one OpenAI-shaped 400 (union-branch tags are dropped from the location)."""
    errors = e.errors(include_url=False)
    err = errors[0]
    if err["type"] == "json_invalid":
        return APIError(f"The request body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}.",
                        code="invalid_json")  # fmt: skip
    if err["type"] == "model_type" and not err["loc"]:
        return APIError("The request body must be a JSON object.", code="invalid_json")
    loc = [p for p in err["loc"] if isinstance(p, int) or ("[" not in p and p not in ("str", "int", "function-after"))]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    # a union field (prompt, stop, content) fails once per accepted form: say what each form objected to
    same = [e["msg"] for e in errors if e["loc"][:1] == err["loc"][:1]]
    msg = "; ".join(dict.fromkeys(same[:6])) if len(same) > 1 else err["msg"]
    return APIError(f"Invalid value for {log_text(param or 'the request', 100)}: {msg}.", param=param,
                    code="invalid_value")  # fmt: skip


def engine_error(e: BaseException) -> APIError:
    """What the engine raised, as the error the client gets: its input (KilnError) a 400, a stopped engine a 503
    engine_dead, anything else a 500 (logged with its traceback)."""
    from kiln.serving.llm import EngineDead

    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDead):
        return APIError(str(e), 503, type="server_error", code="engine_dead")
    if isinstance(e, KilnError | ValueError):
        return APIError(str(e))
    log.error("engine request failed", exc_info=e)
    return APIError("The engine failed on this request.", 500, type="server_error", code="engine_error")


# ---- server-sent events -----------------------------------------------------------------------------------------


class EventStream:
    """An SSE response that watches for the client's disconnect while streaming and closes `events` either way, then
    awaits `close()` if given (so the engine requests behind it are aborted at once, whatever the ASGI server's spec
    version, even if `events` never started)."""

    def __init__(self, events: AsyncIterator[str], close: Callable[[], Awaitable[Any]] | None = None) -> None:
        self.events = events
        self.close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]  # fmt: skip

        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, stream())
        except (ClientDisconnected, OSError):
            entry(scope)["disconnected"] = 1
        finally:
            try:
                await self.events.aclose()  # type: ignore[attr-defined]
            finally:
                if self.close is not None:
                    await self.close()


async def until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


def sse(data: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying `data` as compact JSON."""
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


# ---- the socket level: uvicorn's protocol with deadlines --------------------------------------------------------


def http_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, bounded: a connection must deliver a request's headers within `header_timeout`
    seconds of opening (or of its previous response) or it is closed; beyond `max_connections` open connections a
    new one is answered 503 and closed; malformed or oversized headers get an OpenAI-shaped 400. Pass the result as
    uvicorn.Config(http=...)."""

    class BoundedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                _write_error(transport, 503, "The server has too many open connections; retry shortly.",
                             "server_error", "too_many_connections")  # fmt: skip
                self._refuse()
                return
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.connections.discard(self)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self.conn.their_state is h11.IDLE:
                self._arm()  # a new request has begun: its headers are on the clock
                end = data.find(b"\r\n\r\n")  # bytes after the headers' end are the body's
                self._head_bytes = getattr(self, "_head_bytes", 0) + (len(data) if end < 0 else end + 4)
                if self._head_bytes > MAX_HEADER_BYTES:
                    self.send_400_response("headers too large")
                    return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()
                self._head_bytes = 0

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            _write_error(self.transport, 400, "The request's headers are malformed or too large.",
                         "invalid_request_error", "invalid_http_request")  # fmt: skip
            self._refuse()

        def _refuse(self) -> None:
            """Stop reading, end our side, close a moment later (closing with unread data could reset the answer)."""
            self._refused = True
            self._disarm()
            self.connections.discard(self)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(1.0, self.transport.close)

    return BoundedH11Protocol


def _write_error(transport: asyncio.Transport, status: int, message: str, kind: str, code: str) -> None:
    """Write a whole OpenAI-shaped error response straight to the socket (uvicorn's own answers, before any app)."""
    body = json.dumps(APIError(message, status, type=kind, code=code).body()).encode()
    reason = {400: b"Bad Request", 503: b"Service Unavailable"}[status]
    transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))  # fmt: skip
