"""Helpers for the server tests: a tiny random model with a byte-level tokenizer, a shared AsyncLLM over it, and a real
uvicorn server on a free 127.0.0.1 port in a thread."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from jax import monitoring
from tiny_models import make_model
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kiln.serving.llm import LLM, AsyncLLM, build_engine
from kiln.serving.params import RequestOutput, SamplingParams

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer whose token id is the byte value (vocab 256, like the tiny models), bos 1, eos 2. Random
    weights then emit arbitrary bytes, which exercises incremental UTF-8 detokenization."""
    b2u = bytes_to_unicode()
    tok = HFTokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": b2u[1], "eos_token": b2u[2]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_model_folder(folder: Path) -> Path:
    make_model("llama", folder)
    write_byte_tokenizer(folder)
    return folder


# The embedded SmolLM2's engines of test_server, test_structured, test_agent_api and test_engine: one geometry (context,
# sequences, KV pages: 4 x 1024 tokens on a cpu), so that their step and decode programs are the same programs
# (kiln.models.step's jitted functions are cached per model, their executables per shape) and compile once per worker;
# conftest.py's ENGINES group puts them on one worker. Each file adds its buckets (its programs: step_t16,
# decode_t16; step_t1 and decode_t1 with bucket 1).
SMOL_ENGINE_ARGS = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=16, quantize="float")
TINY_ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, buckets=(16, 64))
TINY_REFERENCE_PROMPT = "Hi there"
TINY_COMPILES: list[str] = []  # XLA compilations during tiny_llm's first request (tests/test_server.py: none)


@functools.cache
def tiny_folder() -> Path:
    """The tiny llama (HF folder with the byte-level tokenizer), written once per test session."""
    folder = Path(tempfile.mkdtemp(prefix="kiln-tiny-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return tiny_model_folder(folder / "tiny-llama")


@functools.cache
def tiny_llm() -> tuple[AsyncLLM, RequestOutput]:
    """One AsyncLLM over the tiny llama for the whole test session (its compilation is the slow part), and the offline
    greedy output for TINY_REFERENCE_PROMPT computed on the same engine before the engine thread started."""
    engine = build_engine(str(tiny_folder()), **TINY_ENGINE_ARGS, warmup=True)

    def listen(event: str, secs: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            TINY_COMPILES.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:  # the first request after the warm-up: its prefill, then multi-step decodes dispatched ahead
        ref = LLM(engine=engine).generate([TINY_REFERENCE_PROMPT], SamplingParams(max_tokens=24, temperature=0.0))[0]
    finally:
        monitoring.unregister_event_duration_listener(listen)
    llm = AsyncLLM(engine)
    atexit.register(llm.shutdown)
    return llm, ref


@contextlib.contextmanager
def uvicorn_server(app, graceful: float = 5.0, **options) -> Iterator[tuple[str, uvicorn.Server]]:
    """Serve `app` with uvicorn on a free 127.0.0.1 port in a thread (graceful: uvicorn's timeout_graceful_shutdown;
    options: more uvicorn.Config options, e.g. http=kiln.serving.transport.http_protocol(...)); yields (base URL,
    server). Setting server.should_exit is what SIGTERM does (without the app's drain)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=graceful, **options)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:
    """Serve `app` on a free 127.0.0.1 port; yields the base URL (http://127.0.0.1:PORT)."""
    with uvicorn_server(app) as (url, _):
        yield url


def wait_idle(llm: AsyncLLM, timeout: float = 20.0) -> None:
    """Wait until the engine holds no request and no KV page (its block manager's idle counters)."""
    deadline = time.monotonic() + timeout
    while True:
        s = llm.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0.0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {s}")
        time.sleep(0.05)
