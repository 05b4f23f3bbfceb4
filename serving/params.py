"""Request-level data shared by the engine and the server: SamplingParams in, RequestOutput out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's StructuredOutputsParams): set exactly one of json (a JSON schema, dict or
    string), regex, choice (the output is one of the strings), grammar (Lark, or llama.cpp's GBNF) or json_object
    (any JSON object). JSON is compact (no free whitespace) unless the schema's "x-guidance" says otherwise."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_flexible: bool = False  # JSON: free whitespace between tokens (vLLM's default; off suits small models)

    def kinds(self) -> list[str]:
        """The constraints set (exactly one is valid)."""
        given = {"json": self.json is not None, "regex": self.regex is not None, "choice": self.choice is not None,
                 "grammar": self.grammar is not None, "json_object": bool(self.json_object)}  # fmt: skip
        return [k for k, v in given.items() if v]


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops (OpenAI / vLLM semantics)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of alternatives (0..20); None = no logprobs
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex, ...)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the alternatives, best first


@dataclass
class RequestOutput:
    """An incremental update of one request: the tokens and text produced since the previous update."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" (a finished grammar is "stop")
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
