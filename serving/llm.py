"""The engine's two front doors and the function that builds it.

* `build_engine(source, ...)`: an Engine from a model source (HF folder, .gguf, None = the embedded SmolLM2; the step
  is jitted on the local device) or from an artifact folder (kiln.compile.artifact.load; its compiled programs).
* `LLM(model_or_artifact).generate(prompts, params)`: offline batch generation, all prompts through one engine.
* `AsyncLLM(engine)`: the engine loop on its own thread; `async for out in llm.generate(id, ids, params)` yields the
  incremental RequestOutputs of one request and aborts it when the consumer stops iterating or is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from kiln.compile.convert import quantize_weights
from kiln.models.batch import KVCache
from kiln.models.checkpoint import load_checkpoint, resolve_source
from kiln.models.errors import KilnError
from kiln.models.step import jit_decode_steps, jit_step
from kiln.serving.block_manager import BlockManager
from kiln.serving.engine import Engine, EngineStats
from kiln.serving.params import RequestOutput, SamplingParams
from kiln.serving.runner import Runner, dev_buckets
from kiln.serving.scheduler import Scheduler
from kiln.targets.target import KV_DTYPES

log = logging.getLogger("kiln.engine")

DEFAULT_MAX_MODEL_LEN = 2048  # when the model allows more, on the dev path
DEFAULT_KV_TOKENS = 16384


def _tokenizer_from(path: Path):
    from kiln.serving.tokenizer import Tokenizer

    return Tokenizer.from_source(path)


def _tokenizer_load(folder: Path):
    from kiln.serving.tokenizer import Tokenizer

    return Tokenizer.load(folder)


def build_engine(
    source: str | Path | None = None,
    *,
    max_model_len: int | None = None,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    page_size: int = 16,
    kv_tokens: int | None = None,
    buckets: Sequence[int] | None = None,
    dtype: str = "float32",
    attention: str = "reference",
    enable_prefix_caching: bool = True,
    load_tokenizer: bool = True,
    model_name: str | None = None,
    warmup: bool = False,
    decode_steps: int = 1,
    quantize: str | None = None,
    kv_dtype: str | None = None,
) -> Engine:
    """An Engine for a model source or an artifact folder (which fixes every geometry option itself).

        KV pages: ceil(kv_tokens / page_size), kv_tokens defaulting to max_num_seqs * max_model_len capped at 16384
        (at least max_model_len). Token buckets: 1, 16, 64, ... up to max_num_batched_tokens unless given (runner.py
    says why), each padded to min(T, max_num_seqs) sequences.
        warmup=True compiles (runs) every bucket now instead of at first use. decode_steps > 1: when every running
    sequence decodes, that many tokens per dispatch (kiln.models.step.decode_steps). quantize: the weight format
    ("float", "int8", "int4"; kiln.compile.convert.quantize_weights). kv_dtype: the KV cache's dtype when not `dtype`
    ("fp8" = float8_e4m3fn)."""
    path = resolve_source(source)
    name = model_name or (path.stem if path.is_file() else path.name)
    if path.is_dir() and (path / "manifest.json").exists():
        return _build_from_artifact(path, name, enable_prefix_caching, load_tokenizer, warmup)
    if decode_steps < 1:
        raise KilnError("decode_steps must be at least 1.")
    cfg, weights = load_checkpoint(path, dtype=jnp.dtype(dtype))
    max_model_len = max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > cfg.max_position_embeddings:
        raise KilnError(f"max_model_len {max_model_len} exceeds the model's {cfg.max_position_embeddings} positions.")
    if max_num_batched_tokens < max_num_seqs:
        raise KilnError("max_num_batched_tokens must be at least max_num_seqs.")
    kv_tokens = kv_tokens or min(max_num_seqs * max_model_len, DEFAULT_KV_TOKENS)
    max_pages_per_seq = -(-max_model_len // page_size)
    num_pages = max(-(-kv_tokens // page_size), max_pages_per_seq)
    weights = jax.device_put(quantize_weights(weights, quantize or "float"))
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise KilnError(f"Unknown KV dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}.")
    kv_dtype = KV_DTYPES[kv_dtype] if kv_dtype else dtype
    if kv_dtype == "float8_e4m3fn" and attention == "pallas_tpu":
        raise KilnError("An fp8 KV cache needs attention pallas_gpu, xla_cpu or reference (not pallas_tpu).")
    kv = KVCache.create(cfg, num_pages, page_size, dtype=jnp.dtype(kv_dtype))
    runner = Runner(
        jit_step(cfg, attention),
        weights,
        kv,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_pages_per_seq=max_pages_per_seq,
        buckets=tuple(buckets) if buckets else dev_buckets(max_num_batched_tokens),
        shrink_seqs=True,
        decode=jit_decode_steps(cfg, attention, decode_steps) if decode_steps > 1 else None,
    )
    tokenizer = _tokenizer_from(path) if load_tokenizer else None
    return _assemble(
        cfg, runner, num_pages, page_size, max_model_len, tokenizer, name, enable_prefix_caching, warmup, decode_steps
    )


def _build_from_artifact(path: Path, name: str, prefix_caching: bool, load_tokenizer: bool, warmup: bool) -> Engine:
    from kiln.compile import artifact

    art = artifact.load(path)
    runner = Runner(
        art.programs,
        art.weights,
        art.make_kv(),
        page_size=art.page_size,
        max_num_seqs=art.max_num_seqs,
        max_pages_per_seq=art.max_pages_per_seq,
        buckets=art.buckets,
        seqs_for=art.seqs_per_bucket,  # small buckets are lowered with a small S
        decode=art.decode_programs,
    )
    tokenizer = _tokenizer_load(Path(art.tokenizer_dir)) if load_tokenizer else None
    return _assemble(
        art.cfg, runner, art.num_pages, art.page_size, art.max_model_len, tokenizer, name, prefix_caching, warmup,
        art.decode_steps,
    )  # fmt: skip


def _assemble(
    cfg, runner, num_pages, page_size, max_model_len, tokenizer, name, prefix_caching, warmup, decode_steps
) -> Engine:
    eos = tuple(cfg.eos_token_ids) + tuple(tokenizer.eos_token_ids if tokenizer is not None else ())
    scheduler = Scheduler(
        BlockManager(num_pages, page_size, enable_prefix_caching=prefix_caching),
        max_num_seqs=runner.max_num_seqs,
        max_num_batched_tokens=runner.buckets[-1],
        max_model_len=max_model_len,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        buckets=runner.buckets,
    )
    if warmup:
        runner.warmup()
    return Engine(runner, scheduler, cfg=cfg, tokenizer=tokenizer, model_name=name, decode_steps=decode_steps)


def _prompt_ids(engine: Engine, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise KilnError("Text prompts need a tokenizer; this engine has none, so give token ids.")
        return engine.tokenizer.encode(prompt)
    return [int(t) for t in prompt]


class LLM:
    """Offline generation: `LLM(source).generate(prompts, params)` runs every prompt through one engine (continuous
    batching) and returns one finished RequestOutput per prompt, in order, holding all its tokens and text."""

    def __init__(self, model_or_artifact: str | Path | None = None, engine: Engine | None = None, **engine_args):
        self.engine = engine or build_engine(model_or_artifact, **engine_args)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise KilnError(f"{len(prompts)} prompts but {len(per)} SamplingParams.")
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        ids = [f"offline-{engine._arrivals + i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p in zip(ids, prompts, per, strict=True):
                engine.add_request(rid, _prompt_ids(engine, prompt), p)
                results[rid] = RequestOutput(rid, [], "", logprobs=[] if p.logprobs is not None else None)
            while engine.has_unfinished():
                for out in engine.step():
                    acc = results[out.request_id]
                    acc.new_token_ids += out.new_token_ids
                    acc.new_text += out.new_text
                    if out.logprobs:
                        acc.logprobs += out.logprobs
                    acc.finished, acc.finish_reason = out.finished, out.finish_reason
                    acc.prompt_tokens, acc.completion_tokens = out.prompt_tokens, out.completion_tokens
                    acc.cached_tokens = out.cached_tokens
        finally:
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished() and not engine.scheduler.has_work():
                engine.step()
        return [results[rid] for rid in ids]


class AsyncLLM:
    """The engine on its own thread, for an asyncio server. Requests and aborts reach the thread through a queue;
    outputs come back through one asyncio.Queue per request (call_soon_threadsafe)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.cfg = engine.cfg
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_source(cls, source: str | Path | None = None, **engine_args) -> AsyncLLM:
        return cls(build_engine(source, **engine_args))

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's incremental outputs until one is finished. Raises KilnError for input the engine
        cannot serve (before anything is yielded) or when the engine has stopped."""
        if not self.is_alive():
            raise KilnError("The engine has stopped.")
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        self.engine.check_prompt(prompt)
        self.engine.check_params(params)
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", request_id, prompt, params, asyncio.get_running_loop(), q))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running end with an error."""
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                try:
                    cmd = self._inbox.get(block=idle)
                    while True:
                        if cmd[0] == "stop":
                            self._fail_all(KilnError("The engine shut down."))
                            return
                        self._handle(cmd)
                        cmd = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._deliver(out)
                self._stats = self.engine.stats()
        except BaseException as e:  # the engine is broken: tell every waiting request, then stop
            log.exception("engine loop failed")
            self._error = e
            self._fail_all(KilnError(f"The engine failed: {e}"))

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, loop, q = cmd
            try:
                self.engine.add_request(rid, prompt, params)
            except KilnError as e:
                loop.call_soon_threadsafe(q.put_nowait, e)
                return
            self._streams[rid] = (loop, q)
        elif cmd[0] == "abort":
            self._streams.pop(cmd[1], None)
            self.engine.abort(cmd[1])

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
        if stream is None:
            return
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the consumer's loop is closed
            self._streams.pop(out.request_id, None)
            self.engine.abort(out.request_id)

    def _fail_all(self, error: BaseException) -> None:
        for rid, (loop, q) in list(self._streams.items()):
            try:
                loop.call_soon_threadsafe(q.put_nowait, error)
            except RuntimeError:
                pass
            self.engine.abort(rid)
        self._streams.clear()
