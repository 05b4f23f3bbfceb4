"""Structured outputs through llguidance: a constraint (JSON schema, regex, choice, Lark/GBNF grammar) becomes a
per-request matcher over the model's tokenizer, and each step the matchers of the constrained rows fill their rows of
the token bitmask that the step program applies before sampling (kiln.models.sampling, SamplingBatch.allowed).

    guides = Guides(tokenizer, vocab_size)     # once per engine (building llguidance's tokenizer takes ~0.5 s)
    guide = guides.guide(StructuredOutputsParams(json=schema))   # KilnError with llguidance's reason if invalid
    fill_masks([(guide, row), ...], bitmask)   # before a step: rows (S, mask_words(V)) int32, -1 = free
    guide.accept(token)                        # after it; guide.done once the grammar is complete

The masks are computed on the host in llguidance's thread pool (it releases the GIL), ~20-100 us a row.
"""

from __future__ import annotations

import json
import logging

import llguidance
import llguidance.numpy
import numpy as np

from kiln.models.errors import KilnError
from kiln.serving.params import StructuredOutputsParams

log = logging.getLogger("kiln.structured")


class Guide:
    """One request's matcher: which tokens may come next, advanced by the tokens the request samples."""

    def __init__(self, matcher: llguidance.LLMatcher, executor: llguidance.LLExecutor):
        self.matcher = matcher
        self.executor = executor

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it (then the guide is done)."""
        ok = self.matcher.consume_token(int(token))
        if not ok:
            log.warning("structured output: token %d rejected (%s)", token, _first_line(self.matcher.get_error())[:200])
        return ok

    @property
    def done(self) -> bool:
        """The grammar is complete (only EOS could follow) or in error: the request should stop."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def allowed(self, vocab_size: int) -> np.ndarray:
        """The next token's mask as bools (vocab_size,) (tests and debugging)."""
        words = np.full((1, (vocab_size + 31) // 32), -1, np.int32)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, words, 0)
        return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def fill_masks(rows: list[tuple[Guide, int]], bitmask: np.ndarray) -> None:
    """Write each guide's next-token mask into its row of bitmask (S, mask_words(V)) int32, in parallel."""
    if rows:
        pairs = [(g.matcher, row) for g, row in rows]
        llguidance.numpy.fill_next_token_bitmask_par(rows[0][0].executor, pairs, bitmask)


class Guides:
    """Compiles constraints against one tokenizer (kiln.serving.tokenizer.Tokenizer) into Guides."""

    def __init__(self, tokenizer, vocab_size: int, threads: int | None = None):
        eos = list(tokenizer.eos_token_ids) or None
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        except ValueError as e:  # e.g. a tokenizer without a decoder: llguidance cannot map tokens to bytes
            raise KilnError(f"This model's tokenizer does not support structured outputs: {_first_line(e)}.") from None
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(threads)

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The llguidance grammar of a constraint; KilnError (one sentence, llguidance's reason) if it is invalid."""
        kinds = spec.kinds()
        if len(kinds) != 1:
            raise KilnError(f"Give exactly one structured-output constraint (json, regex, choice, grammar or "
                            f"json_object), not {len(kinds)}.")  # fmt: skip
        try:
            grammar = self._grammar(spec, kinds[0])
        except (ValueError, TypeError) as e:
            raise KilnError(f"The {kinds[0]} constraint is invalid: {_first_line(e)}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise KilnError(f"The {kinds[0]} constraint cannot be compiled: {_first_line(messages[0])}")
        return grammar

    def _grammar(self, spec: StructuredOutputsParams, kind: str) -> str:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else spec.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema is an object")
            defaults = {"whitespace_flexible": spec.whitespace_flexible}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            if not spec.choice or not all(isinstance(c, str) for c in spec.choice):
                raise ValueError("choice is a non-empty list of strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark

    def guide(self, spec: StructuredOutputsParams) -> Guide:
        """A fresh matcher for one request (~1 ms for a typical schema; llguidance caches nothing across calls)."""
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise KilnError(f"The structured-output constraint cannot be compiled: {_first_line(matcher.get_error())}")
        return Guide(matcher, self.executor)


def _first_line(e: object) -> str:
    return " ".join(str(e).split())[:500]
