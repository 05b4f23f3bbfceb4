"""The experts of a mixture-of-experts layer as grouped Pallas kernels for GPUs (Triton lowering): every touched
expert's weights are read once, untouched experts cost nothing, nothing is gathered or widened in memory.

Many tokens (experts_grouped): the T * k (token, expert) pairs are sorted by expert in XLA (a few small ops), then

* gate_up: grid (G groups = the distinct experts, at most min(T * k, X), F / block_f). Program (g, j) runs the pairs
  of group g's expert, block_m at a time (one chunk when the expert has at most block_m pairs, as every expert has at
  decode sizes), over the hidden axis block_k at a time: act = act_fn(x @ gate[g][:, j]) * (x @ up[g][:, j]), the
  rows of x gathered by token.
* down: grid (G, E / block_e). y = act @ down[g][:, j], scaled by each pair's routing weight.

and XLA adds each token's k rows of y.

One token (experts_single, a single sequence's decode): the same two kernels run one pair per group, in routing order:
no sort, no tables, no scatter; XLA adds the k rows (fused into the residual add that follows). The routing (softmax
over the router logits, the top k, their weights) runs inside gate_up: each program ranks the X logits itself and
takes the expert of its group's rank (k max-reductions over keys that order the logits and break ties by index, no
(X, X) compare), and program (0, 0) writes the k experts and weights for down (two launches a layer;
fused_route=False: a route kernel of its own before them, three). The router's logits come in its dtype, cast inside,
or as router_logits' float32 partial rows (one small kernel in place of XLA's GEMM and reduction), added inside.

Values as kiln.models.moe.experts_dense (float32 accumulation, the weights' dtype into the dots). Measured against the
XLA dispatches by benchmarks/moe_gpu.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _each_chunk(tables, g, block_m, body):
    """body(rows, ok) for each chunk of block_m sorted pairs of group g: rows (M,) their indices, ok (M,) which of
    them are the group's (the last chunk's tail is masked). tables: the (first pair, pairs) refs of the groups, or
    None: group g is pair g alone."""
    r = jnp.arange(block_m, dtype=jnp.int32)
    if tables is None:
        body(g + r, r < 1)
        return
    start_ref, size_ref = tables

    def chunk(c, carry):
        rc = c * block_m + r
        body(start_ref[g] + rc, rc < size_ref[g])
        return carry

    lax.fori_loop(0, pl.cdiv(size_ref[g], block_m), chunk, jnp.int32(0))


def _k_sum(steps, block_k, block_m, width, dot_step, outputs):
    """The float32 sums over `steps` K tiles: dot_step(kcols, k) -> `outputs` (M, width) terms."""

    def kstep(i, acc):
        k = i * block_k
        terms = dot_step(k + jnp.arange(block_k, dtype=jnp.int32), k)
        return tuple(a + t for a, t in zip(acc, terms, strict=True))

    zero = jnp.zeros((block_m, width), jnp.float32)
    return lax.fori_loop(0, steps, kstep, (zero,) * outputs)


def _gate_up_kernel(*refs, block_m, block_k, block_f, single, act, route=None, trans=False):
    """Program (g, j): group g's act rows for output columns tile j."""
    g, j = pl.program_id(0), pl.program_id(1)
    n_in = 5 if route is not None else (4 if single else 7)
    out_ref, route_outs = refs[n_in], refs[n_in + 1 :]
    tables, tok_ref = None, None
    if route is not None:  # one token, routed here: every program ranks the X logits and takes the expert of rank g
        logit_ref, live_ref, h_ref, wg_ref, wu_ref = refs[:n_in]
        exp_ref, w_ref = route_outs
        low = wg_ref.shape[0] - 1  # X - 1
        x = _logits(logit_ref, low + 1, route.get("partial"))  # no XLA slice, convert or reduction in front
        top_k, compare = route["top_k"], route.get("rank_compare")
        if compare:  # measurement only: every expert's rank by an (X, X) compare (session 8), the top k in (0, 0)
            keys = _keys(x)
            rank = jnp.sum((keys[None, :] > keys[:, None]).astype(jnp.int32), axis=1)
            e = jnp.sum(jnp.where(rank == g, jnp.arange(low + 1, dtype=jnp.int32), 0))
        else:
            keys, top = _top_keys(x, top_k)
            e = jnp.int32(0)
            for i, m in enumerate(top):
                e = jnp.where(g == i, low - (m & low), e)

        @pl.when((g == 0) & (j == 0))
        def _():  # the down kernel's experts and routing weights
            tops = _top_keys(x, top_k)[1] if compare else top
            experts, pair_w = _routing(x, live_ref[0], keys, tops, renormalize=route["renormalize"])
            exp_ref[...] = experts
            w_ref[pl.ds(0, top_k)] = pair_w

    elif single:  # one token: its pairs are the groups
        exp_ref, h_ref, wg_ref, wu_ref = refs[:n_in]
        e = exp_ref[g]
    else:
        exp_ref, start_ref, size_ref, tok_ref, h_ref, wg_ref, wu_ref = refs[:n_in]
        tables = (start_ref, size_ref)
        e = exp_ref[g]
    fcols = j * block_f + jnp.arange(block_f, dtype=jnp.int32)
    fs = pl.ds(j * block_f, block_f)

    def body(rows, ok):
        if tok_ref is None:
            tok = jnp.zeros((block_m,), jnp.int32)
        else:
            tok = plgpu.load(tok_ref.at[rows], mask=ok, other=0)  # (M,)

        def dot_step(kcols, k):
            x = plgpu.load(h_ref.at[tok[:, None], kcols[None, :]], mask=ok[:, None], other=0)  # (M, K)
            if trans:  # (X, F, E): the tile's F rows are contiguous over the hidden axis
                wg = plgpu.load(wg_ref.at[e, fs, pl.ds(k, block_k)])  # (F, K)
                wu = plgpu.load(wu_ref.at[e, fs, pl.ds(k, block_k)])
                return plgpu.dot(x, wg, trans_b=True), plgpu.dot(x, wu, trans_b=True)
            wg = plgpu.load(wg_ref.at[e, pl.ds(k, block_k), fs])  # (K, F)
            wu = plgpu.load(wu_ref.at[e, pl.ds(k, block_k), fs])
            return plgpu.dot(x, wg), plgpu.dot(x, wu)

        gate, up = _k_sum(h_ref.shape[1] // block_k, block_k, block_m, block_f, dot_step, 2)  # (M, F) each
        y = (act(gate) * up).astype(out_ref.dtype)
        plgpu.store(out_ref.at[rows[:, None], fcols[None, :]], y, mask=ok[:, None])

    _each_chunk(tables, g, block_m, body)


def _down_kernel(*refs, block_m, block_k, block_e, single, trans=False):
    if single:
        exp_ref, w_ref, a_ref, wd_ref, out_ref = refs
        tables = None
    else:
        exp_ref, start_ref, size_ref, w_ref, a_ref, wd_ref, out_ref = refs
        tables = (start_ref, size_ref)
    g, j = pl.program_id(0), pl.program_id(1)
    e = exp_ref[g]
    ecols = j * block_e + jnp.arange(block_e, dtype=jnp.int32)

    def body(rows, ok):
        def dot_step(kcols, k):
            a = plgpu.load(a_ref.at[rows[:, None], kcols[None, :]], mask=ok[:, None], other=0)  # (M, K)
            if trans:  # (X, E, F)
                wd = plgpu.load(wd_ref.at[e, pl.ds(j * block_e, block_e), pl.ds(k, block_k)])  # (E, K)
                return (plgpu.dot(a, wd, trans_b=True),)
            wd = plgpu.load(wd_ref.at[e, pl.ds(k, block_k), pl.ds(j * block_e, block_e)])  # (K, E)
            return (plgpu.dot(a, wd),)

        (y,) = _k_sum(a_ref.shape[1] // block_k, block_k, block_m, block_e, dot_step, 1)
        w = plgpu.load(w_ref.at[rows], mask=ok, other=0.0)  # (M,) routing weights
        plgpu.store(out_ref.at[rows[:, None], ecols[None, :]], y * w[:, None], mask=ok[:, None])

    _each_chunk(tables, g, block_m, body)


def _keys(x):
    """_top_keys' keys of the X float32 logits x (X a power of two, single_supported)."""
    num = x.shape[0]
    low = num - 1
    bits = lax.bitcast_convert_type(x, jnp.int32)
    mono = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # signed-int order = the floats' order
    return (mono & jnp.int32(~low)) | (low - jnp.arange(num, dtype=jnp.int32))


def _top_keys(x, top_k):
    """The top_k of the X logits x as (X,) int32 keys, every key distinct, and the top_k largest keys in descending
    order (a list of scalars): a key orders as its logit (the float's bits made order-preserving as a signed int, the
    low log2(X) bits cleared) and then by the lower index (those bits: X - 1 - index). The experts of bf16 logits
    (exact in float32, low 16 bits zero) come out exactly as lax.top_k over the softmax; float32 logits closer than
    2^-16 relative tie to the lower index. k max-reductions over X, not an (X, X) compare."""
    keys = _keys(x)
    top, m = [], jnp.int32(jnp.iinfo(jnp.int32).max)
    for _ in range(top_k):
        m = jnp.max(jnp.where(keys < m, keys, jnp.iinfo(jnp.int32).min))
        top.append(m)
    return keys, top


def _routing(x, live, keys, top, *, renormalize):
    """One token's routing, as kiln.models.moe.route, from _top_keys(x, k)'s keys and top: softmax over the X float32
    logits x, the top k experts by probability (ties to the lower index, as lax.top_k) in descending order, (k,)
    int32, and their probabilities (renormalised over the k) times live (0 for a padding row), (k,) float32."""
    num, top_k = x.shape[0], len(top)
    ex = jnp.exp(x - jnp.max(x))
    scale = live / jnp.sum(jnp.where(keys >= top[-1], ex, 0.0) if renormalize else ex)
    ids, slots = jnp.arange(num, dtype=jnp.int32), jnp.arange(top_k, dtype=jnp.int32)
    experts, pair_w = jnp.zeros((top_k,), jnp.int32), jnp.zeros((top_k,), jnp.float32)
    for i, m in enumerate(top):
        e = (num - 1) - (m & (num - 1))
        experts = jnp.where(slots == i, e, experts)
        pair_w = jnp.where(slots == i, jnp.sum(jnp.where(ids == e, ex, 0.0)), pair_w)
    return experts, pair_w * scale


def _logits(logit_ref, num_experts, partial):
    """The token's X router logits as float32: row 0 of the router's output (partial None), or the sum of the
    router_logits kernel's float32 partial rows rounded to `partial` (the router's dtype, as its GEMM would)."""
    if partial is None:
        return logit_ref[pl.ds(0, num_experts)].astype(jnp.float32)
    return jnp.sum(logit_ref[...], axis=0).astype(partial).astype(jnp.float32)


def _route_kernel(logit_ref, live_ref, exp_ref, w_ref, *, num_experts, top_k, renormalize, partial=None):
    """_routing in a kernel of its own (experts_single(fused_route=False)). w_ref's rows past the k stay unwritten:
    the down kernel masks them."""
    x = _logits(logit_ref, num_experts, partial)
    experts, pair_w = _routing(x, live_ref[0], *_top_keys(x, top_k), renormalize=renormalize)
    exp_ref[...] = experts
    w_ref[pl.ds(0, top_k)] = pair_w


def _router_kernel(h_ref, w_ref, out_ref, *, block):
    """Program s: the float32 partial logits of hidden rows s * block .. + block, h's row 0 times those router rows
    (an elementwise product summed over the rows: one token needs no MMA)."""
    s = pl.program_id(0)
    rows = pl.ds(s * block, block)
    x = h_ref[0, rows].astype(jnp.float32)  # (B,)
    w = w_ref[rows, :].astype(jnp.float32)  # (B, X)
    out_ref[s, :] = jnp.sum(x[:, None] * w, axis=0)


def router_block(hidden: int, num_experts: int, want: int = 128) -> int | None:
    """router_logits' rows per program for a (hidden, X) router: `want` or fewer (powers of two, dividing hidden into
    a power-of-two count of programs), None where none does (hidden or X not a power of two: XLA's GEMM routes)."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    if not (pow2(hidden) and pow2(num_experts)):
        return None
    return min(want, hidden)


def _router_split(router, want: int, who: str) -> tuple[int, int]:
    """(rows per program, programs) of a router kernel over router (E, X), or one sentence why it cannot run."""
    hidden, num_experts = router.shape
    block = router_block(hidden, num_experts, want)
    if block is None:
        raise ValueError(f"{who}: hidden {hidden} and {num_experts} experts must be powers of two")
    return block, hidden // block


def router_logits(h, router, *, block=128, interpret=False):
    """One token's router logits as (hidden / block, X) float32 partial sums, row s = h[0, s B:(s + 1) B] @ router[s B:
    (s + 1) B]: one launch (XLA's 1-token router is a split-K GEMM and a reduction, two), the rows added inside the
    gate_up (or route) kernel, experts_single(partial_logits=True). h (1, E); router (E, X)."""
    num_experts = router.shape[1]
    block, split = _router_split(router, block, "router_logits")
    return pl.pallas_call(
        functools.partial(_router_kernel, block=block),
        out_shape=jax.ShapeDtypeStruct((split, num_experts), jnp.float32),
        grid=(split,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(h, router)


def _block(dim: int, want: int) -> int:
    b = min(want, dim)
    if dim % b:
        raise ValueError(f"MoE kernel: dimension {dim} is not a multiple of the block {b}")
    return b


def _experts(tables, pair_w, h, w_gate, w_up, w_down, act, rows, *, groups, interpret, block_m, block_n, num_warps,
             num_stages, route=None, block_k=128, down_block_n=None, down_block_k=None, weights_t=False):  # fmt: skip
    """The gate_up and down kernels over `groups` groups: y (rows, E) float32, each pair's row scaled by its weight.
    tables: (expert, first pair, pairs, token) of the groups, or (expert,) alone: one pair per group; or route (one
    token routed inside gate_up): tables = (logits (X,), live (1,)), and gate_up writes the experts and pair_w.
    weights_t: w_gate, w_up (X, F, E) and w_down (X, E, F)."""
    num_experts, hidden, width = w_gate.shape
    if weights_t:
        num_experts, width, hidden = w_gate.shape
    single = len(tables) == 1 or route is not None
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    bk, bf = _block(hidden, block_k), _block(width, block_n)
    out_shape = [jax.ShapeDtypeStruct((rows, width), h.dtype)]
    if route is not None:
        out_shape += [jax.ShapeDtypeStruct((groups,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32)]
    act_rows, *routed = pl.pallas_call(
        functools.partial(
            _gate_up_kernel,
            block_m=block_m,
            block_k=bk,
            block_f=bf,
            single=single,
            act=act,
            route=route,
            trans=weights_t,
        ),
        out_shape=out_shape,
        grid=(groups, width // bf),
        interpret=interpret,
        compiler_params=params,
    )(*tables, h, w_gate, w_up)
    if route is not None:
        tables, pair_w = (routed[0],), routed[1]
    bk, be = _block(width, down_block_k or block_k), _block(hidden, down_block_n or block_n)
    return pl.pallas_call(
        functools.partial(_down_kernel, block_m=block_m, block_k=bk, block_e=be, single=single, trans=weights_t),
        out_shape=jax.ShapeDtypeStruct((rows, hidden), jnp.float32),
        grid=(groups, hidden // be),
        interpret=interpret,
        compiler_params=params,
    )(*tables[:3], pair_w, act_rows, w_down)


def experts_grouped(
    h, w_gate, w_up, w_down, weights, experts, act, *, interpret=False, block_m=16, block_n=64, num_warps=4,
    num_stages=3,
):  # fmt: skip
    """Every token through its k experts: (T, E). h (T, E); w_gate, w_up (X, E, F); w_down (X, F, E); weights,
    experts (T, k), as kiln.models.moe.experts_dense."""
    t, k = experts.shape
    num_experts = w_gate.shape[0]
    pairs = t * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # (P,) pair indices sorted by expert
    # Groups: the distinct experts in sorted order, at most min(P, X) of them (a decode's grid covers only those).
    groups = min(pairs, num_experts)
    e_sorted = flat[order]
    first = jnp.concatenate([jnp.ones((1,), bool), e_sorted[1:] != e_sorted[:-1]])  # (P,) a group's first pair
    gid = jnp.cumsum(first.astype(jnp.int32)) - 1  # (P,) each sorted pair's group
    at = jnp.where(first, gid, groups)  # the other pairs fall outside and are dropped
    g_expert = jnp.zeros((groups,), jnp.int32).at[at].set(e_sorted, mode="drop")
    g_start = jnp.zeros((groups,), jnp.int32).at[at].set(jnp.arange(pairs, dtype=jnp.int32), mode="drop")
    g_size = jnp.zeros((groups,), jnp.int32).at[gid].add(1)  # 0 for the groups past the last expert
    pad = block_m  # a chunk's rows past the last pair stay inside the buffers (masked on the GPU, the interpreter
    #                writes back what is there)
    token = jnp.pad(order // k, (0, pad))  # (P + pad,)
    pair_w = jnp.pad(weights.reshape(-1)[order].astype(jnp.float32), (0, pad))
    opts = dict(interpret=interpret, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    y = _experts((g_expert, g_start, g_size, token), pair_w, h, w_gate, w_up, w_down, act, pairs + pad,
                 groups=groups, **opts)  # fmt: skip
    return jnp.zeros((t, h.shape[1]), jnp.float32).at[token[:pairs]].add(y[:pairs]).astype(h.dtype)


def single_supported(num_experts: int, top_k: int) -> bool:
    """Can experts_single route top_k of num_experts (Triton's blocks are powers of two)."""
    return num_experts & (num_experts - 1) == 0 and top_k & (top_k - 1) == 0


def default_block_k() -> int:
    """experts_single's K tile for gate_up: 256 on GPUs whose blocks get ~228 KB of shared memory (compute capability
    9.x and 10.x of an NVIDIA GPU: H100, H200, B200; 3 stages of 256-deep tiles take ~216 KB), else 128, also where
    no GPU is attached (lowering for cuda on another machine). H200, Qwen3-30B-A3B at one token (session 12, 8
    layers, with down's K tile left at 128): the layer's kernels 0.642 against 0.651 ms a token, gate_up 15.8 against
    16.8 us a layer."""
    try:
        device = jax.devices()[0]
    except RuntimeError:  # no backend
        return 128
    capability = str(getattr(device, "compute_capability", ""))
    nvidia = str(getattr(device, "device_kind", "")).startswith("NVIDIA")
    return 256 if nvidia and capability.split(".")[0] in ("9", "10") else 128


def experts_single(
    h, logits, live, w_gate, w_up, w_down, top_k, renormalize, act, *, interpret=False, block_m=16, block_n=64,
    num_warps=4, num_stages=3, fused_route=True, rank_compare=False, block_k=None, down_block_n=None,
    down_block_k=None, partial_logits=False, weights_t=False, combine=True,
):  # fmt: skip
    """One token routed and through its top_k experts: (1, E). h (1, E); logits (R, X), the router's in its dtype, of
    which the kernels read row 0 (R = 2: XLA's 2-row GEMM, whose row 0 is then not sliced out first) and cast it to
    float32; live (1,) bool (False: a padding row, weight 0); weights as experts_grouped.
    fused_route: the routing inside the gate_up kernel (every program ranks the X logits; two launches a layer), else
    in a kernel of its own (three); rank_compare (measurement only): gate_up ranks by an (X, X) compare; block_k: both
    kernels' K tile (H200, Qwen3-30B-A3B: 256 takes gate_up 17.2 -> 16.2 us and down 8.3 -> 8.8, in ~216 KB of shared
    memory at 3 stages, which smaller GPUs lack), None: default_block_k(), with down's K tile 128 unless given;
    down_block_n, down_block_k: down's output and K tiles (default block_n, block_k); partial_logits: logits are
    router_logits' (S, X) float32 partial rows, which the kernels add and round to h's dtype; weights_t (measurement
    only; no loader lays them out so): the experts stored transposed, w_gate and w_up (X, F, E), w_down (X, E, F),
    each program's weights one contiguous block (H200: no faster, gate_up 17.6 us); combine=False: the k weighted rows
    (k, E) float32, not their sum (for a kernel that adds them to the residual and norms, pallas_gpu.add_rms_norm).
    Measured and removed (session 13, H200, 8 layers, us a layer): gate_up's hidden axis split in 4 (split-K over 384
    programs, the 132 SMs evenly loaded, float32 partial rows that down added): gate_up 15.9 -> 16.9 at K 128 (15.3 at
    K 64) and down 8.2 -> 9.1; Nsight Compute: the kernels stream ~3.5 TB/s while their SMs run and lose ~2-3 us a
    launch outside that, which more programs do not shorten (BENCHMARKS.md, issue 18)."""
    num_experts = w_gate.shape[0]
    # the chunk of pair g holds rows g .. g + block_m - 1 (masked past g); the interpreter writes back what is there,
    # so its buffers hold them, while on the GPU the k rows alone are (combine=False: no slice for XLA to copy)
    pad = block_m if combine or interpret else 0
    if block_k is None:
        block_k, down_block_k = default_block_k(), down_block_k or 128
    opts = dict(interpret=interpret, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                block_k=block_k, down_block_n=down_block_n, down_block_k=down_block_k, weights_t=weights_t)  # fmt: skip
    partial = h.dtype if partial_logits else None
    live = live.astype(jnp.float32)
    if not partial_logits:
        logits = logits.reshape(-1)  # row 0's X logits first
    if fused_route:
        route = dict(top_k=top_k, renormalize=renormalize, rank_compare=rank_compare, partial=partial)
        y = _experts((logits, live), None, h, w_gate, w_up, w_down, act, top_k + pad, groups=top_k, route=route,
                     **opts)  # fmt: skip
        return y[:top_k].sum(axis=0, keepdims=True).astype(h.dtype) if combine else y[:top_k]
    experts, pair_w = pl.pallas_call(
        functools.partial(
            _route_kernel, num_experts=num_experts, top_k=top_k, renormalize=renormalize, partial=partial
        ),
        out_shape=[jax.ShapeDtypeStruct((top_k,), jnp.int32), jax.ShapeDtypeStruct((top_k + pad,), jnp.float32)],
        grid=(1,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(logits, live)
    y = _experts((experts,), pair_w, h, w_gate, w_up, w_down, act, top_k + pad, groups=top_k, **opts)
    return y[:top_k].sum(axis=0, keepdims=True).astype(h.dtype) if combine else y[:top_k]


# ---- the glue of a Qwen3-MoE decode layer, folded into kernels -----------------------------------------------------
#
# At batch 1 XLA runs the residual add + RMSNorm in front of the MoE as two launches (a reduction fusion with the add,
# then the scaling: ~3.9 + 1.3 us a layer on an H200, session 11) and Qwen3's q/k norms + RoPE + the v slice between the
# q|k|v GEMM and the attention as ~7 small fusions (~8 us). router_add_norm folds the first into the router's launch;
# qk_norm_rope makes the second one launch that writes the fused, rotated qkv the decode attention reads.


def _router_add_norm_kernel(x_ref, o_ref, nw_ref, w_ref, xo_ref, h_ref, out_ref, *, block, eps, partials):
    """Program s: x' = x + o (o: row 0 of the o-proj's output, or the sum of its float32 partial rows rounded to x's
    dtype), h = rms_norm(x') * norm weight, both for hidden rows s * block .. + block, and the float32 partial logits
    of those rows of h (_router_kernel). Every program sums the squares of the whole row (E values: cheap) so that no
    program waits on another."""
    s = pl.program_id(0)
    hidden = x_ref.shape[1]
    rows = pl.ds(s * block, block)

    def o_rows(cols):
        if partials:
            return jnp.sum(o_ref[:, cols], axis=0).astype(x_ref.dtype)  # as the GEMM's split-K sum rounds it
        return o_ref[0, cols]

    xs = x_ref[0, :] + o_rows(slice(None))  # (E,) in the activations' dtype, rounded as XLA's add
    x32 = xs.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(x32 * x32) / hidden + eps)
    xb = x_ref[0, rows] + o_rows(rows)  # (B,)
    hb = (xb.astype(jnp.float32) * inv).astype(xb.dtype) * nw_ref[rows]  # transformer.rms_norm's roundings
    xo_ref[0, rows] = xb
    h_ref[0, rows] = hb
    w = w_ref[rows, :].astype(jnp.float32)  # (B, X)
    out_ref[s, :] = jnp.sum(hb.astype(jnp.float32)[:, None] * w, axis=0)


def router_add_norm(x, o, norm_w, router, eps: float, *, block=128, partials=False, interpret=False):
    """One token's residual add, RMSNorm and router logits in one launch: x (1, E) the residual, o (R, E) the
    attention's o-proj output of which row 0 is read (R = 2: the 2-row GEMM, no slice in front), or with partials
    its float32 partial rows (S, E) (gemv_partials), added and rounded to x's dtype; norm_w (E,), router (E, X).
    Returns x' = x + o[0] (1, E), h = transformer.rms_norm(x', norm_w, eps) (1, E) and router_logits(h, router)'s
    (E / block, X) float32 partial rows (experts_single(partial_logits=True) adds them)."""
    num_experts = router.shape[1]
    block, split = _router_split(router, block, "router_add_norm")
    return pl.pallas_call(
        functools.partial(_router_add_norm_kernel, block=block, eps=float(eps), partials=partials),
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct((split, num_experts), jnp.float32),
        ],
        grid=(split,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="kiln_router_add_norm",
    )(x, o, norm_w.astype(x.dtype), router)


def _gemv_kernel(x_ref, w_ref, out_ref, *, block_k, block_n, steps):
    """Program (s, j): x's row 0 times w's rows s * steps * block_k .. (steps K tiles) in columns tile j, in float32:
    partial row s's columns tile j. An MMA of 16 rows, x's row 0 and 15 masked to zero, as the experts' kernels run
    one token (the dot's smallest tile); the 16 rows summed at the end are row 0."""
    s, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * block_n, block_n)
    r = jnp.arange(16, dtype=jnp.int32)

    def kstep(i, acc):
        k = (s * steps + i) * block_k
        kcols = k + jnp.arange(block_k, dtype=jnp.int32)
        x = plgpu.load(x_ref.at[(r * 0)[:, None], kcols[None, :]], mask=(r < 1)[:, None], other=0)  # (16, K)
        return acc + plgpu.dot(x, plgpu.load(w_ref.at[pl.ds(k, block_k), cols]))

    acc = lax.fori_loop(0, steps, kstep, jnp.zeros((16, block_n), jnp.float32))
    out_ref[s, cols] = jnp.sum(acc, axis=0)


def gemv_partials(x, w, *, splits=4, block_k=256, block_n=64, num_warps=4, num_stages=3, interpret=False):
    """One row's product x (R, K) row 0 @ w (K, N) as `splits` float32 partial rows (splits, N) over equal runs of K
    (their sum is the product, as a split-K GEMM's partials): grid (splits, N / block_n), for router_add_norm(partials=
    True) to add, so that no reduction runs between them. None where the shapes do not divide. (H200, Qwen3-30B-A3B's
    o-proj, session 13: 6.5 us, 6.4 at 5 stages, 6.4 at 8 rows of K 128; XLA's 2-row GEMM 6.5 + reduction 1.2.)"""
    k, n = w.shape
    if k % (splits * block_k) or n % block_n:
        return None
    return pl.pallas_call(
        functools.partial(_gemv_kernel, block_k=block_k, block_n=block_n, steps=k // (splits * block_k)),
        out_shape=jax.ShapeDtypeStruct((splits, n), jnp.float32),
        grid=(splits, n // block_n),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="kiln_gemv_partials",
    )(x, w)


def _qk_norm_rope_kernel(qkv_ref, qn_ref, kn_ref, cos_ref, sin_ref, out_ref, *, kv_heads, slots, head_dim, eps, rows):
    """Program t: token t's KVH * S rows of D (fused qkv: each KV head's G query rows, its key, its value): q and k
    rows RMS-normed over D by q_norm / k_norm and rotated (RoPE by halves), v rows copied."""
    half = head_dim // 2
    r = jnp.arange(rows, dtype=jnp.int32)  # padded to a power of two
    ok = (r < kv_heads * slots)[:, None]
    slot = r % slots
    is_q, is_v = (slot < slots - 2)[:, None], (slot == slots - 1)[:, None]
    c = jnp.arange(half, dtype=jnp.int32)
    i1 = r[:, None] * head_dim + c[None, :]  # (R, D/2) the first halves, then the second
    i2 = i1 + half
    x1 = plgpu.load(qkv_ref.at[i1], mask=ok, other=0)
    x2 = plgpu.load(qkv_ref.at[i2], mask=ok, other=0)
    dtype = x1.dtype
    a1, a2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    inv = lax.rsqrt((jnp.sum(a1 * a1, axis=1) + jnp.sum(a2 * a2, axis=1)) / head_dim + eps)[:, None]  # (R, 1)
    w1 = jnp.where(is_q, qn_ref[pl.ds(0, half)][None, :], kn_ref[pl.ds(0, half)][None, :])
    w2 = jnp.where(is_q, qn_ref[pl.ds(half, half)][None, :], kn_ref[pl.ds(half, half)][None, :])
    y1 = (a1 * inv).astype(dtype) * w1  # transformer.rms_norm's roundings
    y2 = (a2 * inv).astype(dtype) * w2
    cos, sin = cos_ref[...][None, :], sin_ref[...][None, :]  # (1, D/2)
    r1 = (y1 * cos).astype(dtype) - (y2 * sin).astype(dtype)  # transformer.rope
    r2 = (y2 * cos).astype(dtype) + (y1 * sin).astype(dtype)
    plgpu.store(out_ref.at[i1], jnp.where(is_v, x1, r1.astype(dtype)), mask=ok)
    plgpu.store(out_ref.at[i2], jnp.where(is_v, x2, r2.astype(dtype)), mask=ok)


def qk_norm_rope(qkv, q_norm, k_norm, cos, sin, eps: float, *, kv_heads: int, head_dim: int, interpret=False):
    """Qwen3's q/k RMSNorms and RoPE of a fused q|k|v in one launch (one program a token): qkv (T, (H + 2 KVH) D),
    the q|k|v GEMM's output in kiln.models.transformer.fuse_linears's layout (each KV head's G query heads, its key,
    its value); q_norm, k_norm (D,); cos, sin (T, 1, D/2) (transformer.rope_tables). Returns (T, KVH, G + 2, D): q and
    k normed and rotated, v as it is; transformer.rms_norm and transformer.rope's values (a float32 sum of squares in
    another order)."""
    num_tokens, width = qkv.shape
    slots = width // (kv_heads * head_dim)
    rows = 1 << (kv_heads * slots - 1).bit_length()
    half = head_dim // 2
    tok = pl.BlockSpec((None, width), lambda t: (t, 0))
    vec = pl.BlockSpec((head_dim,), lambda t: (0,))
    tab = pl.BlockSpec((None, None, half), lambda t: (t, 0, 0))
    out = pl.pallas_call(
        functools.partial(
            _qk_norm_rope_kernel, kv_heads=kv_heads, slots=slots, head_dim=head_dim, eps=float(eps), rows=rows
        ),
        grid=(num_tokens,),
        in_specs=[tok, vec, vec, tab, tab],
        out_specs=tok,
        out_shape=jax.ShapeDtypeStruct(qkv.shape, qkv.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="kiln_qk_norm_rope",
    )(qkv, q_norm.astype(qkv.dtype), k_norm.astype(qkv.dtype), cos.astype(qkv.dtype), sin.astype(qkv.dtype))
    return out.reshape(num_tokens, kv_heads, slots, head_dim)
