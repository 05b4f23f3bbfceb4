"""Runner: turns a SchedulerOutput into one call of the step program and hands back host lists.

It works with either a jitted step (`kiln.models.step.jit_step`, one callable compiled per shape on first use) or an
artifact's programs (`{T: callable}` per token bucket); both take (weights, kv, batch, sampling) and return
(StepOut, kv), the cache donated. The batch is padded to the smallest bucket T >= the step's tokens, and to the
bucket's S sequences (seqs_per_bucket, from kiln.compile.lower.Geometry.seqs: S = min(T, max_num_seqs), as a step of T
tokens holds at most T sequences, so small buckets get a small S; on a CPU, decode at batch 1 with T = S = 1 measured
~6x faster than with T = S = 16: XLA's small-M matmuls, the lm_head above all, cost nearly as much as M = 16).

dispatch() only enqueues the step (JAX dispatch is asynchronous) and returns at once; collect() reads the sampled
tokens, the one synchronisation per step. Between the two the engine does its host work for the previous step.
dispatch_ahead() enqueues the multi-step decode that follows one still in flight, its input tokens read on the device,
so the device need not wait for the host between two decode programs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kiln.compile.lower import last_tokens
from kiln.models.batch import KVCache, SeqChunk, make_batch
from kiln.models.sampling import HISTORY_LEN, MAX_BLOCKED, SamplingBatch, StepOut
from kiln.serving.scheduler import SchedulerOutput
from kiln.serving.structured import fill_masks

_last_tokens = jax.jit(last_tokens)  # the run-ahead token gather where no artifact brings it compiled (gather_t<T>)


def gather_padding(t: int, tokens: jax.Array, gather: Callable = _last_tokens) -> jax.Array:
    """The gather of decode bucket t for a batch of padding only: what compiles the jitted one for tokens' shape, dtype
    and sharding (Runner.warm_gather; kiln.serving.llm's priming before a deferred load's programs are in), or runs an
    artifact's once."""
    return gather(tokens, np.full(t, -1, np.int32)).block_until_ready()


@dataclass
class Pending:
    """A step in flight."""

    out: StepOut  # device arrays; with steps > 1 every leaf has a leading (steps,) axis
    num_seqs: int
    want_logprobs: bool
    steps: int = 1
    bucket: int = 0  # the program's token bucket


@dataclass
class StepResult:
    tokens: list[int]  # one per scheduled sequence, in order
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class Runner:
    """Owns the weights and the KV cache on the device and calls the step program."""

    def __init__(
        self,
        step: Callable | Mapping[int, Callable],
        weights,
        kv: KVCache,
        *,
        page_size: int,
        max_num_seqs: int,
        max_pages_per_seq: int,
        buckets: Sequence[int],
        history_len: int = HISTORY_LEN,
        seqs_per_bucket: Mapping[int, int] | None = None,
        decode: Callable | Mapping[int, Callable] | None = None,
        gathers: Mapping[int, Callable] | None = None,
    ):
        self.programs = dict(step) if isinstance(step, Mapping) else {t: step for t in buckets}
        self.buckets = tuple(sorted(self.programs))
        # multi-step decode programs (kiln.models.step.decode_steps) of some buckets: same arguments, a decode batch
        self.decode = dict(decode) if isinstance(decode, Mapping) else {t: decode for t in self.buckets if decode}
        # dispatch_ahead's token gather per decode bucket, compiled ahead of time (an artifact's gather_t<T>); the
        # other buckets jit it (_last_tokens)
        self.gathers = dict(gathers or {})
        self.weights = weights
        self.kv = kv
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.history_len = history_len
        # S of each bucket's program (None: max_num_seqs for all)
        self.seqs_per_bucket = {t: max_num_seqs for t in self.buckets} | dict(seqs_per_bucket or {})
        self.steps_run = 0
        self._idle_rows: dict[tuple[str, int], object] = {}  # (field, S) -> device copy of its neutral rows
        self.startup: dict[str, float] = {}  # seconds of each start-up phase (kiln.serving.llm.startup_report)

    def bucket(self, num_tokens: int) -> int:
        for t in self.buckets:
            if t >= num_tokens:
                return t
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def can_decode_steps(self, num_seqs: int) -> bool:
        """Whether a multi-step decode program takes num_seqs sequences."""
        if not num_seqs or num_seqs > self.buckets[-1]:
            return False
        t = self.bucket(num_seqs)
        return t in self.decode and num_seqs <= self.seqs_per_bucket[t]

    def dispatch(self, sched: SchedulerOutput) -> Pending:
        """Build the padded Batch and SamplingBatch and enqueue the step; does not wait for the device."""
        items = sched.seqs
        t = self.bucket(sched.num_tokens)
        chunks = [SeqChunk(it.seq.tokens[it.start : it.start + it.num_tokens], it.start, it.seq.table.pages)
                  for it in items]  # fmt: skip
        num_seqs = self.seqs_per_bucket[t]
        batch = make_batch(chunks, self.page_size, t, num_seqs, self.max_pages_per_seq)
        sampling = self.sampling_batch(items, num_seqs)
        program = self.decode[t] if sched.steps > 1 else self.programs[t]
        out, self.kv = program(self.weights, self.kv, batch, sampling)
        self.steps_run += 1
        want = any(it.samples and it.seq.params.logprobs is not None for it in items)
        return Pending(out=out, num_seqs=len(items), want_logprobs=want, steps=sched.steps, bucket=t)

    @property
    def can_run_ahead(self) -> bool:
        """Whether dispatch_ahead works here: one process (kiln.serving.multihost's leader sends the batch to the
        followers as numpy) and the cache on one device."""
        return jax.process_count() == 1 and len(self.kv.k[0].sharding.device_set) == 1

    def dispatch_ahead(self, sched: SchedulerOutput, prev: Pending, rows: Sequence[int]) -> Pending:
        """Enqueue the multi-step decode that continues `prev`, a multi-step decode still in flight, without waiting
        for it: sequence i's input token is the last token prev samples in row rows[i], read on the device. sched's
        items start where prev's end (start = prev's start + prev.steps); their tokens are not known yet. It runs in
        prev's bucket (sched has prev's sequences or fewer), so the token gather has one shape per bucket, compiled
        at warmup."""
        t = prev.bucket
        num_seqs = self.seqs_per_bucket[t]
        chunks = [SeqChunk([0], it.start, it.seq.table.pages) for it in sched.seqs]
        batch = make_batch(chunks, self.page_size, t, num_seqs, self.max_pages_per_seq)
        index = np.full(t, -1, np.int32)
        index[: len(rows)] = rows
        batch.token_ids = self.gathers.get(t, _last_tokens)(prev.out.tokens, index)
        sampling = self.sampling_batch(sched.seqs, num_seqs)
        out, self.kv = self.decode[t](self.weights, self.kv, batch, sampling)
        self.steps_run += 1
        want = any(it.seq.params.logprobs is not None for it in sched.seqs)
        return Pending(out=out, num_seqs=len(sched.seqs), want_logprobs=want, steps=sched.steps, bucket=t)

    def sampling_batch(self, items, num_seqs: int) -> SamplingBatch:
        """The step's sampling rows (numpy): each item's options, its penalty history and blocked ids, and, for a
        constrained sequence that samples, its structured-output token mask (free rows: all ones)."""
        sb = SamplingBatch.neutral(num_seqs, self.history_len, vocab_size=self.weights.embed.shape[0])
        guided = [(it.seq.guide, s) for s, it in enumerate(items) if it.seq.guide is not None and it.samples]
        fill_masks(guided, sb.allowed)
        penalized = False
        for s, it in enumerate(items):
            seq, p = it.seq, it.seq.params
            sb.temperature[s] = p.temperature
            sb.top_k[s] = p.top_k
            sb.top_p[s] = p.top_p
            sb.min_p[s] = p.min_p
            sb.repetition_penalty[s] = p.repetition_penalty
            sb.presence_penalty[s] = p.presence_penalty
            sb.frequency_penalty[s] = p.frequency_penalty
            sb.seeds[s] = seq.seed
            sb.want_top[s] = bool(p.logprobs)
            if p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty:
                known = it.start + it.num_tokens
                lo = max(0, known - self.history_len)
                hist = seq.tokens[lo:known]
                sb.history[s, : len(hist)] = hist
                sb.history_prompt[s] = max(0, seq.num_prompt - lo)
                penalized = True
            if seq.num_output < p.min_tokens:
                blocked = seq.stop_ids[:MAX_BLOCKED]
                sb.blocked[s, : len(blocked)] = blocked
        # the two large fields, (S, HISTORY_LEN) and (S, V/32) int32 (5 MB at S = 256), stay on the device while no row
        # uses them: uploading them every step cost the served c=256 decode ~20% on an H200
        if not guided:
            sb.allowed = self.idle_rows("allowed", sb.allowed)
        if not penalized:
            sb.history = self.idle_rows("history", sb.history)
        return sb

    def idle_rows(self, field: str, rows: np.ndarray):
        """What the step gets for a sampling field no row uses: the device copy of its neutral rows (made once per S).
        kiln.serving.multihost's leader replaces it (its processes each pass their own)."""
        key = (field, rows.shape[0])
        if key not in self._idle_rows:
            kv = self.kv.k[0].sharding  # the programs' mesh: replicate there (one device: that device)
            where = NamedSharding(kv.mesh, PartitionSpec()) if isinstance(kv, NamedSharding) else kv
            self._idle_rows[key] = jax.device_put(rows, where)
        return self._idle_rows[key]

    def collect(self, pending: Pending) -> list[StepResult]:
        """Wait for the step and read its sampled tokens (and logprobs when a sequence asked for them): one
        StepResult per step it ran."""
        n = pending.num_seqs

        def rows(leaf) -> list:
            a = np.asarray(leaf)
            return (a if pending.steps > 1 else a[None])[:, :n].tolist()

        out = pending.out
        results = [StepResult(tokens=t) for t in rows(out.tokens)]
        if pending.want_logprobs:
            columns = rows(out.logprobs), rows(out.top_ids), rows(out.top_logprobs)
            for res, lp, ids, top in zip(results, *columns, strict=True):
                res.logprobs, res.top_ids, res.top_logprobs = lp, ids, top
        return results

    def install(self, t: int, program, decode: bool) -> None:
        """Take a program that loaded after the runner was built (a deferred CPU start): bucket t's decode program if
        `decode`, else its step program."""
        if decode:
            self.decode[t] = program
        else:
            self.programs[t] = program
            self.buckets = tuple(sorted(self.programs))

    def warm_gather(self, t: int, tokens: jax.Array) -> jax.Array | None:
        """Compile dispatch_ahead's token gather for decode bucket t (one compilation per bucket; an artifact's
        compiled gather is run once): tokens are that bucket's decode program's sampled tokens (steps, S), or, for a
        program not loaded yet (a deferred CPU start, kiln.serving.llm.prime_run_ahead), an array of their shape, dtype
        and sharding, so that nothing compiles when the program comes in. Returns the gathered token ids (None where
        nothing runs ahead)."""
        return gather_padding(t, tokens, self.gathers.get(t, _last_tokens)) if self.can_run_ahead else None

    def warmup(self) -> None:
        """Run every program once, so that nothing compiles or initialises later: on a batch whose one live sequence
        has a page of keys cached before the step, so that the attention's loop over cached pages runs too (an
        all-padding batch skips it, and its first run, building XLA:CPU's YNN runtimes, then cost the first
        request ~0.12 s). The rest is padding. Junk K/V lands in the first pages, which no sequence owns yet (a page
        is written before anything reads it)."""
        start = self.page_size  # keys of the cached page
        for t in self.buckets:
            num_seqs = self.seqs_per_bucket[t]
            sampling = self.sampling_batch([], num_seqs)
            for program, num_tokens in ((self.programs[t], t), (self.decode.get(t), 1)):
                if program is None:
                    continue
                end = start + num_tokens + 16  # room for a multi-step decode's further tokens
                pages = list(range(-(-end // self.page_size)))
                chunks = [SeqChunk([0] * num_tokens, start, pages)] if len(pages) <= self.max_pages_per_seq else []
                batch = make_batch(chunks, self.page_size, t, num_seqs, self.max_pages_per_seq)
                out, self.kv = program(self.weights, self.kv, batch, sampling)
                np.asarray(out.tokens)
                if program is self.decode.get(t):
                    ids = self.warm_gather(t, out.tokens)
                    if ids is not None and hasattr(program, "lower"):  # jitted: its cache keys on where the token
                        # ids live, and dispatch_ahead's are on the device (an AOT program takes either)
                        batch.token_ids = ids
                        out, self.kv = program(self.weights, self.kv, batch, sampling)
                        np.asarray(out.tokens)
