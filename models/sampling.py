"""On-device sampling inside the step program: only chosen token ids and logprobs leave the device.

SamplingBatch holds one row per sequence slot (padded to S). A row with temperature 0 is greedy.

Order of operations per row (vLLM's): raw logits -> repetition, frequency and presence penalties -> blocked tokens
(EOS and stop ids before min_tokens) -> the structured-output token mask -> greedy argmax, or temperature, then
top-k, top-p (over the top-k distribution) and min-p, then a Gumbel-max draw keyed by (seed, position) — so a seeded
row's draw depends on nothing else in the batch (see gumbel()). Logprobs are those of the raw model distribution
(OpenAI's and vLLM's default).

The token history the penalties need has a fixed shape: the last HISTORY_LEN tokens of each sequence (prompt then
output, -1 padded), and how many of them are prompt tokens. Repetition penalty applies to prompt and output tokens,
presence and frequency penalties to output tokens (OpenAI semantics).

Structured outputs: `allowed` is a per-row token bitmask filled on the host (llguidance's layout: bit v % 32 of int32
word v // 32 is set when token v may be chosen), so a grammar constrains a compiled program without recompiling it.
Free rows pass all ones (-1 words); the unpacking is skipped when every row is free.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20  # top alternatives returned per token (OpenAI's limit)
HISTORY_LEN = 1024  # tokens of history seen by the penalties (the most recent ones)
MAX_BLOCKED = 8  # token ids a row can forbid (EOS and stop token ids while min_tokens is not reached)


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of the token bitmask (32 tokens a word)."""
    return (vocab_size + 31) // 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    temperature: jax.Array  # (S,) float32; 0 = greedy
    top_k: jax.Array  # (S,) int32; 0 = off
    top_p: jax.Array  # (S,) float32; 1 = off
    min_p: jax.Array  # (S,) float32; 0 = off
    repetition_penalty: jax.Array  # (S,) float32; 1 = off
    presence_penalty: jax.Array  # (S,) float32; 0 = off
    frequency_penalty: jax.Array  # (S,) float32; 0 = off
    seeds: jax.Array  # (S,) uint32, per-request seed; a draw depends only on (seed, position)
    history: jax.Array  # (S, H) int32, the last H tokens of each sequence (prompt then output), -1 = none
    history_prompt: jax.Array  # (S,) int32, how many leading entries of history are prompt tokens
    blocked: jax.Array  # (S, MAX_BLOCKED) int32, token ids that cannot be chosen, -1 = none
    want_top: jax.Array  # (S,) int32, 1 = return the top MAX_LOGPROBS alternatives (computed only if a row asks)
    allowed: jax.Array  # (S, mask_words(V)) int32 token bitmask of structured outputs; -1 words = every token

    @staticmethod
    def abstract(num_seqs: int, vocab_size: int, history_len: int = HISTORY_LEN) -> SamplingBatch:
        """Shapes and dtypes for ahead-of-time lowering."""
        f32 = jax.ShapeDtypeStruct((num_seqs,), jnp.float32)
        i32 = jax.ShapeDtypeStruct((num_seqs,), jnp.int32)
        return SamplingBatch(
            temperature=f32,
            top_k=i32,
            top_p=f32,
            min_p=f32,
            repetition_penalty=f32,
            presence_penalty=f32,
            frequency_penalty=f32,
            seeds=jax.ShapeDtypeStruct((num_seqs,), jnp.uint32),
            history=jax.ShapeDtypeStruct((num_seqs, history_len), jnp.int32),
            history_prompt=i32,
            blocked=jax.ShapeDtypeStruct((num_seqs, MAX_BLOCKED), jnp.int32),
            want_top=i32,
            allowed=jax.ShapeDtypeStruct((num_seqs, mask_words(vocab_size)), jnp.int32),
        )

    @staticmethod
    def neutral(num_seqs: int, history_len: int = HISTORY_LEN, *, vocab_size: int) -> SamplingBatch:
        """Host-side (numpy) rows that sample greedily with every option off; the runner fills live rows in."""
        return SamplingBatch(
            temperature=np.zeros(num_seqs, np.float32),
            top_k=np.zeros(num_seqs, np.int32),
            top_p=np.ones(num_seqs, np.float32),
            min_p=np.zeros(num_seqs, np.float32),
            repetition_penalty=np.ones(num_seqs, np.float32),
            presence_penalty=np.zeros(num_seqs, np.float32),
            frequency_penalty=np.zeros(num_seqs, np.float32),
            seeds=np.zeros(num_seqs, np.uint32),
            history=np.full((num_seqs, history_len), -1, np.int32),
            history_prompt=np.zeros(num_seqs, np.int32),
            blocked=np.full((num_seqs, MAX_BLOCKED), -1, np.int32),
            want_top=np.zeros(num_seqs, np.int32),
            allowed=np.full((num_seqs, mask_words(vocab_size)), -1, np.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOut:
    tokens: jax.Array  # (S,) int32
    logprobs: jax.Array  # (S,) float32, logprob of the chosen token
    top_ids: jax.Array  # (S, MAX_LOGPROBS) int32; zeros unless some row of the step set want_top
    top_logprobs: jax.Array  # (S, MAX_LOGPROBS) float32; likewise


def apply_penalties(logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties on logits (S, V)."""
    num_seqs, vocab = logits.shape
    hist = sampling.history  # (S, H)
    rows = jnp.arange(num_seqs)[:, None]  # (S, 1)
    idx = jnp.where(hist >= 0, hist, vocab)  # (S, H); out of range -> dropped
    is_output = jnp.arange(hist.shape[1])[None, :] >= sampling.history_prompt[:, None]  # (S, H)
    counts = jnp.zeros((num_seqs, vocab), jnp.float32).at[rows, idx].add(is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((num_seqs, vocab), jnp.bool_).at[rows, idx].set(True, mode="drop")  # (S, V)
    r = sampling.repetition_penalty[:, None]  # (S, 1)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - sampling.frequency_penalty[:, None] * counts
    return logits - sampling.presence_penalty[:, None] * (counts > 0)


def remember(sampling: SamplingBatch, tokens: jax.Array, live: jax.Array) -> SamplingBatch:
    """sampling for the next decode step: each live row's sampled token (S,) appended to its penalty history (the
    oldest entry drops out of a full history, a prompt one first)."""
    hist = sampling.history  # (S, H)
    count = jnp.sum(hist >= 0, axis=1)  # (S,)
    full = count >= hist.shape[1]
    shifted = jnp.where(full[:, None], jnp.roll(hist, -1, axis=1), hist)
    col = jnp.where(full, hist.shape[1] - 1, count)  # (S,)
    appended = shifted.at[jnp.arange(hist.shape[0]), col].set(tokens)
    prompt = jnp.where(full, jnp.maximum(sampling.history_prompt - 1, 0), sampling.history_prompt)
    return dataclasses.replace(
        sampling,
        history=jnp.where(live[:, None], appended, hist),
        history_prompt=jnp.where(live, prompt, sampling.history_prompt),
    )


def apply_mask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """-inf on the logits (S, V) of the tokens whose bit is clear in the bitmask allowed (S, mask_words(V))."""
    num_seqs, vocab = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # (S, W, 32)
    return jnp.where(bits.reshape(num_seqs, -1)[:, :vocab] != 0, logits, -jnp.inf)


def truncate(scaled: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """Top-k, then top-p over the top-k distribution, then min-p, on temperature-scaled logits (S, V): the
    tokens outside the kept support get -inf."""
    vocab = scaled.shape[-1]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # (S, V) descending
    k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), vocab)  # (S,)
    in_k = jnp.arange(vocab)[None, :] < k[:, None]  # (S, V)
    probs = jax.nn.softmax(jnp.where(in_k, sorted_logits, -jnp.inf), axis=-1)  # (S, V)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each entry
    n_keep = jnp.maximum(jnp.sum(in_k & (before < sampling.top_p[:, None]), axis=-1), 1)  # (S,)
    cutoff = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)  # (S, 1)
    min_logit = sorted_logits[:, :1] + jnp.log(jnp.maximum(sampling.min_p, 1e-30))[:, None]  # p >= min_p * p_max
    cutoff = jnp.maximum(cutoff, jnp.where(sampling.min_p[:, None] > 0, min_logit, -jnp.inf))
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _mix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection that scrambles every bit of x (uint32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel(seeds: jax.Array, positions: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise (S, V) that depends only on (seed, position, token id): a counter-based hash, so a row's draw
    is reproducible whatever else is in the batch. (Cheaper to compile and run than threefry on a CPU.)"""
    row = _mix32(seeds.astype(jnp.uint32) ^ _mix32(positions.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))  # (S,)
    col = jnp.arange(vocab, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1)  # (V,)
    bits = _mix32(_mix32(row[:, None] ^ col[None, :]) + row[:, None])  # (S, V)
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # (S, V) uniform in (0, 1)
    return -jnp.log(-jnp.log(u))


def sample(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> StepOut:
    """Pick one token per row of logits (S, V) float32; positions (S,) (the sampled token's position) keys the
    seeded draw."""
    num_seqs, vocab = logits.shape
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)  # (S, V)
    penalised = (
        (sampling.repetition_penalty != 1) | (sampling.presence_penalty != 0) | (sampling.frequency_penalty != 0)
    )
    logits = jax.lax.cond(jnp.any(penalised), apply_penalties, lambda x, _: x, logits, sampling)
    blocked = jnp.where(sampling.blocked >= 0, sampling.blocked, vocab)  # (S, B)
    logits = logits.at[jnp.arange(num_seqs)[:, None], blocked].set(-jnp.inf, mode="drop")
    logits = jax.lax.cond(jnp.any(sampling.allowed != -1), apply_mask, lambda x, _: x, logits, sampling.allowed)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # (S,)

    def draw(logits):
        temp = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
        scaled = logits / temp[:, None]  # (S, V)
        # the full-vocabulary sort of truncate() only when some row truncates (it dominates a large batch's step)
        truncates = jnp.any((sampling.top_k > 0) | (sampling.top_p < 1) | (sampling.min_p > 0))
        masked = jax.lax.cond(truncates, truncate, lambda x, _: x, scaled, sampling)
        sampled = jnp.argmax(masked + gumbel(sampling.seeds, positions, vocab), axis=-1).astype(jnp.int32)  # (S,)
        return jnp.where(sampling.temperature > 0, sampled, greedy)

    def top(raw):
        values, ids = jax.lax.top_k(raw, MAX_LOGPROBS)  # (S, MAX_LOGPROBS)
        return ids.astype(jnp.int32), values

    def no_top(raw):
        return jnp.zeros((num_seqs, MAX_LOGPROBS), jnp.int32), jnp.zeros((num_seqs, MAX_LOGPROBS), raw.dtype)

    tokens = jax.lax.cond(jnp.any(sampling.temperature > 0), draw, lambda _: greedy, logits)
    top_ids, top_logprobs = jax.lax.cond(jnp.any(sampling.want_top > 0), top, no_top, raw_logprobs)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]  # (S,)
    return StepOut(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)
