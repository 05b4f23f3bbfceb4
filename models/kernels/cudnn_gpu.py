"""cuDNN's flash attention for the prefill pieces of a step, on CUDA GPUs (Hopper and newer).

pallas_gpu.paged_attention splits a prefill step's attention in two (its `pieces`): the kernel does each query's
cached keys (from the pages) and the decodes' own key; `piece_attention` here does each prefill piece's causal
attention over the piece's own new keys, all pieces of the step in one cuDNN call (the packed "THD" layout: the
step's tokens stay where they are, each piece a segment by its offset and length). The halves are merged by their
log-sum-exp. Same values as reference.piece_attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.models.batch import Batch
from kiln.models.kernels.reference import piece_tokens


@functools.cache
def available() -> bool:
    """Whether the default backend is a CUDA GPU of compute capability >= 9.0 with cuDNN (the packed layout's needs);
    False on a machine that only lowers for CUDA (cuDNN's attention does not lower there)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        fa.check_cudnn_version()
        dev = jax.devices()[0]
        return dev.platform == "gpu" and fa.check_compute_capability("9.0")
    except Exception:  # noqa: BLE001 no cuDNN, no GPU, or a jax without this module
        return False


def _compact(x: jax.Array, fill: int) -> jax.Array:
    """The non-negative entries of x (1-D) moved to the front in order, the rest `fill` (cuDNN's segment arrays)."""
    idx = jnp.nonzero(x >= 0, size=x.size, fill_value=x.size)[0]
    return jnp.take(x, idx, fill_value=fill)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, batch: Batch, *, scale: float):
    """The cuDNN call: out (T, H, D) in q's dtype, the softmax statistics (S, H, T) (row r = the r-th piece of the
    step, column i = its i-th token: the natural log-sum-exp), and each sequence's row (S,).

    It binds jax's forward primitive with cuDNN's segment arrays computed here: jax's packed-layout wrapper
    (fused_attention_stablehlo.dot_product_attention) scales the key offsets by the query's heads (jax 0.10-0.11, read
    in its code), which grouped-query attention's K/V do not have. (The wrapper on K/V repeated to the query's heads
    matched reference.piece_attention too, on an H200 in session 17, and took 4-5% longer.)"""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    num_tokens, num_heads, head_dim = q.shape
    qs = batch.query_start.astype(jnp.int32)  # (S + 1,)
    num_seqs = qs.shape[0] - 1
    q_len = qs[1:] - qs[:-1]
    piece = (jnp.arange(num_seqs) < batch.num_seqs[0]) & (q_len > 1)  # (S,)
    seqlen = _compact(jnp.where(piece, q_len, -1), 0)[None]  # (1, S): the pieces' lengths, then 0
    starts = jnp.concatenate([jnp.where(piece, qs[:-1], -1), jnp.full((1,), -1, jnp.int32)])
    starts = _compact(starts, num_tokens)  # (S + 1,): the pieces' first tokens, then T
    not_used = jnp.zeros(0, q.dtype)
    out, stats = fa._dot_product_attention_fwd_p.bind(
        q[None], k[None], v[None], not_used, seqlen, seqlen, (starts * num_heads * head_dim)[None],
        (starts * k.shape[1] * head_dim)[None], not_used, not_used, scale=scale, seed=42, dropout_rate=0.0,
        variadic_args=(False, False), mask_type=fa.MaskType.PADDING_CAUSAL, layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=None, is_training=True,
    )  # fmt: skip
    return out[0], stats, jnp.cumsum(piece.astype(jnp.int32)) - 1


def piece_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, batch: Batch, *, scale: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """reference.piece_attention through cuDNN: out (T, H, D), log-sum-exp (T, H), the pieces' tokens (T,)."""
    num_tokens, num_heads, _ = q.shape
    out, stats, row = packed_attention(q, k, v, batch, scale=scale)
    seq, covered = piece_tokens(batch, num_tokens)
    local = jnp.arange(num_tokens) - batch.query_start[seq]  # (T,) the token's place in its piece
    r = jnp.where(covered, row[seq], 0)[:, None]
    lse = stats[r, jnp.arange(num_heads)[None, :], jnp.where(covered, local, 0)[:, None]]  # (T, H)
    return out, lse, covered
