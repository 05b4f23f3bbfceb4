"""OpenAI requests -> engine jobs, engine outputs -> OpenAI response objects.

`OpenAIAdapter` knows the tokenizer, the vocabulary and the context length; it turns a validated request into one
`Job` per choice (a prompt's token ids and its SamplingParams: n choices are n engine requests) and formats what the
engine returns (text, logprobs, usage) in OpenAI's shapes. Every user mistake is an APIError (a 400 / 404), never
an exception the app would answer with a 500.

Prompt text is bounded before it is tokenized: no text longer than max_model_len times the vocabulary's longest token
(in characters) can fit the context, so longer prompts are refused without spending the tokenizer's time on them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import jinja2

from kiln.models.errors import KilnError
from kiln.serving.params import RequestOutput, SamplingParams, TokenLogprob
from kiln.serving.schemas import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class Job:
    """One engine request: choice `index` of a response."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""  # for echo


@dataclass
class ChoiceState:
    """What one choice has produced so far (non-streaming responses and streaming usage)."""

    index: int
    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs or []
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finished:
            self.finish_reason = out.finish_reason


def usage(states: list[ChoiceState], n: int) -> dict[str, Any]:
    """OpenAI's usage object: each prompt counted once (n choices share it), every choice's tokens counted."""
    prompt = sum(s.prompt_tokens for s in states if s.index % n == 0)
    completion = sum(len(s.token_ids) for s in states)
    cached = sum(s.cached_tokens for s in states if s.index % n == 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class OpenAIAdapter:
    """Request validation beyond the schema, prompt building, sampling parameters and logprob formatting."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tok = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        defaults = dict(getattr(tokenizer, "generation_defaults", None) or {})
        self.defaults = {k: defaults[k] for k in GENERATION_DEFAULT_FIELDS if defaults.get(k) is not None}
        self._token_str: dict[int, str] = {}

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """No text longer than this fits the context. Scanning the vocabulary takes ~50 ms (SmolLM2's 49K tokens),
        so it runs at the first use, which Routes.attach makes on a tokenize thread right after ready."""
        backend = getattr(self.tok, "backend", None)
        longest = max(map(len, backend.get_vocab(with_added_tokens=True)), default=1) if backend is not None else 64
        return self.max_model_len * max(longest, 1)

    # ---- prompts ----

    def check_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, text of `chars` characters that cannot fit the context whatever its tokens."""
        if chars > self.max_prompt_chars:
            raise APIError(f"The prompt has {chars} characters, more than the model's context of {self.max_model_len} "
                           f"tokens can hold; shorten it.", param=param, code="context_length_exceeded")  # fmt: skip

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is outside the vocabulary (0..{self.vocab_size - 1}).", param=param,
                           code="invalid_token_id")  # fmt: skip

    def completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str]]:
        """The prompts of a completion request as (token ids, text) pairs."""
        p = req.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items:
            raise APIError("The prompt is empty.", param="prompt", code="empty_prompt")
        self.check_length(sum(len(x) for x in items if isinstance(x, str)), "prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError("The prompt is empty.", param="prompt", code="empty_prompt")
                out.append((self.tok.encode(item, add_special_tokens=True), item))
            else:
                if not item:
                    raise APIError("The prompt is empty.", param="prompt", code="empty_prompt")
                self.check_ids(item, "prompt")
                out.append((list(item), self.tok.decode(item, skip_special_tokens=False) if req.echo else ""))
        return out

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool, tools: list | None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:  # fmt: skip
        """Render `messages` with the model's chat template (template_kwargs: the request's chat_template_kwargs,
        e.g. enable_thinking) and tokenize the result."""
        if not messages:
            raise APIError("The messages list is empty.", param="messages", code="empty_messages")
        dicts = []
        for i, m in enumerate(messages):
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.type not in ("text", "input_text") or part.text is None:
                        raise APIError(f"Content parts of type {part.type!r} are not supported; send text parts.",
                                       param=f"messages[{i}].content")  # fmt: skip
                    texts.append(part.text)
                d["content"] = "\n".join(texts)
            else:
                d["content"] = m.content if m.content is not None else ""
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key) is not None:
                    d[key] = getattr(m, key)
            dicts.append(d)
        self.check_length(sum(len(d["content"]) for d in dicts) + len(str(tools or "")), "messages")
        try:  # message text that spells a special token stays text (Tokenizer.encode_chat)
            ids = self.tok.encode_chat(dicts, add_generation_prompt=add_generation_prompt, tools=tools,
                                       **(template_kwargs or {}))  # fmt: skip
        except KilnError as e:
            raise APIError(str(e), param="messages") from None
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
            raise APIError(f"The chat template could not render these messages: {e}", param="messages") from None
        if not ids:
            raise APIError("The rendered chat prompt is empty.", param="messages", code="empty_messages")
        return ids

    # ---- sampling ----

    def params(self, req: SamplingFields, prompt_len: int, max_tokens: int | None, default_max: int | None,
               logprobs: int | None) -> SamplingParams:  # fmt: skip
        """SamplingParams for one choice (seed is set per choice by `jobs`)."""
        room = self.max_model_len - prompt_len
        if room < 1:
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise APIError(f"The prompt has {prompt_len} tokens but the model's context length is "
                           f"{self.max_model_len} tokens; shorten the prompt.", param=param,
                           code="context_length_exceeded")  # fmt: skip
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise APIError(f"This model's context length is {self.max_model_len} tokens; the prompt has {prompt_len} "
                           f"and {max_tokens} more were requested. Lower max_tokens to at most {room}.",
                           param="max_tokens", code="context_length_exceeded")  # fmt: skip
        if req.min_tokens > max_tokens:
            raise APIError(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens}).",
                           param="min_tokens")  # fmt: skip
        pick = lambda name, fallback: getattr(req, name) if getattr(req, name) is not None else \
            self.defaults.get(name, fallback)  # fmt: skip
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = list(req.stop_token_ids or [])
        self.check_ids(stop_ids, "stop_token_ids")
        top_k = int(pick("top_k", 0))
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=float(pick("temperature", 1.0)),
            top_p=float(pick("top_p", 1.0)),
            top_k=max(top_k, 0),
            min_p=float(pick("min_p", 0.0)),
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed,
            stop=[s for s in stop if s],
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )

    def jobs(self, req: SamplingFields, prompts: list[tuple[list[int], str]], max_tokens: int | None,
             default_max: int | None, logprobs: int | None) -> list[Job]:  # fmt: skip
        """One Job per (prompt, choice); choice i of prompt p has index p * n + i and seed seed + i."""
        if req.logit_bias:
            raise APIError("logit_bias is not supported.", param="logit_bias")
        jobs = []
        for p, (ids, text) in enumerate(prompts):
            base = self.params(req, len(ids), max_tokens, default_max, logprobs)
            for i in range(req.n):
                params = SamplingParams(**{**base.__dict__, "stop": list(base.stop)})
                if base.seed is not None:
                    params.seed = (base.seed + i) % 2**63
                jobs.append(Job(p * req.n + i, ids, params, text))
        return jobs

    # ---- logprobs ----

    def token_str(self, token_id: int) -> str:
        s = self._token_str.get(token_id)
        if s is None:
            s = self.tok.decode([token_id], skip_special_tokens=False)
            if len(self._token_str) < 1_000_000:
                self._token_str[token_id] = s
        return s

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        entry = lambda t, lp: {"token": (s := self.token_str(t)), "logprob": lp, "bytes": list(s.encode())}
        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
            ]
        }

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        """OpenAI completion logprobs: parallel lists tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, offsets = [], []
        for lp in lps:
            s = self.token_str(lp.token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {**{self.token_str(t): v for t, v in lp.top}, self.token_str(lp.token_id): lp.logprob} for lp in lps
            ],
            "text_offset": offsets,
        }
