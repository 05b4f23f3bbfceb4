"""Scheduler + BlockManager on the host, against a simulated device: a KV memory of token ids written through the
slot mapping the runner would use, and a 'model' whose next token is a hash of the context it reads back from the
pages. So a wrong page (a bad prefix hit, a page held twice, a lost chunk) changes the output, and every request's
output must equal running it alone, whatever chunking, preemption, caching and aborts happened."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.serving.block_manager import BlockManager
from kiln.serving.params import SamplingParams
from kiln.serving.scheduler import FINISHED, Scheduler, Sequence

PS = 4
VOCAB = 50
EOS = 0


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % (VOCAB - 1) + 1  # never EOS, unless a test asks


class SimDevice:
    def __init__(self, num_pages: int):
        self.mem = np.full((num_pages, PS), -1, np.int64)

    def run(self, out) -> list[int]:
        for item in out.seqs:  # every chunk writes its KV first (as the kernel does), then reads
            pages = item.seq.table.pages
            for pos in range(item.start, item.start + item.num_tokens):
                self.mem[pages[pos // PS], pos % PS] = item.seq.tokens[pos]
        tokens = []
        for item in out.seqs:
            pages = item.seq.table.pages
            n = item.start + item.num_tokens
            tokens.append(next_token([int(self.mem[pages[p // PS], p % PS]) for p in range(n)]))
        return tokens

    def run_steps(self, out) -> list[list[int]]:
        """A multi-step decode: out.steps steps, each item's sampled token the next step's input (as on the
        device, sequences that finish on the way are computed to the end)."""
        rows, inputs = [], [item.seq.tokens[item.start] for item in out.seqs]
        for j in range(out.steps):
            row = []
            for item, token in zip(out.seqs, inputs, strict=True):
                pages, pos = item.seq.table.pages, item.start + j
                self.mem[pages[pos // PS], pos % PS] = token
                row.append(next_token([int(self.mem[pages[p // PS], p % PS]) for p in range(pos + 1)]))
            rows.append(row)
            inputs = row
        return rows


def solo(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt) :]


def make(num_pages, *, seqs=4, budget=16, max_len=64, caching=True, eos=(), buckets=()):
    bm = BlockManager(num_pages, PS, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len, eos_token_ids=eos,
                     buckets=buckets)  # fmt: skip


def seq(i: int, prompt: list[int], **params) -> Sequence:
    return Sequence(f"r{i}", list(prompt), len(prompt), SamplingParams(**params), seed=0, arrival=i)


def drive(sched: Scheduler, dev: SimDevice, on_step=None, max_steps=10_000, decode_steps: int = 1) -> int:
    steps = 0
    while sched.has_work():
        out = (sched.schedule_decodes(decode_steps) if decode_steps > 1 else None) or sched.schedule()
        assert out.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert len({id(i.seq) for i in out.seqs}) == len(out.seqs)
        sched.bm.check(sched.tables())
        if out.steps > 1:
            for j, row in enumerate(dev.run_steps(out)):
                if j:
                    sched.advance(out)
                sched.update(out, row)
        else:
            sched.update(out, dev.run(out))
        sched.bm.check(sched.tables())
        if on_step:
            on_step(steps)
        steps += 1
        assert steps < max_steps
    return steps


def test_decodes_first_then_prefill_chunks_fill_the_budget():
    sched = make(64, budget=8)
    dev = SimDevice(64)
    a, b = seq(0, [1, 2, 3]), seq(1, [4, 5])
    sched.add(a)
    sched.add(b)
    sched.update(out := sched.schedule(), dev.run(out))  # both prefills in one step
    c = seq(2, list(range(1, 21)))  # 20-token prompt
    sched.add(c)
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.seqs] == [("r0", 1), ("r1", 1), ("r2", 6)]
    assert not out.seqs[2].samples  # a middle chunk: its sampled token is dropped
    sched.update(out, dev.run(out))
    assert c.num_output == 0 and c.num_computed == 6
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in out.seqs] == [("r0", 1), ("r1", 1), ("r2", 6)]


def test_a_step_that_would_fill_little_of_its_bucket_is_cut_to_the_bucket_below():
    sched = make(64, seqs=8, budget=64, max_len=256, buckets=(1, 4, 16, 64))
    dev = SimDevice(64)
    sched.add(seq(0, list(range(1, 21)), max_tokens=4))  # 20 prompt tokens: 31% of bucket 64 -> 16 now, 4 next
    out = sched.schedule()
    assert out.num_tokens == 16
    sched.update(out, dev.run(out))
    assert sched.schedule().num_tokens == 4
    sched = make(64, seqs=8, budget=64, max_len=256, buckets=(1, 4, 16, 64))
    for i in range(6):  # 6 decodes and a 30-token prompt: 36 tokens fill 56% of 64 -> cut to 16, decodes kept whole
        sched.add(seq(i, [i + 1], max_tokens=8))
    sched.update(out := sched.schedule(), dev.run(out))
    sched.add(seq(9, list(range(1, 31)), max_tokens=2))
    out = sched.schedule()
    assert out.num_tokens == 16 and sum(i.num_tokens == 1 for i in out.seqs) == 6
    sched.update(out, dev.run(out))
    out = sched.schedule()  # 6 + 20 left: 41% of 64 -> 16 again, then the last 6 + 10 fill 16 exactly
    assert out.num_tokens == 16 and sum(i.num_tokens == 1 for i in out.seqs) == 6
    sched.update(out, dev.run(out))
    assert sched.schedule().num_tokens == 16


def test_admission_waits_for_pages_and_max_num_seqs():
    sched = make(4, seqs=2, budget=64)
    dev = SimDevice(4)
    for i in range(3):
        sched.add(seq(i, [1 + i] * 5, max_tokens=2))  # 5 tokens = 2 pages each
    out = sched.schedule()
    assert [i.seq.request_id for i in out.seqs] == ["r0", "r1"] and len(sched.waiting) == 1
    sched.update(out, dev.run(out))
    out = sched.schedule()  # r2 waits: max_num_seqs, and no free page
    assert [i.seq.request_id for i in out.seqs] == ["r0", "r1"]
    sched.update(out, dev.run(out))
    out = sched.schedule()  # r0 and r1 finished (max_tokens 2): r2 is admitted
    assert [i.seq.request_id for i in out.seqs] == ["r2"] and sched.bm.num_free == 2
    sched.update(out, dev.run(out))
    drive(sched, dev)
    assert sched.bm.num_free == 4


def test_stop_conditions():
    sched = make(64, budget=64, max_len=12, eos=(EOS,))
    dev = SimDevice(64)
    cases = {
        "length": seq(0, [1, 2, 3], max_tokens=4),
        "context": seq(1, [1] * 9, max_tokens=100),  # 9 + 3 = max_model_len 12
        "stop_id": seq(2, [7, 8], max_tokens=50, stop_token_ids=[next_token([7, 8, next_token([7, 8])])]),
        "min_tokens": seq(3, [7, 8], max_tokens=50, min_tokens=2, stop_token_ids=[next_token([7, 8])]),
    }
    for s in cases.values():
        sched.add(s)
    drive(sched, dev)
    assert cases["length"].num_output == 4 and cases["length"].finish_reason == "length"
    assert cases["context"].num_output == 3 and cases["context"].finish_reason == "length"
    assert cases["stop_id"].num_output == 2 and cases["stop_id"].finish_reason == "stop"
    # the stop id came first; within min_tokens it does not stop (on the device it is also blocked)
    mt = cases["min_tokens"]
    assert mt.tokens[2] == next_token([7, 8]) and mt.num_output > 1


def test_eos_stops_unless_ignored():
    first = next_token([3, 4])
    sched = make(64, eos=(first,))
    dev = SimDevice(64)
    a, b = seq(0, [3, 4], max_tokens=5), seq(1, [3, 4], max_tokens=5, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    drive(sched, dev)
    assert a.tokens[2:] == [first] and a.finish_reason == "stop"
    assert b.num_output == 5 and b.finish_reason == "length"


def test_prefix_cache_hits_are_exact_and_pages_are_shared():
    sched = make(64, budget=64)
    dev = SimDevice(64)
    prefix = list(range(1, 14))  # 13 tokens: 3 full pages
    first = seq(0, prefix + [20], max_tokens=3)
    sched.add(first)
    sched.update(out := sched.schedule(), dev.run(out))
    others = [seq(i, prefix + [20 + i, 30], max_tokens=3) for i in range(1, 4)]
    for s in others:
        sched.add(s)
    sched.update(out := sched.schedule(), dev.run(out))
    assert [s.num_cached for s in others] == [12, 12, 12]
    assert sched.bm.hit_tokens == 36 and sched.bm.query_tokens == 14 + 3 * 15
    assert all(s.table.pages[:3] == first.table.pages[:3] for s in others)
    drive(sched, dev)
    for s in [first, *others]:
        assert s.tokens[s.num_prompt :] == solo(s.tokens[: s.num_prompt], 3)


def test_abort_at_any_moment_frees_everything():
    sched = make(16)
    dev = SimDevice(16)
    seqs = [seq(i, list(range(1, 10 + i)), max_tokens=20) for i in range(4)]
    for s in seqs:
        sched.add(s)
    sched.update(out := sched.schedule(), dev.run(out))
    sched.finish(seqs[0], "abort")  # running
    sched.finish(seqs[3], "abort")  # possibly still waiting
    out = sched.schedule()
    before = list(seqs[1].tokens)
    tokens = dev.run(out)  # dispatched
    sched.finish(seqs[1], "abort")  # while in flight
    sched.update(out, tokens)  # its token is dropped
    assert seqs[1].finish_reason == "abort" and seqs[1].tokens == before
    sched.finish(seqs[2], "abort")
    assert not sched.has_work() and sched.bm.num_free == 16
    sched.bm.check([])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1), caching=st.booleans(), bucketed=st.booleans(), decode_steps=st.sampled_from([1, 3])
)
def test_random_workload_outputs_equal_solo_runs(seed, caching, bucketed, decode_steps):
    """Tiny page pool (preemption), small budget (chunked prefill), shared prefixes (cache hits), random aborts; steps
    cut to token buckets, and multi-step decodes."""
    rng = random.Random(seed)
    num_pages = rng.randrange(12, 24)  # a max-length sequence needs 12 pages
    budget = rng.randrange(6, 20)
    buckets = (1, 2, 4, 8, budget) if bucketed and budget > 8 else ()
    sched = make(num_pages, seqs=rng.randrange(2, 6), budget=budget, max_len=48, caching=caching, buckets=buckets)
    dev = SimDevice(num_pages)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(16)] for _ in range(2)]
    seqs = []
    for i in range(rng.randrange(4, 12)):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 17)] + [rng.randrange(1, VOCAB) for _ in range(4)]
        seqs.append(seq(i, prompt, max_tokens=rng.randrange(1, 48 - len(prompt))))
        sched.add(seqs[-1])
    aborted = set()

    def maybe_abort(step):
        if rng.random() < 0.05:
            live = [s for s in seqs if s.status != FINISHED]
            if live:
                victim = rng.choice(live)
                aborted.add(victim.request_id)
                sched.finish(victim, "abort")

    drive(sched, dev, maybe_abort, decode_steps=decode_steps)
    for s in seqs:
        if s.request_id not in aborted:
            assert s.tokens[s.num_prompt :] == solo(s.tokens[: s.num_prompt], s.params.max_tokens)
    assert sched.bm.num_free == num_pages and all(c == 0 for c in sched.bm.ref_count)
    sched.bm.check([])


def test_forced_preemption_recomputes_with_unchanged_output():
    sched = make(12, seqs=4, budget=32, max_len=48)  # 4 sequences growing to 40 tokens need 40 pages
    dev = SimDevice(12)
    seqs = [seq(i, [i + 1] * 8, max_tokens=32) for i in range(4)]
    for s in seqs:
        sched.add(s)
    drive(sched, dev)
    assert sched.num_preemptions > 0
    for s in seqs:
        assert s.tokens[8:] == solo([s.tokens[0]] * 8, 32)
    assert sched.bm.num_free == 12


def test_multi_step_decodes_wait_for_nothing_that_could_be_admitted():
    sched = make(64, seqs=2, budget=16, max_len=64)
    dev = SimDevice(64)
    a, b, c = seq(0, [1, 2, 3], max_tokens=20), seq(1, [4, 5], max_tokens=20), seq(2, [6, 7], max_tokens=20)
    sched.add(a)
    sched.update(out := sched.schedule(), dev.run(out))
    sched.add(b)
    assert sched.schedule_decodes(4) is None  # b could be admitted now
    sched.update(out := sched.schedule(), dev.run(out))
    sched.add(c)  # max_num_seqs reached: c cannot be admitted before a or b ends, so decoding 4 at once delays nothing
    out = sched.schedule_decodes(4)
    assert out is not None and out.steps == 4 and [i.seq for i in out.seqs] == [a, b]
    for j, row in enumerate(dev.run_steps(out)):
        if j:
            sched.advance(out)
        sched.update(out, row)
    drive(sched, dev, decode_steps=4)
    for s in (a, b, c):
        assert s.tokens[s.num_prompt :] == solo(s.tokens[: s.num_prompt], 20)


def test_no_multi_step_decode_when_every_sequence_stops_after_one_token():
    """A multi-step decode for sequences that all stop at their next token (max_tokens) would throw away the other
    steps' tokens: one step runs instead (a one-token completion whose prompt ended in a one-token chunk ran a 4-step
    decode_t1 on the CPU)."""
    for max_tokens, multi in ((2, False), (3, True)):
        sched = make(64, seqs=2, budget=16, max_len=64)
        dev = SimDevice(64)
        a, b = seq(0, [1, 2, 3], max_tokens=2), seq(1, [4, 5], max_tokens=max_tokens)
        sched.add(a)
        sched.add(b)
        sched.update(out := sched.schedule(), dev.run(out))  # both prompts, one output token each
        out = sched.schedule_decodes(4)
        assert (out is not None) == multi  # a wants one more token, b one (2) or two (3)
        if out is not None:
            for j, row in enumerate(dev.run_steps(out)):
                if j:
                    sched.advance(out)
                sched.update(out, row)
        drive(sched, dev, decode_steps=4)
        for s, n in ((a, 2), (b, max_tokens)):
            assert s.tokens[s.num_prompt :] == solo(s.tokens[: s.num_prompt], n)
