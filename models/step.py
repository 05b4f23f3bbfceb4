"""The step program: everything the accelerator does per engine step, as one function jitted per token bucket."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kiln.models.batch import Batch, KVCache
from kiln.models.config import ModelConfig
from kiln.models.kernels import decode_batch, get_attention, get_attention_qkv
from kiln.models.sampling import SamplingBatch, StepOut, remember, sample
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
    attn, attn_qkv = get_attention(attention), get_attention_qkv(attention)
    hidden, kv = forward(cfg, weights, kv, batch, attention=attn, attention_qkv=attn_qkv)
    last = hidden[batch.logits_index]  # (S, E)
    out = sample(logits(cfg, weights, last), sampling, batch.seq_lens)
    return out, kv


def advance(batch: Batch, tokens: jax.Array, page_size: int) -> Batch:
    """The decode batch of the next step: each live sequence's sampled token becomes its one query token, one
    position further. Only for decode batches: token i is sequence i's only query token (tokens past the live
    sequences are padding, whatever T and S are)."""
    num_tokens = batch.token_ids.shape[0]
    live = batch.seq_lens > 0  # (S,)
    positions = jnp.where(live, batch.seq_lens, 0)  # (S,) the new token's position = the KV length so far
    pages = jnp.take_along_axis(batch.block_tables, (positions // page_size)[:, None], axis=1)[:, 0]  # (S,)

    def per_token(x: jax.Array, fill: int) -> jax.Array:  # (S,) -> (T,)
        x = x[:num_tokens]
        return jnp.concatenate([x, jnp.full((num_tokens - x.shape[0],), fill, x.dtype)])

    return dataclasses.replace(
        batch,
        token_ids=per_token(jnp.where(live, tokens, 0), 0),
        positions=per_token(positions, 0),
        slot_mapping=per_token(jnp.where(live, pages * page_size + positions % page_size, -1), -1),
        seq_lens=jnp.where(live, batch.seq_lens + 1, 0),
    )


def decode_steps(
    cfg: ModelConfig,
    attention: str,
    num_steps: int,
    weights: Weights,
    kv: KVCache,
    batch: Batch,
    sampling: SamplingBatch,
) -> tuple[StepOut, KVCache]:
    """num_steps decode steps in one program, each step's sampled tokens fed back as the next step's inputs, so the
    host round trip is paid once per num_steps tokens. batch is a decode batch (one query token per sequence, T = S)
    whose pages hold num_steps more tokens; every StepOut leaf gets a leading (num_steps,) axis. Draws and penalties
    are those of num_steps single steps: positions advance, and each sampled token joins the penalty history."""
    one = functools.partial(step, cfg, attention, weights)
    out0 = jax.eval_shape(one, kv, batch, sampling)[0]
    outs = jax.tree.map(lambda a: jnp.zeros((num_steps, *a.shape), a.dtype), out0)

    def body(i, carry):
        kv, batch, sampling, outs = carry
        with decode_batch():  # attention may take its decode-only path
            out, kv = one(kv, batch, sampling)
        outs = jax.tree.map(lambda acc, x: acc.at[i].set(x), outs, out)
        live = batch.seq_lens > 0
        return kv, advance(batch, out.tokens, kv.page_size), remember(sampling, out.tokens, live), outs

    kv, _, _, outs = jax.lax.fori_loop(0, num_steps, body, (kv, batch, sampling, outs))
    return outs, kv


@functools.cache
def jit_decode_steps(cfg: ModelConfig, attention: str, num_steps: int) -> Callable:
    """decode_steps jitted like jit_step (cache donated, one compilation per bucket)."""
    return jax.jit(functools.partial(decode_steps, cfg, attention, num_steps), donate_argnums=(1,))


@functools.cache
def jit_step(cfg: ModelConfig, attention: str = "reference") -> Callable:
    """step with cfg and the attention implementation bound, the cache donated. Cached: engines of one model in one
    process share the jitted function, so each bucket compiles once."""
    return jax.jit(functools.partial(step, cfg, attention), donate_argnums=(1,))
