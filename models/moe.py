"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral) as pure JAX inside the step program: routing on the device,
the expert FFNs as grouped matmuls, no Python loop over experts.

A layer's experts are stacked: gate and up (X, E, F), down (X, F, E) (X experts, hidden E, expert width F), always in
the float compute dtype (the narrow weight formats of kiln.models.quant cover the dense linears only); the router is
(E, X). Routing is softmax over the X router logits in float32, the top k experts per token, optionally renormalised
to sum to 1 (Mixtral always, Qwen3-MoE with norm_topk_prob), exactly as transformers does it.

Two dispatches, chosen by the static row count T of the bucket:

* gather (T * k <= GATHER_MAX_ROWS, the decode buckets): each token's k experts' weights are gathered, (T, k, E, F),
  and multiplied by batched matvecs; only the touched experts' bytes are read.
* sorted (prefill): the T * k (token, expert) pairs sorted by expert, then `jax.lax.ragged_dot` over the expert groups
  for gate, up and down, and the rows scattered back weighted. On GPU and TPU ragged_dot is a grouped GEMM; XLA's CPU
  lowers it to a masked dense dot over every expert (jax 0.10), which is still the faster of the two there once the
  gathered weight copies grow with T (benchmarks/cpu_moe.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GATHER_MAX_ROWS = 64  # (token, expert) pairs up to which the gather dispatch runs; above, sorted ragged_dot


def route(h: jax.Array, router: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """h (T, E) through the router (E, X): each token's top_k experts (T, k) int32 and their float32 weights (T, k)
    (the softmax probabilities over all X experts, renormalised over the k when `renormalize`)."""
    probs = jax.nn.softmax((h @ router).astype(jnp.float32), axis=-1)  # (T, X)
    weights, experts = jax.lax.top_k(probs, top_k)  # (T, k) each
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_gather(h, w_gate, w_up, w_down, weights, experts, act) -> jax.Array:
    """Every token through its k experts by gathering their weights: (T, E). h (T, E); w_gate, w_up (X, E, F);
    w_down (X, F, E); weights, experts (T, k)."""
    gate = jnp.einsum("te,tkef->tkf", h, w_gate[experts])  # (T, k, F)
    up = jnp.einsum("te,tkef->tkf", h, w_up[experts])  # (T, k, F)
    y = jnp.einsum("tkf,tkfe->tke", act(gate) * up, w_down[experts])  # (T, k, E)
    return jnp.einsum("tke,tk->te", y.astype(jnp.float32), weights).astype(h.dtype)  # (T, E)


def experts_sorted(h, w_gate, w_up, w_down, weights, experts, act) -> jax.Array:
    """Every token through its k experts as grouped matmuls over the (token, expert) pairs sorted by expert: (T, E).
    Shapes as experts_gather."""
    t, k = experts.shape
    flat = experts.reshape(-1)  # (T*k,)
    order = jnp.argsort(flat, stable=True)  # (T*k,) pair indices sorted by expert
    token = order // k  # (T*k,) the token of each sorted pair
    sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)  # (X,) pairs per expert
    xs = h[token]  # (T*k, E)
    gate = jax.lax.ragged_dot(xs, w_gate, sizes)  # (T*k, F)
    up = jax.lax.ragged_dot(xs, w_up, sizes)  # (T*k, F)
    y = jax.lax.ragged_dot(act(gate) * up, w_down, sizes)  # (T*k, E)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]  # (T*k, E)
    return jnp.zeros((t, h.shape[1]), jnp.float32).at[token].add(y).astype(h.dtype)  # (T, E)


def experts_dense(h, w_gate, w_up, w_down, weights, experts, act) -> jax.Array:
    """Every token through every expert, combined with zero weight for the unchosen ones: (T, E). The baseline of
    benchmarks/cpu_moe.py, not used by the model."""
    combine = jnp.zeros((h.shape[0], w_gate.shape[0]), jnp.float32)  # (T, X)
    combine = combine.at[jnp.arange(h.shape[0])[:, None], experts].set(weights)
    gate = jnp.einsum("te,xef->txf", h, w_gate)  # (T, X, F)
    up = jnp.einsum("te,xef->txf", h, w_up)
    y = jnp.einsum("txf,xfe->txe", act(gate) * up, w_down)  # (T, X, E)
    return jnp.einsum("txe,tx->te", y.astype(jnp.float32), combine).astype(h.dtype)


def moe_mlp(h, router, w_gate, w_up, w_down, top_k: int, renormalize: bool, act) -> jax.Array:
    """The sparse MLP of one layer: h (T, E) -> (T, E). Dispatch by the static T (see the module docstring)."""
    weights, experts = route(h, router, top_k, renormalize)  # (T, k) each
    run = experts_gather if h.shape[0] * top_k <= GATHER_MAX_ROWS else experts_sorted
    return run(h, w_gate, w_up, w_down, weights, experts, act)
