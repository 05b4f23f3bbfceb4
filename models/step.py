"""The step program: everything the accelerator does per engine step, as one function jitted per token bucket."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from kiln.models.batch import Batch, KVCache
from kiln.models.config import ModelConfig
from kiln.models.kernels import get_attention
from kiln.models.sampling import SamplingBatch, StepOut, sample
from kiln.models.transformer import Weights, forward, logits


def step(
    cfg: ModelConfig,
    attention: str,
    weights: Weights,
    kv: KVCache,
    batch: Batch,
    sampling: SamplingBatch,
) -> tuple[StepOut, KVCache]:
    """Forward the ragged batch, sample one token per sequence on the device. cfg and attention are static."""
    hidden, kv = forward(cfg, weights, kv, batch, attention=get_attention(attention))
    last = hidden[batch.logits_index]  # (S, E)
    out = sample(logits(cfg, weights, last), sampling, batch.seq_lens)
    return out, kv


@functools.cache
def jit_step(cfg: ModelConfig, attention: str = "reference") -> Callable:
    """step with cfg and the attention implementation bound, the cache donated. Cached: engines of one model in one
    process share the jitted function, so each bucket compiles once."""
    return jax.jit(functools.partial(step, cfg, attention), donate_argnums=(1,))
