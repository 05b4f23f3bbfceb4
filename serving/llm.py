"""The engine's two front doors and the function that builds it.

* `build_engine(source, ...)`: an Engine from a model source (HF folder, .gguf, None = the embedded SmolLM2; the step
  is jitted on the local device) or from an artifact folder (kiln.compile.artifact.load; its compiled programs).
* `LLM(model_or_artifact).generate(prompts, params)`: offline batch generation, all prompts through one engine.
* `AsyncLLM(engine)`: the engine loop on its own thread; `async for out in llm.generate(id, ids, params)` yields the
  incremental RequestOutputs of one request and aborts it when the consumer stops iterating or is cancelled
  (`llm.submit(id, ids, params, queue)` hands a request over at once, its outputs onto a queue: the HTTP routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from kiln.compile.plan import Options, fuses_linears, make_geometry, resolve_target
from kiln.models.batch import KVCache
from kiln.models.checkpoint import load_checkpoint, resolve_source, source_name
from kiln.models.errors import KilnError
from kiln.models.quant import quantize_weights, weights_format
from kiln.models.step import jit_decode_steps, jit_step
from kiln.models.transformer import fuse_linears
from kiln.serving.block_manager import BlockManager
from kiln.serving.engine import Engine, EngineStats
from kiln.serving.params import RequestOutput, SamplingParams
from kiln.serving.runner import Runner
from kiln.serving.scheduler import Scheduler

log = logging.getLogger("kiln.engine")

DEFAULT_MAX_MODEL_LEN = 2048  # when the model allows more, on the dev path
DEFAULT_KV_TOKENS = 16384


def _tokenizer_from(path: Path):
    from kiln.serving.tokenizer import Tokenizer

    return Tokenizer.from_source(path)


def _tokenizer_load(folder: Path, backend=None):
    from kiln.serving.tokenizer import Tokenizer

    return Tokenizer.load(folder, backend=backend)


def build_engine(
    source: str | Path | None = None,
    *,
    target: str = "auto",
    enable_prefix_caching: bool = True,
    load_tokenizer: bool = True,
    model_name: str | None = None,
    warmup: bool = False,
    defer_programs: bool = False,
    prefetch=None,
    **options,
) -> Engine:
    """An Engine for a model source or an artifact folder (which fixes every option itself).

    A source is planned like `kiln compile` plans it (kiln.compile.plan: `options` are its Options, `target` a
    target name, "auto" = this machine's) and the same step programs are jitted on the local device instead of
    compiled ahead of time: the target's attention, dtype, buckets, KV pages and decode steps. warmup=True compiles
    (runs) every bucket now instead of at first use. defer_programs (an artifact on a CPU, `kiln serve`): the engine
    starts with the first buckets' programs (kiln.compile.artifact.first_programs) and AsyncLLM adds the others, one
    at a time, while it is idle (Later). prefetch: the artifact's checks `kiln serve` started before it imported jax
    (kiln.compile.checks.Prefetch; the load takes them)."""
    path = resolve_source(source)
    name = model_name or source_name(path)
    if path.is_dir() and (path / "manifest.json").exists():
        try:
            return _build_from_artifact(
                path, name, enable_prefix_caching, load_tokenizer, warmup, defer_programs, prefetch
            )
        finally:
            if prefetch is not None:
                prefetch.close()
    opts = Options.from_kwargs(**options)
    if opts.tp not in (None, 1):
        raise KilnError("Tensor parallelism needs an artifact: `kiln compile --tp N`, then serve the artifact.")
    plan_target = resolve_target(target, opts)
    cfg, weights = load_checkpoint(path, dtype=jnp.dtype(plan_target.compute_dtype))
    tokenizer = _tokenizer_from(path) if load_tokenizer else None
    return engine_from_weights(
        cfg, weights, plan_target, opts, tokenizer, name, enable_prefix_caching, warmup, source=path
    )


def engine_from_weights(
    cfg,
    weights,
    plan_target,
    opts: Options,
    tokenizer,
    name: str,
    prefix_caching: bool = True,
    warmup: bool = False,
    source: Path | None = None,
) -> Engine:
    """The jit path's Engine for a model already in memory (weights on the host or the device, in the compute dtype;
    benchmarks make random ones on the device): the plan's geometry, the programs jitted on the local device. source:
    the checkpoint, whose blocks weight format "gguf" keeps when it is a GGUF file."""
    weights = quantize_weights(weights, plan_target.weight_format, source=source)
    plan_target = plan_target.replace(weight_format=weights_format(weights))  # "gguf" names the kept blocks' types
    if fuses_linears(plan_target):  # the layout kiln compile stores (q|k|v, gate|up)
        weights = fuse_linears(cfg, weights)
    weight_bytes = sum(a.nbytes // 2 if a.dtype == jnp.int4 else a.nbytes for a in jax.tree.leaves(weights))
    geom = make_geometry(cfg, plan_target, opts, tp=1, weight_bytes=weight_bytes)
    kv = KVCache.create(cfg, geom.num_pages, geom.page_size, dtype=jnp.dtype(geom.kv_dtype))
    decode = jit_decode_steps(cfg, geom.attention, geom.decode_steps) if geom.decode_buckets else None
    runner = Runner(
        jit_step(cfg, geom.attention),
        jax.device_put(weights),
        kv,
        page_size=geom.page_size,
        max_num_seqs=geom.max_num_seqs,
        max_pages_per_seq=geom.max_pages_per_seq,
        buckets=geom.buckets,
        seqs_per_bucket={t: geom.seqs(t) for t in geom.buckets},
        decode={t: decode for t in geom.decode_buckets} if decode else None,
    )
    return _assemble(
        cfg, runner, geom.num_pages, geom.page_size, geom.max_model_len, tokenizer, name, prefix_caching, warmup,
        geom.decode_steps,
    )  # fmt: skip


def _checked_tokenizer(folder: Path, prefetch=None):
    """The artifact's tokenizer, its files checked against the manifest first (on a thread beside the load, which
    checks the manifest itself: a refused file is the load's one sentence). With a prefetch, tokenizer.json's backend
    tokenizer is the one it parsed from the bytes that passed the check, before jax's import ended (SmolLM2: 0.2-0.28
    CPU-s that left the load's window, where both cores are busy)."""
    from kiln.compile import artifact

    files = artifact.read_manifest(folder).get("files", {})
    backend = None
    if isinstance(files, dict):
        ours = {n: d for n, d in files.items() if not n.startswith(("programs/", "weights/"))}
        artifact.verify_checksums(folder, {"files": ours}, prefetch)
        digest = ours.get("tokenizer.json")
        early = prefetch.tokenizer(digest) if prefetch is not None and digest is not None else None
        backend = early.result() if early is not None else None
    return _tokenizer_load(folder, backend)


def _build_from_artifact(
    path: Path, name: str, prefix_caching: bool, load_tokenizer: bool, warmup: bool, defer: bool = False, prefetch=None
) -> Engine:
    from concurrent.futures import ThreadPoolExecutor

    from kiln.compile import artifact

    started = process_age()  # the imports before this point
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-side") as side:
        tok = side.submit(_checked_tokenizer, path, prefetch) if load_tokenizer else None  # beside the load
        gathers = side.submit(_prime_deferred, path) if defer and warmup else None
        art = artifact.load(path, defer=defer, prefetch=prefetch)
        t0 = time.perf_counter()
        tokenizer = tok.result() if tok is not None else None
        t_tok = time.perf_counter() - t0  # what the load left of it
        if gathers is not None:
            gathers.result()
    t0 = time.perf_counter()
    kv = art.make_kv()
    jax.block_until_ready(kv)
    t_kv = time.perf_counter() - t0
    runner = Runner(
        art.programs,
        art.weights,
        kv,
        page_size=art.page_size,
        max_num_seqs=art.max_num_seqs,
        max_pages_per_seq=art.max_pages_per_seq,
        buckets=art.buckets,
        seqs_per_bucket=art.seqs_per_bucket,  # small buckets are lowered with a small S
        decode=art.decode_programs,
        gathers=art.gathers,
    )
    runner.startup = {"imports": started, **art.timings, "kv": t_kv, "tokenizer": t_tok,
                      "weight_bytes": art.weight_bytes}  # fmt: skip
    engine = _assemble(
        art.cfg, runner, art.num_pages, art.page_size, art.max_model_len, tokenizer, name, prefix_caching,
        warmup, art.decode_steps,
    )  # fmt: skip
    engine.later = Later(art, engine) if art.later else None  # read by AsyncLLM's engine thread
    runner.startup["deferred"] = len(art.later)
    if warmup and engine.later is not None:
        t0 = time.perf_counter()
        later_decodes = [int(n.rsplit("_t", 1)[1]) for n in art.later if n.startswith("decode_t")]
        prime_run_ahead(runner, art.mesh, later_decodes, art.decode_steps)
        runner.startup["warmup"] = runner.startup.get("warmup", 0.0) + time.perf_counter() - t0
    return engine


def _prime_deferred(path: Path) -> None:
    """Compile Runner.dispatch_ahead's token gathers for a deferred CPU load's decode buckets (none of whose programs
    loads before ready) beside the load: the gathers' three small jit compilations (0.16 CPU-s for SmolLM2) came
    after the warm-up, the last thing before ready. prime_run_ahead runs after the warm-up as before, on the loaded
    artifact's mesh, and finds these compiled (or compiles what this could not foresee, or what failed here: a
    manifest the load refuses is its sentence, not this function's)."""
    from kiln.compile import artifact
    from kiln.compile.convert import make_mesh
    from kiln.serving.runner import gather_padding

    try:
        manifest = artifact.read_manifest(path, check=False)  # only read: the load checks it
        geom = artifact.lower.Geometry.from_dict(manifest["geometry"])
        if manifest["target"]["platform"] != "cpu" or geom.tp != 1 or jax.process_count() != 1:
            return
        if all(f"gather_t{t}" in manifest["programs"] for t in geom.decode_buckets):
            return  # compiled into the artifact
        seqs = {t: geom.seqs(t) for t in geom.decode_buckets}
        _warm_gathers(gather_padding, make_mesh(jax.devices(), 1), seqs, geom.decode_steps)
    except Exception as e:  # noqa: BLE001 (only a head start: prime_run_ahead compiles them after the warm-up)
        log.debug("kiln: the run-ahead gathers were not compiled beside the load (%s: %s)", type(e).__name__, e)


def prime_run_ahead(runner: Runner, mesh, buckets, steps: int) -> None:
    """Compile the runner's run-ahead token gather (Runner.warm_gather) for decode buckets whose programs load after
    ready, as Runner.warmup does for the others: on tokens of the shape, dtype and sharding of those programs'
    sampled tokens (steps, S), so that nothing compiles once they are in."""
    if buckets and runner.can_run_ahead:  # an artifact's compiled gathers run once (Runner.warm_gather)
        _warm_gathers(runner.warm_gather, mesh, {t: runner.seqs_per_bucket[t] for t in buckets}, steps)


def _warm_gathers(warm, mesh, seqs: dict[int, int], steps: int) -> None:
    """warm(t, tokens) for each decode bucket t of seqs ({bucket: S}) on zero tokens (steps, S), replicated on mesh:
    the shape, dtype and sharding of that bucket's decode program's sampled tokens."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())
    for t, s in seqs.items():
        warm(t, jax.device_put(np.zeros((steps, s), np.int32), replicated))


LATER_IDLE_S = 1.0  # seconds the engine has had no request before it loads one more deferred program
# seconds of work without a pause after which the engine loads one more between two steps (steady traffic would
# otherwise keep a CPU start on its first programs: one sequence decoding in step_t16 at ~2.8x decode_t1's time a
# token, SmolLM2 on 2 cores); the running requests wait for that program once (~1-2 s)
LATER_BUSY_S = 10.0


class Later:
    """The programs a deferred load left out (kiln.compile.artifact.load(defer=True)): AsyncLLM's engine thread calls
    install_next() once the engine has had no request for LATER_IDLE_S, so a request waits at most for one program
    (its deserialization and first call, ~1-3 s on a 2-core CPU), and between two steps once it has worked for
    LATER_BUSY_S since it started or last loaded one, so that steady traffic gets the rest too.

    install_next deserializes the next program, runs it once on a batch that writes no K/V (its first call builds
    XLA:CPU's runtimes, as Runner.warmup does before ready) and gives its bucket to the runner and the scheduler (a
    step program) or its decode to the runner; a program that fails to load is logged and left out."""

    def __init__(self, art, engine: Engine):
        self.art, self.engine = art, engine
        self.names = list(art.later)
        self.started = time.perf_counter()

    def pending(self) -> bool:
        return bool(self.names)

    def install_next(self) -> None:
        name = self.names.pop(0)
        runner, scheduler = self.engine.runner, self.engine.scheduler
        try:
            program = self.art.load_later(name)
        except Exception as e:  # noqa: BLE001 (the server keeps the programs it has)
            log.error("kiln: program %s did not load (%s: %s); serving without it", name, type(e).__name__, e)
            return
        kind, t = name.rsplit("_t", 1)
        t = int(t)
        try:
            warm_quietly(runner, program, t, decode=kind == "decode")
        except Exception as e:  # noqa: BLE001 (left out; if the cache was consumed, the next step fails as any would)
            log.error("kiln: program %s failed its first run (%s: %s); serving without it", name, type(e).__name__, e)
            return
        runner.install(t, program, decode=kind == "decode")
        if kind != "decode":
            scheduler.buckets = runner.buckets
            scheduler.max_num_batched_tokens = runner.buckets[-1]
        if not self.names:
            log.info("kiln: every program loaded (%d deferred, the last %.2f s after the engine started)",
                     len(self.art.later), time.perf_counter() - self.started)  # fmt: skip


def warm_quietly(runner: Runner, program, t: int, decode: bool) -> jax.Array:
    """Run `program` (bucket t; a multi-step decode if `decode`) once while the engine serves: one live sequence with
    a page of cached keys (page 0, read only), so the attention's loop over cached pages runs as in Runner.warmup,
    but every slot is -1 and the pages a multi-step decode would write next are out of range, so no K/V is written
    (the live sequences' and the prefix cache's pages are left as they are). Returns the sampled tokens."""
    from kiln.models.batch import SeqChunk, make_batch

    num_seqs, page_size = runner.seqs_per_bucket[t], runner.page_size
    num_tokens = 1 if decode else t
    start = page_size
    end = start + num_tokens + 16  # room for a multi-step decode's further tokens
    pages = [0] + [runner.kv.num_pages] * (-(-end // page_size) - 1)
    chunks = [SeqChunk([0] * num_tokens, start, pages)] if len(pages) <= runner.max_pages_per_seq else []
    batch = make_batch(chunks, page_size, t, num_seqs, runner.max_pages_per_seq)
    batch.slot_mapping[:] = -1
    out, runner.kv = program(runner.weights, runner.kv, batch, runner.sampling_batch([], num_seqs))
    return jax.block_until_ready(out.tokens)


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), or None where that is not known."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def startup_report(engine: Engine) -> str:
    """One line with the seconds of each start-up phase of an engine built from an artifact (empty for the jit path):
    imports (process start to load), the artifact's load with its manifest, checksums, executables and weights (the
    last three overlap on a thread pool), the KV cache, tokenizer, warm-up, server (the rest, up to now), the total
    and the CPU seconds of all threads. A deferred CPU start's load deserializes init_kv and one step program."""
    t = dict(getattr(engine.runner, "startup", {}))
    if "load" not in t:  # the jit path loads no artifact (its runner may still time a warm-up)
        return ""
    age = process_age()
    load = ", ".join(f"{k} {t[k]:.2f}" for k in ("manifest", "checksums", "executables", "weights") if k in t)
    parts = [f"imports {t['imports']:.2f}" if t.get("imports") is not None else None, f"load {t['load']:.2f} ({load})"]
    after = ("kv", "tokenizer", "warmup")  # the phases after the load, one after another
    parts += [f"{k} {t[k]:.2f}" for k in after if k in t]
    if age is not None and t.get("imports") is not None:
        rest = age - t["imports"] - sum(t.get(k, 0.0) for k in ("load", *after))
        parts += [f"server {max(0.0, rest):.2f}", f"total {age:.2f}"]
    parts.append(f"cpu {time.process_time():.2f}")  # all threads' CPU seconds so far (a figure a busy machine keeps)
    weights = f"{t.get('weight_bytes', 0) / 1e6:.1f} MB of weights"
    later = f"; {t['deferred']} more programs load while idle" if t.get("deferred") else ""
    return f"start-up seconds: {', '.join(p for p in parts if p)}; {weights}{later}"


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
        t0 = time.perf_counter()
        runner.warmup()
        runner.startup["warmup"] = time.perf_counter() - t0
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

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, rendered with
        the model's chat template (tools and chat_template_kwargs such as enable_thinking reach it), then generated
        like generate(); structured outputs come through params.structured_outputs."""
        if self.tokenizer is None:
            raise KilnError("LLM.chat needs the model's tokenizer and chat template.")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = chat_template_kwargs or {}
        prompts = [self.tokenizer.encode_chat(list(c), add_generation_prompt, tools, **kwargs) for c in convs]
        return self.generate(prompts, params)


class EngineDead(RuntimeError):
    """The engine thread has stopped (an internal failure or a shutdown): nothing more will be served."""


class AsyncLLM:
    """The engine on its own thread, for an asyncio server. Requests and aborts reach the thread through a queue;
    outputs come back through one asyncio.Queue per request (call_soon_threadsafe).

    When a step raises, the thread stops and every request it knows, running or still in its inbox, is answered
    with EngineDead at once; later requests get EngineDead too. A request whose shape the engine cannot hold (more
    tokens than a sequence's pages or the whole cache) is refused before it reaches the thread (`max_model_len`
    here is the smallest of the context length and those two capacities)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        runner, bm = engine.runner, engine.scheduler.bm
        pages = min(runner.max_pages_per_seq, bm.num_pages)
        self.max_model_len = min(engine.max_model_len, pages * runner.page_size)
        self.cfg = engine.cfg
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # orders "closed" against new requests entering the inbox
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_source(cls, source: str | Path | None = None, **engine_args) -> AsyncLLM:
        return cls(build_engine(source, **engine_args))

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's incremental outputs until one is finished. Raises KilnError for input the engine
        cannot serve (before anything is yielded) and EngineDead when the engine has stopped or fails meanwhile."""
        q: asyncio.Queue = asyncio.Queue()
        self.submit(request_id, prompt_token_ids, params, q)
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

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None,
               sink: Any) -> None:  # fmt: skip
        """Hand a request to the engine thread now (generate() does it at its first iteration): `sink.put_nowait(item)`
        is then called on this event loop with each incremental output, or once with the exception that ends the
        request (EngineDead). Raises KilnError for input the engine cannot serve and EngineDead when the engine has
        stopped. The caller aborts the request unless an output came back finished."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        self.engine.check_prompt(prompt)
        self.engine.check_params(params)
        if len(prompt) + (params.max_tokens or 1) > self.max_model_len:
            raise KilnError(
                f"The prompt has {len(prompt)} tokens and {params.max_tokens or 1} more were asked for, but this "
                f"engine holds at most {self.max_model_len} tokens per sequence."
            )
        with self._lock:
            if self._error is not None:
                raise EngineDead(str(self._error))
            self._inbox.put(("add", request_id, prompt, params, asyncio.get_running_loop(), sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still running end with EngineDead."""
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        later = getattr(self.engine, "later", None)  # Later: programs a deferred load left for idle moments
        quiet = time.monotonic()  # since when the engine has had nothing to do
        loaded = time.monotonic()  # since when no deferred program was loaded
        try:
            while True:
                idle = not self.engine.has_unfinished()
                try:
                    if idle and later is not None and later.pending():
                        left = LATER_IDLE_S - (time.monotonic() - quiet)
                        if left <= 0 and self._inbox.empty():
                            later.install_next()  # then the next one at once, unless a request came meanwhile
                            loaded = time.monotonic()
                            continue
                        cmd = self._inbox.get(timeout=max(left, 0.001))
                    else:
                        cmd = self._inbox.get(block=idle)
                    while True:
                        if cmd[0] == "stop":
                            self._fail_all(EngineDead("The engine has shut down."))
                            return
                        self._handle(cmd)
                        cmd = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                if self.engine.has_unfinished():
                    if later is not None and later.pending() and time.monotonic() - loaded >= LATER_BUSY_S:
                        later.install_next()  # between two steps: it writes no K/V, a step in flight keeps its own
                        loaded = time.monotonic()
                    for out in self.engine.step():
                        self._deliver(out)
                    quiet = time.monotonic()
                self._stats = self.engine.stats()
        except BaseException:  # the engine is broken: tell every waiting request, then stop
            log.exception("engine loop failed; every request is answered with engine_dead")
            self._fail_all(EngineDead("The engine stopped after an internal error; the server must be restarted."))

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, prompt, params, loop, q = cmd
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # this request only (KilnError: its input; anything else: a 500 for it)
                _put(loop, q, e)
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
        if not _put(loop, q, out):  # the consumer's loop is closed
            self._streams.pop(out.request_id, None)
            self.engine.abort(out.request_id)

    def _fail_all(self, error: EngineDead) -> None:
        """Mark the engine dead and answer every registered request and every request still in the inbox."""
        with self._lock:
            self._error = error
        for _, (loop, q) in list(self._streams.items()):
            _put(loop, q, error)
        self._streams.clear()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                _put(cmd[4], cmd[5], error)
        with contextlib.suppress(Exception):  # free the pages of what was running (best effort: it may be broken)
            for rid in list(self.engine._requests):
                self.engine.abort(rid)
            self._stats = self.engine.stats()


def _put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item: object) -> bool:
    try:
        loop.call_soon_threadsafe(q.put_nowait, item)
        return True
    except RuntimeError:  # the loop is closed
        return False
