"""BlockManager: allocation, prefix-cache hits and their counters, LRU eviction, and its invariants under random
workloads (hypothesis)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.serving.block_manager import BlockManager

PS = 4


def test_allocate_grow_free_counts_pages():
    bm = BlockManager(num_pages=10, page_size=PS)
    t = bm.allocate(list(range(10)), max_new_tokens=6)  # covers 6 tokens: 2 pages
    assert len(t.pages) == 2 and bm.num_free == 8
    assert bm.grow(t, 9) and len(t.pages) == 3
    assert bm.grow(t, 12) and len(t.pages) == 3  # still fits
    assert not bm.grow(t, 100) and len(t.pages) == 3  # too big: nothing changes
    bm.check([t])
    bm.free(t)
    assert bm.num_free == 10 and bm.num_cached == 0 and bm.usage == 0.0
    bm.check([])


def test_prefix_hits_are_full_pages_of_the_same_prefix_and_never_the_last_token():
    bm = BlockManager(num_pages=16, page_size=PS)
    a_tokens = list(range(100, 111))  # 11 tokens: 2 full pages + 3
    a = bm.allocate(a_tokens, max_new_tokens=11)
    bm.commit(a, a_tokens, 11)
    assert bm.num_cached == 2 and bm.hit_tokens == 0
    # the same 8-token prefix, then something else: both full pages are hit
    b = bm.allocate(a_tokens[:8] + [1, 2, 3], max_new_tokens=100)
    assert b.pages[:2] == a.pages[:2] and len(b.hashes) == 2 and bm.hit_tokens == 8
    assert bm.ref_count[a.pages[0]] == 2
    # exactly the first page's tokens plus the second page: the last token must be computed, so 1 page hits
    c = bm.allocate(a_tokens[:8], max_new_tokens=100)
    assert len(c.hashes) == 1 and c.pages[0] == a.pages[0] and c.pages[1] != a.pages[1]
    # same second page tokens under another first page: the chained hash misses
    d = bm.allocate([0, 0, 0, 0] + a_tokens[4:8] + [5], max_new_tokens=100)
    assert len(d.hashes) == 0
    assert bm.query_tokens == 11 + 11 + 8 + 9 and bm.hit_tokens == 8 + 4
    bm.check([a, b, c, d])
    for t in (a, b, c, d):
        bm.free(t)
    assert bm.num_free == 16
    bm.check([])


def test_freed_cached_pages_are_reused_then_evicted_least_recently_used_first():
    bm = BlockManager(num_pages=4, page_size=PS)
    seqs = [[i] * 5 for i in range(2)]  # each: one full page + 1
    tables = []
    for toks in seqs:
        t = bm.allocate(toks, 5)
        bm.commit(t, toks, 5)
        tables.append(t)
    first_pages = [t.pages[0] for t in tables]
    for t in tables:
        bm.free(t)
    assert bm.num_cached == 2 and bm.num_free == 4
    # a revived page leaves the evictable pool
    t = bm.allocate(seqs[1], 5)
    assert t.pages[0] == first_pages[1] and bm.hit_tokens == 4
    bm.free(t)  # now seq 1's page is the most recently used
    # 4 fresh pages needed: the 2 plain free pages first, then evictions oldest first (seq 0's page, then seq 1's)
    big = bm.allocate(list(range(50, 66)), 16)
    assert big is not None and bm.evictions == 2 and bm.num_cached == 0
    assert bm.allocate([7] * 5, 5) is None  # full
    bm.check([big])


def test_a_hit_on_an_evictable_page_counts_against_free_pages():
    bm = BlockManager(num_pages=3, page_size=PS)
    toks = [9] * 9
    t = bm.allocate(toks, 9)  # 3 pages
    bm.commit(t, toks, 9)
    bm.free(t)
    # 2 cached pages + 1 free; the same prompt hits 2 pages (reviving them) and needs 1 more: fits exactly
    again = bm.allocate(toks, 9)
    assert again is not None and len(again.hashes) == 2 and bm.num_free == 0
    bm.check([again])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_pages=st.integers(4, 24), caching=st.booleans())
def test_random_workload_keeps_invariants_and_leaks_nothing(seed, num_pages, caching):
    rng = random.Random(seed)
    bm = BlockManager(num_pages=num_pages, page_size=PS, enable_prefix_caching=caching)
    live = {}  # id -> (table, tokens, covered)
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]  # shared prefixes make hits likely
    for step in range(80):
        op = rng.random()
        if op < 0.4:
            toks = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(5) for _ in range(rng.randrange(6))]
            if not toks:
                continue
            t = bm.allocate(toks, rng.randrange(1, 10))
            if t is not None:
                covered = min(len(toks), max(len(t.pages) * PS, 1))
                live[step] = (t, toks, min(covered, len(toks)))
        elif op < 0.7 and live:
            key = rng.choice(list(live))
            t, toks, covered = live[key]
            toks.extend(rng.randrange(5) for _ in range(rng.randrange(1, 6)))
            if bm.grow(t, len(toks)):
                bm.commit(t, toks, len(toks))
                live[key] = (t, toks, len(toks))
        elif live:
            t, _, _ = live.pop(rng.choice(list(live)))
            bm.free(t)
        bm.check([t for t, _, _ in live.values()])
        held = {p for t, _, _ in live.values() for p in t.pages}
        assert bm.num_free + len(held) == num_pages
    for t, _, _ in live.values():
        bm.free(t)
    bm.check([])
    assert bm.num_free == num_pages and all(c == 0 for c in bm.ref_count)
    assert bm.num_cached == len(bm.evictable)
    assert 0 <= bm.hit_tokens <= bm.query_tokens
