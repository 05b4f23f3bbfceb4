"""The OpenAI routes over one AsyncLLM: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
and the operational ones (/health, /metrics, /version, /openapi.json).

Each route is one method of `Routes`: it parses its request (`self.parse`), builds jobs with the OpenAIAdapter, runs
them (`self.collect` or `self.stream`) and answers with the response models of schemas.py, so what is sent is what
/openapi.json documents. Transport concerns (auth, SSE framing, disconnects, error mapping) are in transport.py.

Readiness is one state machine: "loading" until `attach(llm)`, then "ok"; "stopping" once a graceful shutdown began
(`begin_drain`); "engine_dead" when the engine has stopped. /health answers 200 only for "ok"; the /v1 routes answer
an OpenAI-shaped 503 in the other states.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln.models.errors import KilnError
from kiln.serving import chat_agent, structured_api
from kiln.serving.adapter import DEFAULT_COMPLETION_MAX_TOKENS, ChoiceState, Job, OpenAIAdapter, usage
from kiln.serving.metrics import Metrics
from kiln.serving.params import RequestOutput
from kiln.serving.schemas import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    openapi_schema,
)
from kiln.serving.transport import EventStream, engine_error, entry, read_json, sse, until_disconnect

if TYPE_CHECKING:
    from kiln.serving.app import ServerConfig

M = TypeVar("M", bound=BaseModel)


def kiln_version() -> str:
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


class ServerShutdown(Exception):
    """The graceful-shutdown timeout ended this request."""


class Running:
    """The engine requests of one response. Each is handed to the engine when this is made, not when a task first
    iterates it: with many requests arriving at once, each then reaches the engine as soon as it is parsed instead
    of after every other request's response has started (issue 16, session 15). Iterate for (choice index, output)
    as they come, in any order; aclose() (client gone, error, shutdown, the end) aborts every request not finished."""

    def __init__(self, llm: Any, metrics: Metrics, jobs: list[Job], log: dict[str, Any],
                 live: set[asyncio.Queue]) -> None:  # fmt: skip
        self.llm, self.log, self.live = llm, log, live
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.rids = {j.index: f"{uuid.uuid4().hex}-{j.index}" for j in jobs}
        self.prompt_tokens = {j.index: len(j.prompt_ids) for j in jobs}
        self.timers = {j.index: metrics.request() for j in jobs}
        self.unfinished = set(self.rids)  # choice indices without a finished output yet
        live.add(self.queue)
        for job in jobs:
            try:
                self.llm.submit(self.rids[job.index], job.prompt_ids, job.params, _Sink(self.queue, job.index))
            except Exception as e:  # handed to the consumer, as an engine failure during the request would be
                self.queue.put_nowait((job.index, e))

    def __aiter__(self) -> Running:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.unfinished:
            raise StopAsyncIteration
        index, item = await self.queue.get()
        if isinstance(item, ServerShutdown):
            raise APIError("The server shut down before this request finished.", 503, type="server_error",
                           code="server_shutdown")  # fmt: skip
        if isinstance(item, BaseException):
            raise engine_error(item)
        timer = self.timers[index]
        timer.tokens(len(item.new_token_ids))
        if timer.ttft is not None and "ttft_ms" not in self.log:
            self.log["ttft_ms"] = f"{1000 * timer.ttft:.1f}"
        if item.finished:
            self.unfinished.discard(index)
            timer.finish(item.finish_reason, self.prompt_tokens[index])
        return index, item

    async def aclose(self) -> None:
        """Abort every request not finished (once; later calls do nothing)."""
        self.live.discard(self.queue)
        unfinished, self.unfinished = self.unfinished, set()
        for index in unfinished:
            self.llm.abort(self.rids[index])
            self.timers[index].finish(None, self.prompt_tokens[index])


class _Sink:
    """Where the engine thread puts one job's outputs: the response's queue, tagged with the choice index."""

    __slots__ = ("index", "queue")

    def __init__(self, queue: asyncio.Queue, index: int) -> None:
        self.queue, self.index = queue, index

    def put_nowait(self, item: object) -> None:
        self.queue.put_nowait((self.index, item))


class Routes:
    """Route handlers over one AsyncLLM (no module state: everything hangs off this object)."""

    def __init__(self, llm: Any | None, config: ServerConfig) -> None:
        self.config = config
        self.llm: Any = None
        self.state = "loading"
        self.names: tuple[str, ...] = config.served_model_names
        self.metrics: Metrics | None = None
        self.created = int(time.time())
        self.version = kiln_version()
        self.openapi: dict | None = None  # built at its first request (~35 ms of a start's Python, holding the GIL)
        self.live: set[asyncio.Queue] = set()  # the output queues of running requests (for a shutdown cut)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop (seen at the first request)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="kiln-tokenize")  # tokenization, off the event loop
        if llm is not None:
            self.attach(llm)

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def attach(self, llm: Any) -> None:
        """The engine is ready: serve it (an AsyncLLM: generate, abort, stats, is_alive, tokenizer, model_name,
        max_model_len, cfg)."""
        self.names = self.config.served_model_names or (str(llm.model_name),)
        self.metrics = Metrics(self.names[0], llm.stats)
        vocab = int(getattr(llm.cfg, "vocab_size", 0) or llm.tokenizer.vocab_size)
        self.adapter = OpenAIAdapter(llm.tokenizer, vocab, int(llm.max_model_len))
        self.llm = llm
        self.pool.submit(_warm_tokenizer, self.adapter)
        if self.state == "loading":
            self.state = "ok"

    def status(self) -> str:
        if self.state == "ok" and not self.llm.is_alive():
            self.state = "engine_dead"
        return self.state

    def begin_drain(self, timeout: float) -> None:
        """A graceful shutdown began: /health turns 503 and, after `timeout` seconds, requests still running are cut
        (streams end with an in-band error event, others get a 503). Callable from any thread."""
        if self.state == "ok":
            self.state = "stopping"
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.call_later, timeout, self.cut)

    def cut(self) -> None:
        for q in list(self.live):
            q.put_nowait((-1, ServerShutdown()))

    def check_ready(self) -> None:
        state = self.status()
        if state == "ok":
            return
        if state == "loading":
            raise APIError("The model is still loading; retry shortly.", 503, type="server_error",
                           code="model_loading", headers={"Retry-After": "1"})  # fmt: skip
        if state == "stopping":
            raise APIError("The server is shutting down.", 503, type="server_error", code="server_shutdown")
        raise APIError("The engine is not running.", 503, type="server_error", code="engine_dead")

    # ---- plumbing -----------------------------------------------------------------------------------------------

    async def parse(self, request: Request, model: type[M]) -> M:
        """The request body as `model` (bounded in bytes and time; see transport.read_json)."""
        self.loop = asyncio.get_running_loop()
        return await read_json(request, model, self.config.max_request_bytes, self.config.body_timeout)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run tokenization (or anything long) on the tokenizer threads, not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(fn, *args))

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.names:
            return name or self.names[0]
        raise APIError(f"The model `{name[:200]}` does not exist; this server serves {', '.join(self.names)}.", 404,
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
        self.check_ready()

    def run_jobs(self, jobs: list[Job], request: Request) -> Running:
        """Hand every job to the engine now and return what yields (choice index, output) as they come."""
        assert self.metrics is not None
        return Running(self.llm, self.metrics, jobs, entry(request), self.live)

    def stream(self, request: Request, jobs: list[Job], states: list[ChoiceState], req: Any,
               event: Callable[[list[Any], dict[str, Any] | None], BaseModel], prologue: list[Any],
               render: Callable[[int, RequestOutput], list[Any]]) -> EventStream:  # fmt: skip
        """A streamed response: the jobs are handed to the engine now, its events written as events() makes them."""
        running = self.run_jobs(jobs, request)
        return EventStream(self.events(request, running, states, req, event, prologue, render), close=running.aclose)

    async def events(self, request: Request, running: Running, states: list[ChoiceState], req: Any,
                     event: Callable[[list[Any], dict[str, Any] | None], BaseModel], prologue: list[Any],
                     render: Callable[[int, RequestOutput], list[Any]]) -> AsyncIterator[str]:  # fmt: skip
        """The SSE events of a streamed response: the prologue choices, then render(index, output) for every engine
        output, the usage chunk when stream_options.include_usage asks (on every chunk with continuous_usage_stats),
        an error event if the engine fails or the server shuts down, and `data: [DONE]`. event(choices, usage)
        builds one event's response model."""
        opts = req.stream_options
        include = bool(opts and opts.include_usage)
        continuous = include and bool(opts.continuous_usage_stats)

        def chunk(choices: list[Any]) -> str:
            return sse(event(choices, usage(states, req.n) if continuous else None))

        try:
            for choice in prologue:
                yield chunk([choice])
            async for index, out in running:
                choices = render(index, out)
                states[index].add(out)
                for choice in choices:
                    yield chunk([choice])
            if include:
                yield sse(event([], usage(states, req.n)))
        except APIError as e:
            entry(request)["error"] = e.code or e.type
            yield sse(e.body())
        finally:
            await running.aclose()
            _log_usage(request, states, req.n)
        yield "data: [DONE]\n\n"

    async def collect(self, request: Request, jobs: list[Job], states: list[ChoiceState], n: int) -> None:
        """Run `jobs` to the end into `states`; a client that disconnects meanwhile aborts them."""
        running = self.run_jobs(jobs, request)

        async def work() -> None:
            async for index, out in running:
                states[index].add(out)

        try:
            await until_disconnect(request.receive, work())
        finally:
            await running.aclose()
            _log_usage(request, states, n)

    # ---- OpenAI routes ------------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Any:
        self.check_ready()
        req = await self.parse(request, CompletionRequest)
        model = self.check_model(req.model)
        if req.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of other than n is not supported.", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError("echo with logprobs (prompt logprobs) is not supported.", param="echo")
        # text (or echo) needs the tokenizer: off the loop. Token ids need a bounds check only (~40 us per 1000 ids,
        # less than their JSON validation), run here: two thread hops a request cost more than that, and with many
        # requests arriving at once every hop sent each one to the back of the loop's queue (issue 16, session 15)
        if req.echo or isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], str)):
            prompts = await self.off_loop(self.adapter.completion_prompts, req)
        else:
            prompts = self.adapter.completion_prompts(req)
        jobs = self.adapter.jobs(req, prompts, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, req.logprobs)
        if (spec := structured_api.from_request(req)) is not None:  # compiling one takes milliseconds: off the loop
            await self.off_loop(structured_api.constrain, self.llm, req, jobs, spec)
        self.admit(len(jobs))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        states = [ChoiceState(j.index, len(j.prompt_ids)) for j in jobs]
        echo = {j.index: j.prompt_text for j in jobs} if req.echo else {}

        def response(choices: list[CompletionChoice], use: dict[str, Any] | None) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=use)

        if req.stream:

            def render(index: int, out: RequestOutput) -> list[CompletionChoice]:
                offset = len(echo.get(index, "")) + len(states[index].text)
                lps = self.adapter.completion_logprobs(out.logprobs, offset) if out.logprobs else None
                if not (out.new_text or out.finished or lps):
                    return []
                finish = out.finish_reason if out.finished else None
                return [CompletionChoice(index=index, text=out.new_text, logprobs=lps, finish_reason=finish)]

            prologue = [CompletionChoice(index=index, text=text) for index, text in echo.items()]
            return self.stream(request, jobs, states, req, response, prologue, render)

        await self.collect(request, jobs, states, req.n)
        choices = []
        for st in states:
            lps = self.adapter.completion_logprobs(st.logprobs, 0) if req.logprobs is not None else None
            choices.append(CompletionChoice(index=st.index, text=echo.get(st.index, "") + st.text, logprobs=lps,
                                            finish_reason=st.finish_reason))  # fmt: skip
        return json_response(response(choices, usage(states, req.n)))

    async def chat(self, request: Request) -> Any:
        self.check_ready()
        req = await self.parse(request, ChatCompletionRequest)
        model = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        feats = chat_agent.prepare(req, self.config.tool_call_parser, self.config.reasoning_parser,
                                   getattr(self.adapter.tok, "chat_template", None))  # fmt: skip
        ids = await self.off_loop(self.adapter.chat_prompt, req.messages, req.add_generation_prompt, feats.tools,
                                  feats.template_kwargs)  # fmt: skip
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        jobs = self.adapter.jobs(req, [(ids, "")], max_tokens, None, logprobs)
        if feats.forced or structured_api.from_request(req) is not None:  # a constraint to compile: off the loop
            await self.off_loop(chat_agent.constrain, self.llm, req, jobs, feats)
        self.admit(len(jobs))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        states = [ChoiceState(j.index, len(j.prompt_ids)) for j in jobs]

        if req.stream:

            def chunk(choices: list[ChatChunkChoice], use: dict[str, Any] | None) -> ChatCompletionChunk:
                return ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=use)

            streams = {j.index: feats.stream() for j in jobs}

            def render(index: int, out: RequestOutput) -> list[ChatChunkChoice]:
                lps = self.adapter.chat_logprobs(out.logprobs or []) if req.logprobs else None
                deltas = streams[index].push(out.new_text)
                if lps and lps["content"] and not deltas:
                    deltas = [{"content": ""}]
                choices = [ChatChunkChoice(index=index, delta=DeltaMessage(**d), logprobs=lps if i == 0 else None)
                           for i, d in enumerate(deltas)]  # fmt: skip
                if out.finished:
                    last, reason = streams[index].finish(out.finish_reason)
                    choices += [ChatChunkChoice(index=index, delta=DeltaMessage(**d)) for d in last]
                    choices.append(ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=reason))
                return choices

            prologue = [ChatChunkChoice(index=j.index, delta=DeltaMessage(role="assistant", content="")) for j in jobs]
            return self.stream(request, jobs, states, req, chunk, prologue, render)

        await self.collect(request, jobs, states, req.n)
        choices = []
        for st in states:
            fields, reason = chat_agent.message(feats, st.text, st.finish_reason)
            lps = self.adapter.chat_logprobs(st.logprobs) if req.logprobs else None
            choices.append(ChatChoice(index=st.index, message=AssistantMessage(**fields), logprobs=lps,
                                      finish_reason=reason))  # fmt: skip
        body = ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=usage(states, req.n))  # fmt: skip
        return json_response(body)

    async def models(self, request: Request) -> Response:
        self.check_ready()
        cards = [ModelCard(id=n, created=self.created, root=self.config.source or n,
                           max_model_len=self.adapter.max_model_len) for n in self.names]  # fmt: skip
        return json_response(ModelList(data=cards))

    async def tokenize(self, request: Request) -> Response:
        self.check_ready()
        req = await self.parse(request, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Send exactly one of prompt and messages.", param="prompt")
        if req.messages is not None:
            ids = await self.off_loop(self.adapter.chat_prompt, req.messages, req.add_generation_prompt, None)
        else:
            self.adapter.check_length(len(req.prompt or ""), "prompt")
            ids = await self.off_loop(self.adapter.tok.encode, req.prompt, req.add_special_tokens)
        return json_response(TokenizeResponse(count=len(ids), max_model_len=self.adapter.max_model_len, tokens=ids))

    async def detokenize(self, request: Request) -> Response:
        self.check_ready()
        req = await self.parse(request, DetokenizeRequest)
        self.check_model(req.model)
        self.adapter.check_ids(req.tokens, "tokens")
        text = await self.off_loop(self.adapter.tok.decode, req.tokens, True)
        return json_response(DetokenizeResponse(prompt=text))

    # ---- operational routes -------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        state = self.status()
        return json_response(HealthResponse(status=state), 200 if state == "ok" else 503)  # type: ignore[arg-type]

    async def metrics_route(self, request: Request) -> Response:
        if self.metrics is None:
            return Response(b"", media_type=Metrics.content_type)
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def version_route(self, request: Request) -> Response:
        return json_response(VersionResponse(version=self.version))

    async def openapi_route(self, request: Request) -> Response:
        if self.openapi is None:
            self.openapi = openapi_schema(self.version)
        return JSONResponse(self.openapi)


def _warm_tokenizer(adapter: OpenAIAdapter) -> None:
    """What the tokenizer side does once, at its first use, run on a tokenize thread as the server becomes ready (not
    before: ready comes sooner), so that the first request costs what later ones do: the vocabulary's scan for the
    prompt length check (~50 ms, SmolLM2), the first encode (it starts the tokenizers library's thread pool: ~2 ms on
    2 cores, more with more cores), the chat template's compilation (~9 ms, SmolLM2's)."""
    _ = adapter.max_prompt_chars
    adapter.tok.encode("kiln")
    with contextlib.suppress(KilnError):  # no chat template: the chat route refuses every request anyway
        adapter.tok.apply_chat_template([{"role": "user", "content": "kiln"}])


def _log_usage(request: Request, states: list[ChoiceState], n: int) -> None:
    log = entry(request)
    log["prompt_tokens"] = sum(s.prompt_tokens for s in states if s.index % max(n, 1) == 0)
    log["completion_tokens"] = sum(len(s.token_ids) for s in states)
