"""The OpenAI-compatible HTTP API: a Starlette app around an AsyncLLM.

`build_app(llm, ServerConfig(...))` returns the ASGI app. Routes: POST /v1/completions, POST /v1/chat/completions
(both stream as server-sent events ending with `data: [DONE]`), GET /v1/models, /health, /metrics, /version,
/openapi.json, POST /tokenize, /detokenize. Every error is OpenAI's {"error": {...}} with its status; bad input is
never a 500 and never touches other requests. A client that disconnects (streaming or not) aborts its engine
requests. One access-log line per request (logger "kiln.access") carries the request id, status and timings.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.models.errors import KilnError
from kiln.serving.metrics import Metrics
from kiln.serving.params import RequestOutput
from kiln.serving.protocol import DEFAULT_COMPLETION_MAX_TOKENS, ChoiceState, Job, OpenAIAdapter, usage
from kiln.serving.schemas import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    openapi_schema,
)

access_log = logging.getLogger("kiln.access")
log = logging.getLogger("kiln.server")
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def kiln_version() -> str:
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class ServerConfig:
    """What `kiln serve` configures about the HTTP layer."""

    served_model_names: tuple[str, ...] = ()  # empty: the engine's model_name
    api_key: str | None = None
    max_request_bytes: int = 8 * 2**20
    max_waiting_requests: int = 1024  # engine waiting queue bound; beyond it new requests get 429 + Retry-After
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    source: str | None = None  # shown as the model's `root` in /v1/models


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


# ---- the pure-ASGI guard: request id, auth, access log --------------------------------------------------------------


class _Guard:
    """Assigns a request id (X-Request-Id, echoed back), checks the Bearer key, writes the access log line."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        rid = given if 0 < len(given) <= 128 and given.isprintable() else uuid.uuid4().hex
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
            if self.api_key and scope["path"].startswith(PROTECTED_PREFIXES) and scope["method"] != "OPTIONS":
                auth = headers.get("authorization", "")
                token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
                if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                    err = APIError("Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                                   401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                    return await _error_response(err)(scope, receive, send_with_id)
            await self.app(scope, receive, send_with_id)
        finally:
            extra = " ".join(f"{k}={v}" for k, v in state.get("log", {}).items())
            access_log.info("%s %s %s %s %d %.1fms %s", rid, _client(scope), scope["method"], scope["path"],
                            status[0] or 499, 1000 * (time.perf_counter() - start), extra)  # fmt: skip


def _client(scope: Scope) -> str:
    c = scope.get("client")
    return f"{c[0]}:{c[1]}" if c else "-"


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# ---- server-sent events ---------------------------------------------------------------------------------------------


class _EventStream:
    """An SSE response that watches for the client's disconnect while streaming and closes `events` either way
    (so the engine requests behind it are aborted at once, whatever the ASGI server's spec version)."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]  # fmt: skip

        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _until_disconnect(receive, stream())
        except (ClientDisconnected, OSError):
            scope["state"].setdefault("log", {})["disconnected"] = 1
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]


async def _until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---- the API --------------------------------------------------------------------------------------------------------


class _API:
    """Route handlers over one AsyncLLM (no module state: everything hangs off this object)."""

    def __init__(self, llm: Any, config: ServerConfig) -> None:
        self.llm = llm
        self.config = config
        self.names = config.served_model_names or (str(llm.model_name),)
        self.metrics = Metrics(self.names[0], llm.stats)
        vocab = int(getattr(llm.cfg, "vocab_size", 0) or llm.tokenizer.vocab_size)
        self.adapter = OpenAIAdapter(llm.tokenizer, vocab, int(llm.max_model_len))
        self.created = int(time.time())
        self.version = kiln_version()
        self.openapi = openapi_schema(self.version)

    # -- plumbing --

    async def body(self, request: Request, model: type[BaseModel]) -> Any:
        """Read (bounded by max_request_bytes), parse and validate a JSON body into `model`."""
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype and ctype != "application/json" and not ctype.endswith("+json"):
            raise APIError(f"Content-Type must be application/json, not {ctype!r}.", 415, code="unsupported_media_type")
        limit = self.config.max_request_bytes
        too_big = APIError(f"The request body is larger than the server's limit of {limit} bytes.", 413,
                           code="request_too_large")  # fmt: skip
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise APIError("The request body is empty; send a JSON object.", code="invalid_json")
        try:
            req = model.model_validate_json(raw)
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model_extra:
            log.info("ignoring unknown request fields: %s", ", ".join(sorted(req.model_extra)))
        return req

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.names:
            return name or self.names[0]
        raise APIError(f"The model `{name}` does not exist; this server serves {', '.join(self.names)}.", 404,
                       param="model", code="model_not_found")  # fmt: skip

    def admit(self, count: int) -> None:
        """Answer 429 (with Retry-After) when the engine's waiting queue cannot take `count` more requests."""
        if count > self.config.max_waiting_requests:
            raise APIError(f"This request asks for {count} completions (prompts times n); the server queues at most "
                           f"{self.config.max_waiting_requests}.", param="n")  # fmt: skip
        waiting = int(getattr(self.llm.stats(), "num_waiting", 0))
        if waiting + count > self.config.max_waiting_requests:
            busy = f"The server is busy ({waiting} requests waiting); retry shortly."
            raise APIError(busy, 429, type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        if not self.llm.is_alive():
            raise APIError("The engine is not running.", 503, type="server_error", code="engine_dead")

    async def run_jobs(self, jobs: list[Job], request: Request) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit every job to the engine and yield (choice index, output) as they come, in any order. Closing this
        generator (client gone, error, shutdown) aborts every job still running."""
        entry = request.scope["state"].setdefault("log", {})
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        rids = [f"{uuid.uuid4().hex}-{j.index}" for j in jobs]
        unfinished = set(rids)

        async def pump(job: Job, rid: str) -> None:
            timer, reason = self.metrics.request(), None
            try:
                async for out in self.llm.generate(rid, job.prompt_ids, job.params):
                    timer.tokens(len(out.new_token_ids))
                    if timer.ttft is not None and "ttft_ms" not in entry:
                        entry["ttft_ms"] = f"{1000 * timer.ttft:.1f}"
                    if out.finished:
                        reason = out.finish_reason
                        unfinished.discard(rid)
                    queue.put_nowait((job.index, out))
                if rid in unfinished:
                    raise RuntimeError("the engine ended a request without finishing it")
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # handed to the consumer
                queue.put_nowait((job.index, e))
            finally:
                timer.finish(reason, len(job.prompt_ids))

        tasks = [asyncio.ensure_future(pump(j, r)) for j, r in zip(jobs, rids, strict=True)]
        try:
            remaining = len(jobs)
            while remaining:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise _engine_error(item)
                if item.finished:
                    remaining -= 1
                yield index, item
        finally:
            for t in tasks:
                t.cancel()
            for rid in unfinished:
                self.llm.abort(rid)
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- OpenAI routes --

    async def completions(self, request: Request) -> Any:
        req: CompletionRequest = await self.body(request, CompletionRequest)
        model = self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of other than n is not supported.", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError("echo with logprobs (prompt logprobs) is not supported.", param="echo")
        prompts = await asyncio.to_thread(self.adapter.completion_prompts, req)  # long prompts: off the loop
        jobs = self.adapter.jobs(req, prompts, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, req.logprobs)
        self.admit(len(jobs))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        states = [ChoiceState(j.index, len(j.prompt_ids)) for j in jobs]
        echo = {j.index: j.prompt_text for j in jobs} if req.echo else {}

        if req.stream:

            def render(index: int, out: RequestOutput) -> list[dict[str, Any]]:
                offset = len(echo.get(index, "")) + len(states[index].text)
                lps = self.adapter.completion_logprobs(out.logprobs, offset) if out.logprobs else None
                if not (out.new_text or out.finished or lps):
                    return []
                return [_completion_choice(index, out.new_text, lps, out.finish_reason if out.finished else None)]

            prologue = [_completion_choice(index, text, None, None) for index, text in echo.items()]
            return _EventStream(self.stream(request, jobs, states, req, head, prologue, render))

        await self.collect(request, jobs, states, req.n)
        choices = []
        for st in states:
            lps = self.adapter.completion_logprobs(st.logprobs, 0) if req.logprobs is not None else None
            choices.append(_completion_choice(st.index, echo.get(st.index, "") + st.text, lps, st.finish_reason))
        return JSONResponse({**head, "choices": choices, "usage": usage(states, req.n), "system_fingerprint": None})

    async def chat(self, request: Request) -> Any:
        req: ChatCompletionRequest = await self.body(request, ChatCompletionRequest)
        model = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        fmt = (req.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(f"response_format {fmt!r} is not supported.", param="response_format")
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError("Only tool_choice 'auto' and 'none' are supported.", param="tool_choice")
        ids = await asyncio.to_thread(self.adapter.chat_prompt, req.messages, req.add_generation_prompt, req.tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        jobs = self.adapter.jobs(req, [(ids, "")], max_tokens, None, logprobs)
        self.admit(len(jobs))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        states = [ChoiceState(j.index, len(j.prompt_ids)) for j in jobs]

        if req.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": None}  # fmt: skip
            choice = lambda index, delta, lps=None, finish=None: {"index": index, "delta": delta, "logprobs": lps,
                                                                  "finish_reason": finish}  # fmt: skip

            def render(index: int, out: RequestOutput) -> list[dict[str, Any]]:
                lps = self.adapter.chat_logprobs(out.logprobs or []) if req.logprobs else None
                content = [choice(index, {"content": out.new_text}, lps)] if out.new_text or (lps and lps["content"]) \
                    else []  # fmt: skip
                return content + ([choice(index, {}, None, out.finish_reason)] if out.finished else [])

            prologue = [choice(j.index, {"role": "assistant", "content": ""}) for j in jobs]
            return _EventStream(self.stream(request, jobs, states, req, head, prologue, render))

        await self.collect(request, jobs, states, req.n)
        choices = [
            {
                "index": st.index,
                "message": {"role": "assistant", "content": st.text},
                "logprobs": self.adapter.chat_logprobs(st.logprobs) if req.logprobs else None,
                "finish_reason": st.finish_reason,
            }
            for st in states
        ]
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": usage(states, req.n), "system_fingerprint": None}  # fmt: skip
        return JSONResponse(body)

    async def stream(self, request: Request, jobs: list[Job], states: list[ChoiceState], req: Any,
                     head: dict[str, Any], prologue: list[dict[str, Any]],
                     render: Callable[[int, RequestOutput], list[dict[str, Any]]]) -> AsyncIterator[str]:  # fmt: skip
        """The SSE events of a streamed response: the prologue choices, then render(index, output) for every engine
        output, the usage chunk when stream_options.include_usage asks (on every chunk with continuous_usage_stats),
        an error event if the engine fails, and `data: [DONE]`."""
        opts = req.stream_options
        include = bool(opts and opts.include_usage)
        continuous = include and bool(opts.continuous_usage_stats)

        def event(choices: list[dict[str, Any]]) -> str:
            body = {**head, "choices": choices}
            if include:
                body["usage"] = usage(states, req.n) if continuous else None
            return _sse(body)

        gen = self.run_jobs(jobs, request)
        try:
            for choice in prologue:
                yield event([choice])
            async for index, out in gen:
                choices = render(index, out)
                states[index].add(out)
                for choice in choices:
                    yield event([choice])
            if include:
                yield _sse({**head, "choices": [], "usage": usage(states, req.n)})
        except APIError as e:
            yield _sse(e.body())
        finally:
            await gen.aclose()
            _log_usage(request, states, req.n)
        yield "data: [DONE]\n\n"

    async def collect(self, request: Request, jobs: list[Job], states: list[ChoiceState], n: int) -> None:
        """Run `jobs` to the end into `states`; a client that disconnects meanwhile aborts them."""

        async def work() -> None:
            gen = self.run_jobs(jobs, request)
            try:
                async for index, out in gen:
                    states[index].add(out)
            finally:
                await gen.aclose()

        try:
            await _until_disconnect(request.receive, work())
        finally:
            _log_usage(request, states, n)

    # -- other routes --

    async def models(self, request: Request) -> Response:
        cards = [{"id": n, "object": "model", "created": self.created, "owned_by": "kiln",
                  "root": self.config.source or n, "max_model_len": self.adapter.max_model_len}
                 for n in self.names]  # fmt: skip
        return JSONResponse({"object": "list", "data": cards})

    async def tokenize(self, request: Request) -> Response:
        req: TokenizeRequest = await self.body(request, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Send exactly one of prompt and messages.", param="prompt")
        if req.messages is not None:
            ids = await asyncio.to_thread(self.adapter.chat_prompt, req.messages, req.add_generation_prompt, None)
        else:
            ids = await asyncio.to_thread(self.adapter.tok.encode, req.prompt, req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": self.adapter.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        req: DetokenizeRequest = await self.body(request, DetokenizeRequest)
        self.check_model(req.model)
        self.adapter.check_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": self.adapter.tok.decode(req.tokens, skip_special_tokens=True)})

    async def health(self, request: Request) -> Response:
        if self.llm.is_alive():
            return Response(status_code=200)
        raise APIError("The engine is not running.", 503, type="server_error", code="engine_dead")

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def version_route(self, request: Request) -> Response:
        return JSONResponse({"version": self.version})

    async def openapi_route(self, request: Request) -> Response:
        return JSONResponse(self.openapi)


def _completion_choice(index: int, text: str, lps: Any, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}


def _log_usage(request: Request, states: list[ChoiceState], n: int) -> None:
    entry = request.scope["state"].setdefault("log", {})
    entry["prompt_tokens"] = sum(s.prompt_tokens for s in states if s.index % max(n, 1) == 0)
    entry["completion_tokens"] = sum(len(s.token_ids) for s in states)


def _validation_error(e: ValidationError) -> APIError:
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
    return APIError(f"Invalid value for {param or 'the request'}: {msg}.", param=param, code="invalid_value")


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, KilnError | ValueError):
        return APIError(str(e))
    log.error("engine request failed", exc_info=e)
    return APIError("The engine failed on this request.", 500, type="server_error", code="engine_error")


def build_app(llm: Any, config: ServerConfig | None = None) -> Starlette:
    """The Starlette app serving `llm` (an AsyncLLM: generate, abort, stats, is_alive, tokenizer, model_name,
    max_model_len, cfg). The app never shuts the engine down; its owner does."""
    config = config or ServerConfig()
    api = _API(llm, config)

    def handle(fn: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
        async def endpoint(request: Request) -> Any:
            try:
                return await fn(request)
            except APIError as e:
                return _error_response(e)
            except ClientDisconnected:
                request.scope["state"].setdefault("log", {})["disconnected"] = 1
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
        msg = f"{request.method} {request.url.path}: {exc.detail}."
        return _error_response(APIError(msg, exc.status_code, code=kind, headers=dict(exc.headers or {})))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return _error_response(APIError("Internal server error.", 500, type="server_error"))

    middleware = []
    if config.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),  # type: ignore[arg-type]
                                     allow_methods=["*"], allow_headers=["*"]))  # fmt: skip
    middleware.append(Middleware(_Guard, api_key=config.api_key))  # type: ignore[arg-type]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: http_error, Exception: server_error})  # fmt: skip
    app.state.api = api
    return app
