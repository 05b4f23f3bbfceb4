"""Scheduler: continuous batching over the paged KV cache (vLLM v1's policy, nano-vllm's size).

Every step has one token budget (max_num_batched_tokens). Running sequences that decode (one token each) are served
first, then running sequences still in their prompt (a chunk each), then waiting sequences are admitted, oldest
first, while the budget, max_num_seqs and the page pool allow. A long prompt is split over several steps (chunked
prefill). When a running sequence needs a page and none is left, the youngest running sequence is preempted: its
pages are freed (its full pages stay in the prefix cache) and it goes back to the head of the queue, to be
recomputed from its tokens (prompt and output so far) later, which leaves its output unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.serving.block_manager import BlockManager, PageTable
from kiln.serving.params import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
FILL = 0.6  # a step that would fill less of its bucket than this is cut to the bucket below (Scheduler._budget)


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it: its tokens (prompt then output) and how many have KV in the cache."""

    request_id: str
    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    seed: int
    arrival: int
    status: str = WAITING
    num_computed: int = 0  # tokens whose KV is written (or being written by the step in flight)
    num_cached: int = 0  # prompt tokens served by the prefix cache at first admission
    table: PageTable | None = None
    finish_reason: str | None = None
    admitted_once: bool = False
    stop_ids: tuple[int, ...] = ()  # token ids that end it: stop_token_ids, and EOS unless ignore_eos
    guide: object | None = None  # structured outputs: the request's kiln.serving.structured.Guide (the engine's)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # KV length before this step
    num_tokens: int  # tokens computed in this step: tokens[start:start + num_tokens]
    samples: bool  # the chunk ends at the last known token, so the sampled token is kept


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    steps: int = 1  # > 1: a multi-step decode (every item one decode token; each step's token feeds the next)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    """Owns the BlockManager and the waiting/running queues.

    schedule() -> SchedulerOutput picks this step's work; update(out, tokens) records the sampled tokens (one per
    scheduled sequence) after the step ran, finishing sequences on EOS / stop token ids / max_tokens / the context
    length; finish(seq, reason) ends a sequence at any moment (Engine.abort uses it) and frees its pages.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        buckets: tuple[int, ...] = (),
    ):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.buckets = tuple(sorted(buckets))  # the runner's token buckets: a step is padded to one of them
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the youngest
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def add(self, seq: Sequence) -> None:
        p = seq.params
        seq.stop_ids = tuple(dict.fromkeys([*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]))
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        decodes = [s for s in self.running if len(s.tokens) - s.num_computed == 1]
        prefills = [s for s in self.running if len(s.tokens) - s.num_computed > 1]
        budget = self._budget(len(decodes), sum(len(s.tokens) - s.num_computed for s in self.running + [*self.waiting]))
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status != RUNNING:  # preempted while making room for an older sequence
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            while not self.bm.grow(seq.table, seq.num_computed + n):
                victim = self.running[-1]
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != RUNNING:
                continue
            out.seqs.append(self._take(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            table = self.bm.allocate(seq.tokens, budget)
            if table is None:
                break
            self.waiting.popleft()
            seq.table = table
            seq.num_computed = len(table.hashes) * self.bm.page_size
            if not seq.admitted_once:
                seq.num_cached = seq.num_computed
                seq.admitted_once = True
                self.prompt_tokens_total += seq.num_prompt
            seq.status = RUNNING
            self.running.append(seq)
            n = min(len(seq.tokens) - seq.num_computed, budget)
            out.seqs.append(self._take(seq, n))
            budget -= n
        return out

    def _budget(self, num_decodes: int, wanted: int) -> int:
        """This step's token budget. Without buckets, max_num_batched_tokens. With them, a step that would fill less
        than FILL of the bucket it lands in is cut to the largest bucket below (its prompt chunks finish in later
        steps): padded rows cost as much as real ones, so 129 prompt tokens run as 64 + 64 + 1 rather than in a
        256-token bucket. Decodes are never cut."""
        budget = self.max_num_batched_tokens
        if not self.buckets or wanted >= budget:
            return budget
        ceil = next(b for b in self.buckets if b >= wanted)
        below = [b for b in self.buckets if b < wanted]
        if wanted >= FILL * ceil or not below:
            return budget
        floor_decodes = next((b for b in self.buckets if b >= num_decodes), budget)
        return min(budget, max(below[-1], floor_decodes))

    def schedule_decodes(self, num_steps: int) -> SchedulerOutput | None:
        """num_steps decode steps of every running sequence at once, or None when that is not the right step now:
        a waiting request could be admitted (max_num_seqs not reached) or a sequence is still in its prompt, a
        sequence is under min_tokens (its blocked tokens change on the way), would pass the context length, or its
        pages for num_steps more tokens do not exist, or every sequence stops after one more token (max_tokens)."""
        running = self.running
        if not running or (self.waiting and len(running) < self.max_num_seqs):
            return None
        for seq in running:
            if len(seq.tokens) - seq.num_computed != 1 or seq.num_output < seq.params.min_tokens:
                return None
            if len(seq.tokens) - 1 + num_steps > self.max_model_len:
                return None
        if all(s.params.max_tokens is not None and s.params.max_tokens - s.num_output <= 1 for s in running):
            return None  # every sequence stops after its next token: the other num_steps - 1 would be thrown away
        new = sum(self.bm.pages_needed(s.num_computed + num_steps) - len(s.table.pages) for s in running)
        if new > self.bm.num_free:
            return None
        for seq in running:
            self.bm.grow(seq.table, seq.num_computed + num_steps)
        return SchedulerOutput(seqs=[self._take(seq, 1) for seq in running], steps=num_steps)

    def _take(self, seq: Sequence, n: int) -> ScheduledSeq:
        item = ScheduledSeq(seq, seq.num_computed, n, samples=seq.num_computed + n == len(seq.tokens))
        seq.num_computed += n
        return item

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free a running sequence and queue it for recomputation. Returns the tokens it gave back to the budget
        (it may already be in this step's batch, which it leaves)."""
        returned = 0
        for i, item in enumerate(out.seqs):
            if item.seq is seq:
                returned = item.num_tokens
                del out.seqs[i]
                break
        self.running.remove(seq)
        self.bm.free(seq.table)
        seq.table = None
        seq.num_computed = 0
        seq.status = WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq.request_id)
        return returned

    # ---- after the step -------------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, tokens: list[int]) -> list[tuple[int, Sequence, int]]:
        """Record the step's sampled tokens (tokens[i] belongs to out.seqs[i]). Returns (i, sequence, token) for
        each token appended to a live sequence; those sequences may have finished here."""
        appended = []
        for i, (item, token) in enumerate(zip(out.seqs, tokens, strict=False)):
            seq = item.seq
            if seq.status != RUNNING:  # finished or aborted while the step was in flight
                continue
            self.bm.commit(seq.table, seq.tokens, seq.num_computed)
            if not item.samples:
                continue
            seq.tokens.append(token)
            self.generation_tokens_total += 1
            appended.append((i, seq, token))
            reason = self._stop_reason(seq, token)
            if reason:
                self.finish(seq, reason)
        return appended

    def advance(self, out: SchedulerOutput) -> None:
        """Between two steps of a multi-step decode: update() recorded step j's tokens, and step j + 1 wrote their
        KV. (A sequence that finished at step j is no longer running; its later tokens are dropped by update().)"""
        for item in out.seqs:
            if item.seq.status == RUNNING:
                item.seq.num_computed += 1

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output > p.min_tokens and token in seq.stop_ids:
            return "stop"
        if (p.max_tokens is not None and seq.num_output >= p.max_tokens) or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (stop condition or abort) and free its pages."""
        if seq.status == FINISHED:
            return
        if seq.status == RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.table is not None:
            self.bm.free(seq.table)
            seq.table = None
        seq.status = FINISHED
        seq.finish_reason = reason

    def tables(self) -> list[PageTable]:
        """The live page tables (for invariant checks)."""
        return [s.table for s in self.running if s.table is not None]
