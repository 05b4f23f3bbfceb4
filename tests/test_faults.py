"""Faults, as an attacker and as an unlucky operator would cause them, against real uvicorn servers around the real
AsyncLLM on the tiny random model (issue 14): an engine that fails with requests running and queued, a request the
engine's geometry cannot hold, forged log lines, huge prompts and bodies, idle and slow sockets, clients that hang up
mid-body, API-key edges, streams cut at shutdown, the loading state, and a soak with random disconnects.

The soak runs 2 x 60 requests by default (CI); KILN_SOAK=full runs the issue's 2 x 500 at concurrency 64."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from server_harness import running_server, tiny_llm, uvicorn_server, wait_idle

from kiln.models.batch import KVCache
from kiln.serving.app import ServerConfig, build_app
from kiln.serving.block_manager import BlockManager
from kiln.serving.engine import Engine
from kiln.serving.llm import AsyncLLM
from kiln.serving.params import SamplingParams
from kiln.serving.runner import Runner
from kiln.serving.scheduler import Scheduler
from kiln.serving.transport import http_protocol

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # tiny models: compiling costs more than running

TINY = "tiny"
CONFIG = ServerConfig(served_model_names=(TINY,))


LONG = SamplingParams(max_tokens=400, ignore_eos=True)  # a request that cannot end on its own within a test


def fresh_engine(num_pages: int | None = None, max_pages_per_seq: int | None = None) -> Engine:
    """An engine of its own (own KV cache, scheduler and thread-to-be) on the shared tiny engine's compiled programs
    and weights, so it costs no compilation; num_pages / max_pages_per_seq shrink what it can hold."""
    base = tiny_llm()[0].engine
    r = base.runner
    kv = KVCache.create(base.cfg, r.kv.num_pages, r.page_size, dtype=r.kv.k[0].dtype)
    runner = Runner(r.programs, r.weights, kv, page_size=r.page_size, max_num_seqs=r.max_num_seqs,
                    max_pages_per_seq=max_pages_per_seq or r.max_pages_per_seq, buckets=r.buckets,
                    seqs_per_bucket=r.seqs_per_bucket)  # fmt: skip
    s = base.scheduler
    scheduler = Scheduler(BlockManager(num_pages or s.bm.num_pages, r.page_size), max_num_seqs=s.max_num_seqs,
                          max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=s.max_model_len,
                          eos_token_ids=s.eos_token_ids, buckets=s.buckets)  # fmt: skip
    return Engine(runner, scheduler, cfg=base.cfg, tokenizer=base.tokenizer, model_name=TINY)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


# ---- an engine failure answers everyone -------------------------------------------------------------------------


def test_engine_failure_answers_running_and_queued_requests_within_a_second():
    """A step raises while 6 requests run and 4 more wait in the engine thread's inbox: all 10 are answered within a
    second (streams: an in-band engine_dead event and [DONE]; others: 503 engine_dead), /health turns 503 and new
    requests get 503 engine_dead."""
    engine = fresh_engine()
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()
    dispatch = engine.runner.dispatch

    def failing_dispatch(sched):
        if armed.is_set():
            entered.set()
            release.wait(30)
            raise RuntimeError("injected step failure")
        return dispatch(sched)

    engine.runner.dispatch = failing_dispatch
    llm = AsyncLLM(engine)

    async def main(url: str) -> list:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:

            async def one(stream: bool) -> tuple[int, str, float]:
                body = {"prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": stream}
                r = await http.post("/v1/completions", json=body)
                return r.status_code, r.text, time.monotonic()

            first = [asyncio.ensure_future(one(i % 2 == 0)) for i in range(6)]
            while llm.stats().num_running < 6:
                await asyncio.sleep(0.01)
            armed.set()
            while not entered.is_set():
                await asyncio.sleep(0.01)
            queued = [asyncio.ensure_future(one(i % 2 == 0)) for i in range(4)]
            while llm._inbox.qsize() < 4:
                await asyncio.sleep(0.01)
            release.set()
            results = await asyncio.wait_for(asyncio.gather(*first, *queued), 10)
            health = await http.get("/health")
            late = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            return [*results, health, late]

    try:
        with running_server(build_app(llm, CONFIG)) as url:
            *results, health, late = asyncio.run(main(url))
    finally:
        llm.shutdown()
    for status, text, _ in results:
        if text.startswith("data: "):  # a stream: 200 already sent, then the error in band
            events = sse_events(text)
            assert status == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        else:
            assert status == 503 and json.loads(text)["error"]["code"] == "engine_dead"
    assert health.status_code == 503 and health.json() == {"status": "engine_dead"}
    assert error_of(late, 503)["code"] == "engine_dead"


def test_engine_failure_is_answered_fast():
    """The same as above, timed: the last of the queued requests is answered well within a second."""
    engine = fresh_engine()
    armed, release = threading.Event(), threading.Event()
    dispatch = engine.runner.dispatch

    def failing_dispatch(sched):
        if armed.is_set():
            release.wait(30)
            raise RuntimeError("injected step failure")
        return dispatch(sched)

    engine.runner.dispatch = failing_dispatch
    llm = AsyncLLM(engine)

    async def main() -> float:
        async def one() -> float:
            with pytest.raises(Exception) as e:
                async for _ in llm.generate(os.urandom(4).hex(), [5, 6, 7], LONG):  # still running when armed
                    pass
            assert type(e.value).__name__ == "EngineDead"
            return time.monotonic()

        running = asyncio.ensure_future(one())
        while llm.stats().num_running < 1:
            await asyncio.sleep(0.005)
        armed.set()
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(one()) for _ in range(3)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        release.set()
        done = await asyncio.wait_for(asyncio.gather(running, *queued), 5)
        return max(done) - t0

    try:
        assert asyncio.run(main()) < 1.0
        assert not llm.is_alive()
    finally:
        llm.shutdown()


def test_a_request_the_geometry_cannot_hold_is_refused_before_scheduling():
    """An engine whose cache holds 6 pages (96 tokens) while the model allows 512: a longer request is a 400 before
    it reaches the engine (it used to wait forever, or with a mis-sized artifact, break the step for everyone); a
    request that fits is served, and the engine stays alive."""
    small = AsyncLLM(fresh_engine(num_pages=6))
    try:
        assert small.max_model_len == 96
        with running_server(build_app(small, CONFIG)) as url:
            r = httpx.post(url + "/v1/completions", json={"prompt": list(range(3, 103)), "max_tokens": 1}, timeout=20)
            assert error_of(r, 400)["code"] == "context_length_exceeded"
            r = httpx.post(url + "/v1/completions", json={"prompt": list(range(3, 93)), "max_tokens": 20}, timeout=20)
            assert error_of(r, 400)["code"] == "context_length_exceeded"
            r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5, "ignore_eos": True},
                           timeout=20)  # fmt: skip
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            assert httpx.get(url + "/health").status_code == 200
    finally:
        small.shutdown()
    narrow = AsyncLLM(fresh_engine(max_pages_per_seq=4))  # a sequence's page table holds 64 tokens
    try:
        assert narrow.max_model_len == 64
    finally:
        narrow.shutdown()


# ---- logs, prompts, bodies --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    llm, _ = tiny_llm()
    # 2 s for a body: four 7.9 MB bodies at once must arrive in time on a loaded 2-core machine (at 0.5 s one
    # timed out under two xdist workers), and the slow-body case is still answered within raw()'s 5 s
    config = ServerConfig(served_model_names=(TINY,), body_timeout=2.0)
    app = build_app(llm, config)
    with uvicorn_server(app, http=http_protocol(header_timeout=0.5, max_connections=64)) as (url, _):
        yield SimpleNamespace(url=url, llm=llm, app=app)


def raw(url: str, data: bytes, wait: float = 5.0) -> bytes:
    """Send raw bytes on a new connection; return what comes back until the server closes it (or `wait` passes)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as conn:
        conn.sendall(data)
        out = b""
        try:
            while chunk := conn.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out


def test_log_lines_are_escaped_and_bounded(tiny, caplog):
    caplog.set_level(logging.INFO, logger="kiln")
    raw(tiny.url, b"GET /health%0A17:00:00%20INFO%20kiln.access:%20FORGED HTTP/1.1\r\nHost: x\r\nConnection: close"
                  b"\r\n\r\n")  # fmt: skip
    body = {"prompt": "a", "max_tokens": 1, **{f"field_{i}": 0 for i in range(300_000)}}
    assert httpx.post(tiny.url + "/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 5
    while not any("field_" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kiln")]
    assert any("\\n17:00:00 INFO kiln.access: FORGED" in line for line in lines), lines
    assert all("\n" not in line and len(line) < 2000 for line in lines), max(lines, key=len)[:300]
    assert any("ignoring 300000 unknown request field(s): field_0, field_1" in line for line in lines), lines


def test_huge_prompts_are_refused_before_tokenization(tiny):
    """Four 7.9 MB prompts at once: each is a 400 without being tokenized, and /health stays fast meanwhile."""
    body = json.dumps({"prompt": "word " * 1_580_000, "max_tokens": 1}).encode()

    async def main() -> tuple[list[httpx.Response], float, float]:
        async with httpx.AsyncClient(base_url=tiny.url, timeout=60) as http:
            t0 = time.monotonic()
            posts = [asyncio.ensure_future(http.post("/v1/completions", content=body,
                                                     headers={"content-type": "application/json"}))
                     for _ in range(4)]  # fmt: skip
            await asyncio.sleep(0.05)
            h0 = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            health = time.monotonic() - h0
            return await asyncio.gather(*posts), time.monotonic() - t0, health

    responses, total, health = asyncio.run(main())
    for r in responses:
        assert error_of(r, 400)["code"] == "context_length_exceeded"
    assert total < 5.0 and health < 1.0, (total, health)
    chat = {"messages": [{"role": "user", "content": "x" * 600}]}
    assert error_of(httpx.post(tiny.url + "/v1/chat/completions", json=chat), 400)["code"] == "context_length_exceeded"


# ---- sockets ----------------------------------------------------------------------------------------------------


def test_idle_and_slow_sockets_are_closed(tiny):
    host, port = tiny.url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    assert raw(tiny.url, b"", wait=5) == b""  # sent nothing: closed at the 0.5 s header deadline
    assert time.monotonic() - t0 < 3
    with socket.create_connection((host, int(port)), timeout=5) as conn:  # one header byte every 0.2 s
        t0 = time.monotonic()
        with pytest.raises(OSError):
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n":
                conn.sendall(bytes([byte]))
                time.sleep(0.2)
                if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    raise ConnectionResetError
        assert time.monotonic() - t0 < 3


def test_socket_level_errors_are_openai_shaped(tiny):
    big = raw(tiny.url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", wait=2)
    head, _, body = big.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["code"] == "invalid_http_request"
    slow_body = raw(tiny.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Connection: close\r\nContent-Length: 100\r\n\r\n{\"prompt\"")  # fmt: skip
    head, _, body = slow_body.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"


def test_connections_beyond_the_limit_get_503():
    llm, _ = tiny_llm()
    with uvicorn_server(build_app(llm, CONFIG), http=http_protocol(header_timeout=10, max_connections=4)) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(4)]
        try:
            time.sleep(0.2)
            head, _, body = raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "too_many_connections"
        finally:
            for s in held:
                s.close()
        time.sleep(0.2)
        assert httpx.get(url + "/health").status_code == 200


def test_client_that_hangs_up_mid_body_logs_no_error(tiny, caplog):
    caplog.set_level(logging.INFO)
    raw(tiny.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ", wait=0.1)  # fmt: skip
    time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert any("POST /v1/completions 499" in r.getMessage() for r in caplog.records if r.name == "kiln.access")


# ---- API key ----------------------------------------------------------------------------------------------------


def test_api_key_is_compared_as_utf8_bytes_and_one_header_is_required():
    llm, _ = tiny_llm()
    key = "clé-secrète"
    with running_server(build_app(llm, ServerConfig(served_model_names=(TINY,), api_key=key))) as url:
        ok = httpx.get(url + "/v1/models", headers={"authorization": b"Bearer " + key.encode("utf-8")})
        assert ok.status_code == 200
        latin1 = httpx.get(url + "/v1/models", headers={"authorization": b"Bearer " + key.encode("latin-1")})
        assert error_of(latin1, 401)["code"] == "invalid_api_key"
        good = b"Bearer " + key.encode()
        for pair in ([good, good], [b"Bearer wrong", good], [good, b"Bearer wrong"]):
            r = httpx.get(url + "/v1/models", headers=httpx.Headers([(b"authorization", v) for v in pair]))
            assert error_of(r, 400)["code"] == "duplicate_authorization"


# ---- shutdown and readiness -------------------------------------------------------------------------------------


def test_a_stream_cut_at_shutdown_ends_with_an_error_event(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="kiln")
    llm, _ = tiny_llm()
    wait_idle(llm)
    runner = llm.engine.runner

    def slowed(step):  # the tiny model streams all 480 tokens in 0.2 s: slow every step so the cut lands mid-stream
        return lambda *args: time.sleep(0.02) or step(*args)

    for name in ("dispatch", "dispatch_ahead"):
        monkeypatch.setattr(runner, name, slowed(getattr(runner, name)))
    app = build_app(llm, CONFIG)
    with running_server(app) as url:
        body = {"prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        app.state.api.begin_drain(0.2)
                        assert httpx.get(url + "/health").json() == {"status": "stopping"}
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutdown"
        assert len(events) < 400
    wait_idle(llm)
    access = [r.getMessage() for r in caplog.records if r.name == "kiln.access" and "/v1/completions" in r.getMessage()]
    assert "error=server_shutdown" in access[-1], access


def test_loading_state_answers_503_until_the_engine_is_attached():
    llm, _ = tiny_llm()
    app = build_app(None, CONFIG)
    with running_server(app) as url:
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        for r in (httpx.get(url + "/v1/models"), httpx.post(url + "/v1/completions", json={"prompt": "a"})):
            err = error_of(r, 503)
            assert err["code"] == "model_loading" and r.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).models.list()
        assert e.value.status_code == 503
        assert httpx.get(url + "/metrics").status_code == 200
        app.state.api.attach(llm)
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == TINY


# ---- soak -------------------------------------------------------------------------------------------------------


SOAK = os.environ.get("KILN_SOAK") == "full"


def test_soak_with_random_disconnects():
    """Rounds of requests at concurrency 64 (CI: 2 x 60; KILN_SOAK=full: 2 x 500), a fifth of the clients hanging up
    at a random moment (before the body, mid-stream, mid-wait): every request that was not abandoned completes,
    none gets a 5xx, and after each round the engine holds zero pages and zero running requests."""
    llm, _ = tiny_llm()
    per_round = 500 if SOAK else 60
    rng = random.Random(14)

    async def one(http: httpx.AsyncClient, i: int, gate: asyncio.Semaphore) -> str:
        async with gate:
            stream, drop = rng.random() < 0.5, rng.random() < 0.2
            body = {"model": TINY, "prompt": f"soak {i}", "max_tokens": rng.randint(1, 24), "temperature": 0.8,
                    "seed": i, "stream": stream, "ignore_eos": True}  # fmt: skip
            if drop:
                try:
                    await asyncio.wait_for(http.post("/v1/completions", json=body), rng.uniform(0.0, 0.3))
                except TimeoutError:
                    return "dropped"
                return "done"
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            if stream:
                events = sse_events(r.text)
                assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            else:
                assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
            return "done"

    async def round_() -> list[str]:
        gate = asyncio.Semaphore(64)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, i, gate) for i in range(per_round)))

    with running_server(build_app(llm, CONFIG)) as url:
        for _ in range(2):
            outcomes = asyncio.run(round_())
            assert outcomes.count("done") >= per_round // 2
            wait_idle(llm, timeout=30)
            stats = llm.stats()  # zero pages held, zero running (wait_idle waited for both)
            assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == 0.0
        assert httpx.get(url + "/health").status_code == 200
