"""Request-level data shared by the engine and the server: SamplingParams in, RequestOutput out."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
