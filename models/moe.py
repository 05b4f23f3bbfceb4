"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral) as pure JAX inside the step program: routing on the device,
the expert FFNs as grouped matmuls, no Python loop over experts.

A layer's experts are stacked: gate and up (X, E, F), down (X, F, E) (X experts, hidden E, expert width F), always in
the float compute dtype (the narrow weight formats of kiln.models.quant cover the dense linears only); the router is
(E, X). Routing is softmax over the X router logits in float32, the top k experts per token, optionally renormalised
to sum to 1 (Mixtral always, Qwen3-MoE with norm_topk_prob), exactly as transformers does it.

Four dispatches, chosen by the static row count T of the bucket and the platform lowered for:

* grouped (GPU, every T): kiln.models.kernels.pallas_gpu_moe, two Pallas kernels over the pairs sorted by expert that
  read each touched expert's weights once; at T = 1 (a single sequence's decode) the single-token kernels: the k
  pairs in routing order (no sort, no scatter), the routing inside the first kernel, 3 launches a layer with the
  router's (router_logits: one small kernel of partial logits, not XLA's GEMM and reduction).
* gather (T * k <= X / 2, decode buckets, CPU and TPU): each token's k experts' weights are gathered, (T, k, E, F),
  and multiplied by batched matvecs; only the touched experts' bytes are read.
* sorted (above, TPU): the T * k (token, expert) pairs sorted by expert, then `jax.lax.ragged_dot` over the
  expert groups for gate, up and down (a grouped GEMM there), and the rows scattered back weighted.
* dense (above, CPU): every token through every expert, the unchosen ones weighted 0. XLA's CPU lowers ragged_dot to
  a masked dot over every expert for each of the T * k pairs (jax 0.10), k times the dense dispatch's work.

Measured with benchmarks/cpu_moe.py (E=512, X=32, F=256, k=4, float32, XLA CPU on 2 cores shared with other jobs,
so +-50%), ms per MoE MLP:

    T        1     2     4     8    16    64   256   1024
    gather 4.5   4.7   7.8    57   139   642  2048   5474
    sorted  18    21    27    43    46   171   688   1048
    dense  4.2    11    14    19    19    58   160    422

(two more runs at T = 1: gather 0.7 and 1.1, dense 5.9 and 3.7). Gather wins for decode-sized T up to T * k = X / 2
and falls off a cliff above (the gathered copies leave the cache); for prefill-sized T dense wins on CPU, and sorted
is 2.5-4x slower than dense there, so the platform_dependent switch keeps ragged_dot for the accelerators only.

On an H200 (jax 0.11.2, benchmarks/moe_gpu.py: one Qwen3-30B-A3B layer, E=2048, X=128, F=768, k=8, bf16), us per MoE
MLP against the bound of the distinct experts' bytes at the copy rate:

    T           1     8    16    64   256   1024
    bound      18   116   196   287   292    292
    gather    100   368   710  2661
    sorted    318   393   444   964  3450  14137
    dense     814   811   829   851  1054   2394

XLA's GPU ragged_dot is no fused grouped GEMM and every XLA dispatch is 3-8x its bound; the grouped Pallas kernel
(kiln.models.kernels.pallas_gpu_moe) runs at 1.2-1.3x the bound for T = 8-64 and 2.2x at T = 1024, and beats each XLA
dispatch at every T (BENCHMARKS.md), so the GPU runs it always. At T = 1 the figures above timed one call per layer
from the host; every layer's experts in one program (benchmarks/moe_gpu.py since 2026-12-01): 30 us a layer through
the grouped kernels, 28 through the single-token ones with their routing (bound 18).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.models.quant import linears


def route(h: jax.Array, router: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """h (T, E) through the router (E, X): each token's top_k experts (T, k) int32 and their float32 weights (T, k)
    (the softmax probabilities over all X experts, renormalised over the k when `renormalize`)."""
    (logits,) = linears(h, router)  # (T, X)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # (T, X)
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
    """Every token through every expert, combined with zero weight for the unchosen ones: (T, E)."""
    combine = jnp.zeros((h.shape[0], w_gate.shape[0]), jnp.float32)  # (T, X)
    combine = combine.at[jnp.arange(h.shape[0])[:, None], experts].set(weights)
    gate = jnp.einsum("te,xef->txf", h, w_gate)  # (T, X, F)
    up = jnp.einsum("te,xef->txf", h, w_up)
    y = jnp.einsum("txf,xfe->txe", act(gate) * up, w_down)  # (T, X, E)
    return jnp.einsum("txe,tx->te", y.astype(jnp.float32), combine).astype(h.dtype)


def uses_gather(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Does a bucket of num_tokens rows run the gather dispatch: at most half the experts' worth of (token, expert)
    pairs."""
    return num_tokens * top_k <= num_experts // 2


def moe_mlp(
    h, router, w_gate, w_up, w_down, top_k: int, renormalize: bool, act, live=None, dispatch: str | None = None
) -> jax.Array:
    """The sparse MLP of one layer: h (T, E) -> (T, E). Dispatch by the static T and the platform (module docstring).
    live (T,) bool, optional: the batch's real tokens. Padding rows (a bucket's tail; real tokens come first) are given
    row 0's experts with weight 0, so they touch no expert of their own: a decode of 1 sequence in a 16-row bucket
    reads k experts' weights per layer, not up to 16 k. dispatch "dense" forces the dense dispatch (expert parallelism:
    with the experts split over devices on their first axis, the partitioner keeps each device's experts local and
    sums their contributions with one all-reduce)."""
    live = jnp.ones((h.shape[0],), bool) if live is None else live
    args = (h, router, w_gate, w_up, w_down, live)
    routing = dict(top_k=top_k, renormalize=renormalize, act=act)
    if dispatch == "dense":
        return _routed(experts_dense, *args, **routing)
    small = uses_gather(h.shape[0], top_k, w_gate.shape[0])
    cpu = functools.partial(_routed, experts_gather if small else experts_dense, **routing)
    gpu = functools.partial(_gpu, **routing)
    default = functools.partial(_routed, experts_gather if small else experts_sorted, **routing)
    return jax.lax.platform_dependent(*args, cpu=cpu, cuda=gpu, rocm=gpu, default=default)


def _routed(fn, h, router, w_gate, w_up, w_down, live, *, top_k, renormalize, act):
    """route, padding rows masked (moe_mlp), then the dispatch fn."""
    weights, experts = route(h, router, top_k, renormalize)  # (T, k) each
    experts = jnp.where(live[:, None], experts, experts[:1])
    weights = jnp.where(live[:, None], weights, 0.0)
    return fn(h, w_gate, w_up, w_down, weights, experts, act)


# One token on GPUs: the router's logits by kiln.models.kernels.pallas_gpu_moe.router_logits (one launch) rather than
# XLA's 2-row split-K GEMM and its reduction (two). H200, 8 layers of Qwen3-30B-A3B (2026-12-01): router 2.6 us a
# layer against 1.8 + 1.3, gate_up +0.3 us for adding the partial rows: a wash in time, one launch a layer fewer.
# (A module attribute: benchmarks/moe_gpu.py's variant xlarouter turns it off.)
GPU_ROUTER_KERNEL = True


def _gpu(h, router, w_gate, w_up, w_down, live, *, top_k, renormalize, act):
    """The GPU kernels (kiln.models.kernels.pallas_gpu_moe, imported when a GPU program is traced: Pallas's Triton
    modules cost a CPU start ~0.2 s): one token routed by the single-token kernels, more through the grouped ones."""
    from kiln.models.kernels import pallas_gpu_moe as kernels

    t, num_experts = h.shape[0], w_gate.shape[0]
    if t == 1 and kernels.single_supported(num_experts, top_k):
        args = (live, w_gate, w_up, w_down, top_k, renormalize, act)
        if GPU_ROUTER_KERNEL and kernels.router_block(*router.shape) and router.dtype == h.dtype:
            # the router's float32 partial logits in one small kernel, added inside gate_up
            logits = kernels.router_logits(h, router)
            return kernels.experts_single(h, logits, *args, partial_logits=True)
        # the router's logits as a 2-row GEMM (a 1-row dot is XLA's multiply + reduce; quant._float_dot), (2, X): the
        # kernel reads row 0 and casts it, no slice or convert between them
        logits = jnp.broadcast_to(h, (2, h.shape[1])) @ router
        return kernels.experts_single(h, logits, *args)
    grouped = functools.partial(kernels.experts_grouped, block_m=grouped_block_m(t, top_k, num_experts))
    return _routed(grouped, h, router, w_gate, w_up, w_down, live, top_k=top_k, renormalize=renormalize, act=act)


def grouped_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Pair rows per chunk of the GPU kernel: 16 (the smallest dot tile) while an expert averages at most 16 pairs,
    64 above, so a prefill bucket reads each expert's weights in few chunks."""
    return 16 if num_tokens * top_k <= 16 * num_experts else 64


# ---- a decode layer's glue folded into the GPU kernels (single token) ---------------------------------------------
#
# H200, Qwen3-30B-A3B at batch 1 (session 11): between the attention and the experts XLA ran the o-proj's residual add
# and the RMSNorm as two launches (~3.9 + 1.3 us a layer) ahead of the router kernel; between the q|k|v GEMM and the
# attention, Qwen3's q/k norms, RoPE and the v slice as ~7 small fusions (~8 us). add_norm_mlp and qk_norm_rope fold
# them into one launch each (kiln.models.kernels.pallas_gpu_moe.router_add_norm and qk_norm_rope). After the experts,
# the sum of their k rows, the residual add and the next norm (two launches, ~3.8 + 1.3 us) run as one
# (pallas_gpu.add_rms_norm of the k rows, which transformer.forward calls when add_norm_mlp hands them back:
# gpu_rows). Measured (H200, session 12, 8-layer decode program): 67.8 -> 58.2 us of kernels a layer, 16.9 -> 11.0
# launches; each alone -5.3 (q/k), -4.2 (add + norm), -1.9 (rows); served c=1 TPOT 3.23 -> 2.80 ms (BENCHMARKS.md).
# Module attributes: benchmarks/moe_gpu.py's variants turn them off.
GPU_ADD_NORM = True
GPU_QK_NORM_ROPE = True
GPU_ROWS = True
# The o-proj in front of router_add_norm as pallas_gpu_moe.gemv_partials' float32 split-K rows, which router_add_norm
# adds: no split-K reduction between the GEMM and it (1.3 us a layer on the H200, session 12). H200, 8 layers (session
# 13): XLA's o-proj GEMM 6.5 + its reduction 1.2 + router_add_norm 3.4 us a layer against gemv_partials 6.4-6.5 +
# router_add_norm 4.4 (every program adds the 4 partial rows of the whole row): -0.3 us a layer (-0.45 with 5 stages),
# the ms per token the same within noise; off (not served). GPU_OPROJ_OPTS: gemv_partials' keywords
# (benchmarks/moe_gpu.py's variants oproj_sS_kK_gG set them).
GPU_OPROJ_KERNEL = False
GPU_OPROJ_OPTS: dict = {}
QK_NORM_ROPE_MAX_ROWS = 16  # decode buckets (the kernel runs one program a token; prefill keeps XLA's fusions)


def _rms_norm(x, w, eps):
    from kiln.models.transformer import rms_norm

    return rms_norm(x, w, eps)


def add_norm_mlp(
    x, o, wo, norm_w, eps: float, router, w_gate, w_up, w_down, top_k: int, renormalize: bool, act, live=None,
    dispatch: str | None = None, rows: bool = False,
):  # fmt: skip
    """A mixture-of-experts layer's second half: x' = x + o @ wo (the attention's o-proj added to the residual x) and
    moe_mlp(rms_norm(x', norm_w)); returns (x', the MLP's output), both (T, E). wo (H*D, E) a float weight. On GPUs at
    one token (GPU_ADD_NORM) the add and the norm run inside the router's launch (router_add_norm), which reads row 0
    of the o-proj's 2-row GEMM; elsewhere as transformer.forward writes them. rows (gpu_rows): the MLP's output as
    float32 rows (k, T, E) whose sum it is (the k experts' weighted rows on GPUs; elsewhere the output, then zeros),
    for pallas_gpu.add_rms_norm to add to x'."""
    from kiln.models.quant import linears

    live = jnp.ones((x.shape[0],), bool) if live is None else live
    mlp = functools.partial(moe_mlp, top_k=top_k, renormalize=renormalize, act=act, dispatch=dispatch)

    def plain(x, o, wo, norm_w, router, w_gate, w_up, w_down, live):
        (out,) = linears(o, wo)
        x = x + out
        y = mlp(_rms_norm(x, norm_w, eps), router, w_gate, w_up, w_down, live=live)
        if rows:
            y = jnp.zeros((top_k, *y.shape), jnp.float32).at[0].set(y.astype(jnp.float32))
        return x, y

    args = (x, o, wo, norm_w, router, w_gate, w_up, w_down, live)
    if not _gpu_add_norm(x, wo, router, top_k, dispatch):
        return plain(*args)

    def gpu(x, o, wo, norm_w, router, w_gate, w_up, w_down, live):
        from kiln.models.kernels import pallas_gpu_moe as kernels

        parts = kernels.gemv_partials(o, wo, **GPU_OPROJ_OPTS) if GPU_OPROJ_KERNEL else None
        if parts is not None:  # the o-proj's split-K rows, added inside
            x, h, logits = kernels.router_add_norm(x, parts, norm_w, router, eps, partials=True)
        else:
            small = (1 + wo.shape[1]) * wo.shape[0] < 10_000_000  # as quant._float_dot: 2-row GEMM, else cuBLAS's 1-row
            lhs = jnp.broadcast_to(o, (2, o.shape[1])) if small else o
            x, h, logits = kernels.router_add_norm(x, lhs @ wo, norm_w, router, eps)
        y = kernels.experts_single(h, logits, live, w_gate, w_up, w_down, top_k, renormalize, act, partial_logits=True,
                                   combine=not rows)  # fmt: skip
        return x, y[:, None] if rows else y

    return jax.lax.platform_dependent(*args, cuda=gpu, rocm=gpu, default=plain)


def _gpu_add_norm(x, wo, router, top_k: int, dispatch) -> bool:
    """Whether add_norm_mlp's GPU branch applies: one token, a float o-proj and router in x's dtype, the single-token
    kernels' shapes (powers of two: pallas_gpu_moe.single_supported and router_block, not imported here: Pallas's
    Triton modules cost a CPU start ~0.2 s) and no forced dispatch."""
    hidden, num_experts = router.shape
    return (
        GPU_ADD_NORM and GPU_ROUTER_KERNEL and dispatch is None and x.shape[0] == 1 and isinstance(wo, jax.Array)
        and wo.dtype == x.dtype and router.dtype == x.dtype and all(_pow2(n) for n in (hidden, num_experts, top_k))
    )  # fmt: skip


def gpu_rows(num_tokens: int, hidden: int, top_k: int) -> bool:
    """Whether transformer.forward asks add_norm_mlp for the MLP's rows (rows=True), where its attention offers
    add_rms_norm: one token (the single-token kernels' k rows), hidden and k powers of two (Triton's blocks)."""
    return GPU_ROWS and num_tokens == 1 and _pow2(hidden) and _pow2(top_k)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def qk_norm_rope(qkv, q_norm, k_norm, cos, sin, eps: float, *, kv_heads: int, head_dim: int):
    """Qwen3's q/k RMSNorms and RoPE of the fused q|k|v (T, (H + 2 KVH) D) (transformer.fuse_linears's layout), for
    an attention that reads a fused qkv: (T, KVH, G + 2, D), q and k normed and rotated, v as it is. On GPUs one
    launch (pallas_gpu_moe.qk_norm_rope), elsewhere XLA's ops (transformer.rms_norm and rope)."""

    def plain(qkv, q_norm, k_norm, cos, sin):
        from kiln.models.transformer import rope

        t = qkv.shape[0]
        x = qkv.reshape(t, kv_heads, -1, head_dim)  # (T, KVH, G + 2, D)
        g = x.shape[2] - 2
        q = rope(_rms_norm(x[:, :, :g].reshape(t, -1, head_dim), q_norm, eps), cos, sin).reshape(t, kv_heads, g, -1)
        k = rope(_rms_norm(x[:, :, g], k_norm, eps), cos, sin)[:, :, None]
        return jnp.concatenate([q, k, x[:, :, g + 1 :]], axis=2)

    def gpu(qkv, q_norm, k_norm, cos, sin):
        from kiln.models.kernels import pallas_gpu_moe as kernels

        return kernels.qk_norm_rope(qkv, q_norm, k_norm, cos, sin, eps, kv_heads=kv_heads, head_dim=head_dim)

    return jax.lax.platform_dependent(qkv, q_norm, k_norm, cos, sin, cuda=gpu, rocm=gpu, default=plain)


def gpu_qk_norm_rope(num_tokens: int, head_dim: int) -> bool:
    """Whether transformer.forward runs qk_norm_rope (a fused-qkv attention with Qwen3's q/k norms): decode-sized
    buckets, a power-of-two head_dim of at least 32 (Triton's blocks)."""
    return GPU_QK_NORM_ROPE and num_tokens <= QK_NORM_ROPE_MAX_ROWS and _pow2(head_dim) and head_dim >= 32
