"""Engine: requests in, incremental outputs out. One step is schedule -> run -> update.

    Engine.add_request(request_id, prompt_token_ids, params)
    Engine.abort(request_id)
    Engine.step() -> list[RequestOutput]
    Engine.stats() -> EngineStats

Not thread-safe: one thread drives it (AsyncLLM's engine thread, or LLM.generate's loop).

A call first waits for the tokens of the step the last call dispatched (N - 1) and records them, then enqueues the
device work for step N, then, while the device computes, does the host work for N - 1's tokens (detokenization, stop
strings, building the outputs) and returns those outputs without waiting for step N. Outputs of a step are therefore
returned by the next call, as soon as its tokens exist. A stop string found this way ends its sequence one step late;
the token of that extra step is dropped, so outputs are unaffected.

With decode_steps = K > 1, a step in which every running sequence decodes and nothing waits runs K decode steps in one
dispatch (Scheduler.schedule_decodes, kiln.models.step.decode_steps); its K tokens per sequence are recorded one
step at a time, so EOS, max_tokens and stop strings end a sequence where single steps would (later tokens are
dropped), and each request gets one output per engine step (_coalesce). Such a step also dispatches the next one
before reading its own tokens (_run_ahead: the next program's input tokens are read on the device), so the device
runs decode programs back to back while the host records tokens; the next step takes that program instead of
scheduling. A request that arrives meanwhile waits for it (one program of K tokens at most).

While prompts are being computed (prefill_ahead, the default), a call that dispatches a single step with prompt work
left behind it (a prompt piece to continue, or a waiting request that could be admitted) also schedules and
dispatches the step after it at once (_queue_next), so the device starts it as soon as the first ends, instead of
idling while the host reads and records the first one's tokens and schedules (~6 ms of a ~56 ms 2048-token step on an
H200). Each later call records the step in flight while the queued one runs, then queues the next, until no prompt
work is left. Nothing is computed on a guess: Scheduler.schedule runs as it is, and a sequence that samples in the
step in flight has no known token to compute, so it sits the queued step out (a running decode rides every other
step while prompts are queued). A step is queued only while the free pages could hold a whole step, so that
scheduling it preempts nothing; not with a structured-output sequence running, nor across processes. Recording a
step registers in the prefix cache the full pages its sequences have computed, the queued step's included: a later
step that hits them is dispatched after it, and one device runs steps in order. Outputs are those of unqueued steps
(tests/test_engine.py compares them). On an H200 (Llama-3-8B shape, 64 requests of 1024 in / 256 out) it took the
run from 3.66 to 3.45 s through the engine and 4,170 to 4,377 served output tok/s (medians; BENCHMARKS.md, issue 16).

Structured outputs (SamplingParams.structured_outputs): add_request compiles the constraint into a Guide
(kiln.serving.structured, llguidance); the runner fills the constrained rows of the step's token bitmask from their
guides, each sampled token advances its guide, and a request ends ("stop") as soon as its grammar is complete. While a
constrained sequence runs, steps are single steps (a mask holds for one token only).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import jax

from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.sampling import MAX_LOGPROBS
from kiln.serving.params import RequestOutput, SamplingParams, TokenLogprob
from kiln.serving.runner import Pending, Runner
from kiln.serving.scheduler import FINISHED, RUNNING, ScheduledSeq, Scheduler, SchedulerOutput, Sequence
from kiln.serving.structured import Guides


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV pages held by requests (0..1)
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens served from it
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


@dataclass(eq=False)
class _Request:
    seq: Sequence
    detok: object | None  # the tokenizer's IncrementalDetokenizer
    text: str = ""  # the output text decoded so far (cut at a stop string)
    emitted: int = 0  # characters of text already returned
    hold: int = 0  # characters held back while they might start a stop string
    done: bool = False


class Engine:
    """Continuous-batching engine over one Runner (a model on a device) and one Scheduler."""

    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        *,
        cfg: ModelConfig,
        tokenizer=None,
        model_name: str = "model",
        decode_steps: int = 1,
        prefill_ahead: bool = True,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.decode_steps = decode_steps  # > 1: decode-only steps run that many tokens per dispatch
        self.max_model_len = scheduler.max_model_len
        self._requests: dict[str, _Request] = {}
        self._deferred: list[tuple[Sequence, int, int, TokenLogprob | None]] = []  # (seq, its length, token, lp)
        self._inflight: tuple[SchedulerOutput, Pending] | None = None  # the step the last call dispatched
        self._ahead: tuple[SchedulerOutput, Pending] | None = None  # a decode dispatched before its inputs were read
        # the single step dispatched behind _inflight while prompts are computed (module docstring; _queue_next)
        self._queued: tuple[SchedulerOutput, Pending] | None = None
        self.prefill_ahead = prefill_ahead  # queue the next step while one with prompt work behind it runs
        self._aborted: list[RequestOutput] = []
        self._arrivals = 0
        self._rng = random.Random()
        self._guides: Guides | None = None  # built at the first structured request (~0.5 s)

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request. Raises KilnError (one sentence) for input the engine cannot serve."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise KilnError(f"A request with id {request_id!r} is already running.")
        prompt = [int(t) for t in prompt_token_ids]
        self.check_prompt(prompt)
        self.check_params(params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        seq = Sequence(request_id, list(prompt), len(prompt), params, seed % 2**32, self._arrivals)
        if params.structured_outputs is not None:
            seq.guide = self.guides().guide(params.structured_outputs)
        self._arrivals += 1
        detok = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        req = _Request(seq, detok, hold=max((len(s) for s in params.stop), default=1) - 1)
        self._requests[request_id] = req
        self.scheduler.add(seq)

    def guides(self) -> Guides:
        """The compiler of structured-output constraints for this model's tokenizer (KilnError without one)."""
        if self._guides is None:
            if self.tokenizer is None:
                raise KilnError("Structured outputs need the model's tokenizer.")
            self._guides = Guides(self.tokenizer, self.cfg.vocab_size)
        return self._guides

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise KilnError("The prompt is empty; give at least one token.")
        if len(prompt) >= self.max_model_len:
            raise KilnError(
                f"The prompt has {len(prompt)} tokens but this model's context is {self.max_model_len} tokens; "
                "shorten it so at least one token can be generated."
            )
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise KilnError(f"Token id {bad[0]} is outside the vocabulary (0..{self.cfg.vocab_size - 1}).")

    def check_params(self, p: SamplingParams) -> None:
        """Raise KilnError for an impossible parameter (max_tokens None means: up to the context length)."""
        if isinstance(p.stop, str):
            p.stop = [p.stop]
        checks = [
            (p.max_tokens is None or p.max_tokens >= 1, "max_tokens must be at least 1"),
            (0 <= p.min_tokens <= (p.max_tokens or p.min_tokens), "min_tokens must be between 0 and max_tokens"),
            (p.temperature >= 0, "temperature must be non-negative"),
            (0 < p.top_p <= 1, "top_p must be in (0, 1]"),
            (p.top_k >= 0 or p.top_k == -1, "top_k must be 0 or -1 (off) or positive"),
            (0 <= p.min_p <= 1, "min_p must be in [0, 1]"),
            (p.repetition_penalty > 0, "repetition_penalty must be positive"),
            (-2 <= p.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= p.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, f"logprobs must be in 0..{MAX_LOGPROBS}"),
            (not p.stop or self.tokenizer is not None, "stop strings need a tokenizer"),
            (all(p.stop), "stop strings must not be empty"),
            (all(0 <= t < self.cfg.vocab_size for t in p.stop_token_ids), "stop_token_ids must be in the vocabulary"),
        ]
        for ok, message in checks:
            if not ok:
                raise KilnError(message + ".")
        if p.top_k == -1:
            p.top_k = 0

    def abort(self, request_id: str) -> None:
        """End a request now, freeing its pages; its final output (finish_reason "abort") comes with the next step.
        Unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        req.done = True
        self.scheduler.finish(req.seq, "abort")
        self._aborted.append(self._output(req, [], "", None, finished=True, reason="abort"))

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._aborted)

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the outputs that became ready (see the module docstring)."""
        outputs, self._aborted = self._aborted, []
        if self._inflight is not None:  # the step the last call dispatched: wait for its tokens and record them
            (done, waited), self._inflight = self._inflight, None
            self._record(done, waited)
        if self._queued is not None:  # dispatched behind the step just recorded: it runs now, the next is queued
            self._inflight, self._queued = self._queued, None
        else:
            self._dispatch_next()
        inflight = self._inflight
        if self.prefill_ahead and inflight is not None and inflight[0].steps == 1 and self._ahead is None:
            self._queued = self._queue_next()
        outputs += self._postprocess()  # the tokens recorded above, while the device works on this step
        return _coalesce(outputs)

    def _dispatch_next(self) -> None:
        """Dispatch this call's step (nothing is in flight): the decode run ahead during the last call, or the
        scheduler's next step (a multi-step decode where it can)."""
        sched = pending = None
        if self._ahead is not None:  # dispatched during the last step; its sequences' last tokens are recorded now
            (sched, pending), self._ahead = self._ahead, None
            live = [it.seq for it in sched.seqs if it.seq.status == RUNNING]
            for seq in live:  # what Scheduler._take does at scheduling time
                seq.num_computed += 1
            if not live:  # every sequence of it ended meanwhile: nothing to record
                sched = pending = None
        if sched is None:
            running = self.scheduler.running
            if (
                self.decode_steps > 1
                and self.runner.can_decode_steps(len(running))
                and not any(s.guide for s in running)
            ):
                sched = self.scheduler.schedule_decodes(self.decode_steps)
            sched = sched or self.scheduler.schedule()
            pending = self.runner.dispatch(sched) if sched.seqs else None
        if pending is not None:
            self._inflight = (sched, pending)
            if sched.steps > 1:
                self._ahead = self._run_ahead(sched, pending)

    def _queue_next(self) -> tuple[SchedulerOutput, Pending] | None:
        """Schedule and dispatch the step after the single step in flight (see the module docstring), or None: no
        prompt work is left (the multi-step decodes take over once the queue drains), a structured-output sequence
        runs, the steps span processes (kiln.serving.multihost), or the free pages could not hold a whole step
        (Scheduler.schedule would preempt a sequence whose tokens are in flight)."""
        sch = self.scheduler
        admit = sch.waiting and len(sch.running) < sch.max_num_seqs
        if not admit and not any(len(s.tokens) - s.num_computed > 1 for s in sch.running):
            return None
        if any(s.guide for s in sch.running) or jax.process_count() > 1:
            return None
        if sch.bm.num_free < sch.bm.pages_needed(sch.max_num_batched_tokens) + len(sch.running):
            return None
        sched = sch.schedule()
        return (sched, self.runner.dispatch(sched)) if sched.seqs else None

    def _record(self, sched: SchedulerOutput, pending: Pending) -> None:
        """Wait for a dispatched step's tokens and record them in the scheduler (ending sequences there); their
        outputs are made by the next _postprocess."""
        for j, res in enumerate(self.runner.collect(pending)):
            if j:
                self.scheduler.advance(sched)
            for i, seq, token in self.scheduler.update(sched, res.tokens):
                if seq.guide is not None and (not seq.guide.accept(token) or seq.guide.done):
                    self.scheduler.finish(seq, "stop")  # the grammar is complete
                lp = None
                if seq.params.logprobs is not None and res.logprobs is not None:
                    n = seq.params.logprobs
                    top = list(zip(res.top_ids[i][:n], res.top_logprobs[i][:n], strict=True))
                    lp = TokenLogprob(token, res.logprobs[i], top)
                self._deferred.append((seq, len(seq.tokens), token, lp))

    def _run_ahead(self, sched: SchedulerOutput, pending: Pending) -> tuple[SchedulerOutput, Pending] | None:
        """Dispatch the multi-step decode that follows `sched` (in flight) before its tokens are read, as the next
        step would schedule it if every sequence lives on, so the device goes from one decode program to the next
        without waiting for the host. Sequences that sched ends by length are left out; it is not done (None) while
        a waiting request could be admitted, or where a sequence needs what only the host can give per step (a
        structured-output mask, penalties over its history, min_tokens' blocked ids), would pass the context length,
        or its pages do not exist. A sequence that ends otherwise (EOS, a stop string, an abort) while the
        dispatched step runs has its tokens of it dropped, as a multi-step decode drops its steps after the end."""
        sch, k = self.scheduler, sched.steps
        if not self.runner.can_run_ahead or (sch.waiting and len(sch.running) < sch.max_num_seqs):
            return None
        items, rows, pages = [], [], 0
        for i, it in enumerate(sched.seqs):
            seq, p = it.seq, it.seq.params
            if seq.status != RUNNING:
                continue
            if (p.max_tokens is not None and seq.num_output + k >= p.max_tokens) or len(
                seq.tokens
            ) + k >= sch.max_model_len:
                continue  # sched ends it
            penalized = p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty
            if seq.guide is not None or penalized or seq.num_output < p.min_tokens:
                return None
            if len(seq.tokens) + 2 * k - 1 > sch.max_model_len:
                return None
            items.append(ScheduledSeq(seq, it.start + k, 1, samples=True))
            rows.append(i)
            pages += sch.bm.pages_needed(it.start + 2 * k) - len(seq.table.pages)
        if not items or pages > sch.bm.num_free:
            return None
        for it in items:
            sch.bm.grow(it.seq.table, it.start + k)
        ahead = SchedulerOutput(seqs=items, steps=k)
        return ahead, self.runner.dispatch_ahead(ahead, pending, rows)

    def _postprocess(self) -> list[RequestOutput]:
        outputs = []
        items, self._deferred = self._deferred, []
        for seq, length, token, lp in items:
            req = self._requests.get(seq.request_id)
            if req is None or req.done or req.seq is not seq:
                continue
            text = ""
            last = seq.status == FINISHED and length == len(seq.tokens)
            if req.detok is not None:
                text = req.detok.push([token])
                if last:
                    text += req.detok.flush()
            if seq.params.stop and self._find_stop(req, text):
                self.scheduler.finish(seq, "stop")
                seq.finish_reason = "stop"
                del seq.tokens[length:]  # tokens a multi-step decode sampled after this one
            else:
                req.text += text
            finished = seq.status == FINISHED and length == len(seq.tokens)
            end = len(req.text) if finished else max(req.emitted, len(req.text) - req.hold)
            new_text, req.emitted = req.text[req.emitted : end], end
            outputs.append(self._output(req, [token], new_text, lp, finished, seq.finish_reason))
            if finished:
                req.done = True
                del self._requests[seq.request_id]
        return outputs

    def _find_stop(self, req: _Request, text: str) -> bool:
        """Append text; if a stop string now occurs in the output (possibly across tokens), cut the output before
        its earliest occurrence and return True."""
        start = max(0, len(req.text) - req.hold)
        full = req.text + text
        hits = [i for i in (full.find(s, start) for s in req.seq.params.stop) if i >= 0]
        if not hits:
            return False
        req.text = full[: min(hits)]
        return True

    def _output(self, req: _Request, tokens, text, lp, finished: bool, reason: str | None) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=list(tokens),
            new_text=text,
            finished=finished,
            finish_reason=reason if finished else None,
            prompt_tokens=seq.num_prompt,
            completion_tokens=seq.num_output,
            logprobs=[lp] if lp is not None else ([] if seq.params.logprobs is not None else None),
            cached_tokens=seq.num_cached,
        )

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.scheduler.bm
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_usage=bm.usage,
            prefix_cache_queries=bm.query_tokens,
            prefix_cache_hits=bm.hit_tokens,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
        )


def _coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request: a multi-step decode yields several tokens of a request in one step, and one update
    (one server-sent event) carries them all."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        acc = merged.get(out.request_id)
        if acc is None:
            merged[out.request_id] = out
            continue
        acc.new_token_ids = acc.new_token_ids + out.new_token_ids
        acc.new_text += out.new_text
        if out.logprobs is not None:
            acc.logprobs = (acc.logprobs or []) + out.logprobs
        acc.finished, acc.finish_reason = out.finished, out.finish_reason
        acc.completion_tokens, acc.cached_tokens = out.completion_tokens, out.cached_tokens
    return list(merged.values())
