"""On-device sampling inside the step program: only chosen token ids and logprobs leave the device.

SamplingBatch holds one row per sequence slot (padded to S). A row with temperature 0 is greedy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20  # top alternatives returned per token (OpenAI's limit)


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
    seeds: jax.Array  # (S,) uint32, per-request seed; the key of a token is fold_in(seed, its position)

    @staticmethod
    def abstract(num_seqs: int, vocab_size: int) -> SamplingBatch:
        """Shapes and dtypes for ahead-of-time lowering."""
        f32 = jax.ShapeDtypeStruct((num_seqs,), jnp.float32)
        return SamplingBatch(
            temperature=f32,
            top_k=jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
            top_p=f32,
            min_p=f32,
            repetition_penalty=f32,
            presence_penalty=f32,
            frequency_penalty=f32,
            seeds=jax.ShapeDtypeStruct((num_seqs,), jnp.uint32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOut:
    tokens: jax.Array  # (S,) int32
    logprobs: jax.Array  # (S,) float32, logprob of the chosen token
    top_ids: jax.Array  # (S, MAX_LOGPROBS) int32
    top_logprobs: jax.Array  # (S, MAX_LOGPROBS) float32


def sample(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> StepOut:
    """Pick one token per row of logits (S, V) float32; positions (S,) makes seeded sampling reproducible."""
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)  # (S, V)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # (S,)
    temp = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
    scaled = logits / temp[:, None]  # (S, V)
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # (S, V) descending
    vocab = logits.shape[-1]
    # top-k: keep logits >= the k-th largest
    k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # (S, 1)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p
    probs_sorted = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted  # mass strictly before each entry
    n_keep = jnp.maximum(jnp.sum(cum < sampling.top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)  # (S, 1)
    # min-p: keep tokens with prob >= min_p * max prob
    min_logit = sorted_logits[:, :1] + jnp.log(jnp.maximum(sampling.min_p, 1e-30))[:, None]
    cutoff = jnp.maximum(jnp.maximum(kth, pth), jnp.where(sampling.min_p[:, None] > 0, min_logit, -jnp.inf))
    masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(sampling.seeds, positions)
    sampled = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    tokens = jnp.where(sampling.temperature > 0, sampled, greedy)
    top_logprobs, top_ids = jax.lax.top_k(logprobs_all, MAX_LOGPROBS)
    chosen = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    return StepOut(tokens=tokens, logprobs=chosen, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)
