"""BlockManager: the host-side pool of KV pages, with prefix caching.

Plain Python over page ids, unit-testable without a device. A sequence holds its pages through a PageTable handle
that only the manager edits. A page is in exactly one of three states:

* in use: ref_count > 0 (shared by every sequence whose prefix it holds);
* cached: ref_count == 0 but it holds a registered full page of tokens; it can be hit again, or evicted (least
  recently used first) when a free page is needed;
* free: ref_count == 0 and no content worth keeping.

Prefix caching keys a full page by a chained hash: hash((parent page's hash, its page_size token ids)), so a page is
only reused under the same whole prefix. The token ids are kept beside the hash and compared on a hit, so a hash
collision can never serve the wrong KV. Pages are registered when a step is recorded, up to each sequence's computed
tokens: with the engine's prefill_ahead those include the tokens of the step queued behind it, which may still be
writing them; safe, because a step that hits those pages is dispatched after it and one device runs its steps in
order (kiln.serving.engine).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class PageTable:
    """The pages of one sequence, in order, and the chained hashes of its leading full pages registered so far."""

    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes[i] is the hash of pages[i]; len(hashes) <= len(pages)


class BlockManager:
    """A fixed pool of `num_pages` KV pages of `page_size` tokens."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.hash_to_page: dict[int, int] = {}
        self.free_pages: deque[int] = deque(range(num_pages))  # no content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of which served from it
        self.evictions = 0

    # ---- counters -------------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages a new allocation can take now (free plus evictable cached pages)."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def num_cached(self) -> int:
        """Pages holding a registered full page of tokens (in use or evictable)."""
        return len(self.hash_to_page)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences (0..1)."""
        return 1.0 - self.num_free / self.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- allocation -----------------------------------------------------------------------------------------

    def _match(self, token_ids: Sequence[int], max_pages: int) -> tuple[list[int], list[int]]:
        """Pages and hashes of the longest cached full-page prefix of token_ids (at most max_pages pages)."""
        pages, hashes, parent = [], [], None
        if not self.enable_prefix_caching:
            return pages, hashes
        ps = self.page_size
        for i in range(min(max_pages, len(token_ids) // ps)):
            chunk = tuple(token_ids[i * ps : (i + 1) * ps])
            h = hash((parent, chunk))
            page = self.hash_to_page.get(h)
            if page is None or self.page_tokens[page] != chunk:
                break
            pages.append(page)
            hashes.append(h)
            parent = h
        return pages, hashes

    def allocate(self, token_ids: Sequence[int], max_new_tokens: int) -> PageTable | None:
        """A new PageTable for a sequence of token_ids: cached pages for the longest full-page prefix of
        token_ids[:-1] (the last token is always computed, for its logits), then fresh pages for up to
        `max_new_tokens` more tokens. Its cached prefix is len(table.hashes) * page_size tokens.
        Returns None, changing nothing, when the pool lacks pages."""
        max_hit_pages = (len(token_ids) - 1) // self.page_size
        hit_pages, hit_hashes = self._match(token_ids, max_hit_pages)
        cached = len(hit_pages) * self.page_size
        num_tokens = cached + min(len(token_ids) - cached, max_new_tokens)
        reviving = sum(1 for p in hit_pages if self.ref_count[p] == 0)
        new = self.pages_needed(num_tokens) - len(hit_pages)
        if new > self.num_free - reviving:
            return None
        for p in hit_pages:
            self._ref(p)
        table = PageTable(pages=hit_pages, hashes=hit_hashes)
        table.pages.extend(self._take() for _ in range(new))
        self.query_tokens += len(token_ids)
        self.hit_tokens += cached
        return table

    def grow(self, table: PageTable, num_tokens: int) -> bool:
        """Extend the table to cover `num_tokens` tokens. False, changing nothing, when the pool lacks pages."""
        new = self.pages_needed(num_tokens) - len(table.pages)
        if new <= 0:
            return True
        if new > self.num_free:
            return False
        table.pages.extend(self._take() for _ in range(new))
        return True

    def commit(self, table: PageTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the full pages among the first `num_computed` tokens (whose KV is written) for reuse."""
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        parent = table.hashes[-1] if table.hashes else None
        for i in range(len(table.hashes), min(num_computed // ps, len(table.pages))):
            chunk = tuple(token_ids[i * ps : (i + 1) * ps])
            h = hash((parent, chunk))
            page = table.pages[i]
            if h not in self.hash_to_page and self.page_hash[page] is None:
                self.hash_to_page[h] = page
                self.page_hash[page] = h
                self.page_tokens[page] = chunk
            table.hashes.append(h)  # the chain continues even when another page already holds this content
            parent = h

    def free(self, table: PageTable) -> None:
        """Drop the table's references; its registered pages stay cached (most recently used), the rest are free.
        Pages are released last to first so that a prefix's tail is evicted before its head."""
        for page in reversed(table.pages):
            self.ref_count[page] -= 1
            assert self.ref_count[page] >= 0, f"page {page} freed twice"
            if self.ref_count[page] == 0:
                if self.page_hash[page] is not None:
                    self.evictable[page] = None
                else:
                    self.free_pages.append(page)
        table.pages.clear()
        table.hashes.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached page that no sequence holds."""
        while self.evictable:
            self._evict_oldest()

    # ---- internals ------------------------------------------------------------------------------------------

    def _ref(self, page: int) -> None:
        if self.ref_count[page] == 0:
            self.evictable.pop(page, None)
        self.ref_count[page] += 1

    def _take(self) -> int:
        page = self.free_pages.popleft() if self.free_pages else self._evict_oldest()
        self.ref_count[page] = 1
        return page

    def _evict_oldest(self) -> int:
        page, _ = self.evictable.popitem(last=False)
        del self.hash_to_page[self.page_hash[page]]
        self.page_hash[page] = None
        self.page_tokens[page] = None
        self.evictions += 1
        return page

    def check(self, tables: Sequence[PageTable] = ()) -> None:
        """Assert the invariants given every live table (tests): ref counts equal the tables' holdings, every page
        is in exactly one state, the hash index agrees with the pages."""
        held = [0] * self.num_pages
        for t in tables:
            assert len(set(t.pages)) == len(t.pages), "a table holds a page twice"
            for p in t.pages:
                held[p] += 1
        assert held == self.ref_count, "ref counts disagree with the tables"
        shared = [p for p in range(self.num_pages) if held[p] > 1 and self.page_hash[p] is None]
        assert not shared, f"pages {shared} are held twice without being cached prefix pages"
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages), "a page is free twice"
        assert not free & set(self.evictable), "a page is both free and cached"
        for p in range(self.num_pages):
            in_use = self.ref_count[p] > 0
            assert in_use + (p in free) + (p in self.evictable) == 1, f"page {p} is in {in_use + (p in free)} states"
            if p in free:
                assert self.page_hash[p] is None
            if p in self.evictable:
                assert self.page_hash[p] is not None
        assert {h: p for p, h in enumerate(self.page_hash) if h is not None} == self.hash_to_page
