"""A static roofline of compiled programs: what XLA says a program moves and computes, against what it must.

For every step and decode program, XLA's cost analysis of the compiled executable (bytes accessed, flops) and its
memory analysis (arguments, outputs, aliased, temporaries) are set beside the program's ideal figures:

* ideal bytes = weights (every weight once per forward; an untied embedding only its T gathered rows) + KV read
  (every page the bucket's S sequences can reach, min(num_pages, S * max_pages_per_seq), K and V of every layer) +
  KV written (T new tokens' K and V of every layer); a decode program of n steps pays them n times;
* ideal flops = 2 * T * (matmul weights) + the LM head on S rows + QK^T and PV over the reachable context.

Every figure is per device (the executables are SPMD: one device's program) and from the program's logical shapes,
so a layout that pads (a head_dim of 64 in 128 lanes) shows as a ratio above 1. The KV read is a worst case (every
sequence at its full length): a static analysis cannot know the lengths, and the attention kernels declare the same
worst case to XLA (pl.CostEstimate), so the ratio measures what XLA adds around them: copies of the cache, layout
changes, upcasts, rematerialised activations.

`roofline` works on any jax.stages.Compiled (TPU compiled deviceless, CUDA on the GPU, CPU); `top_movers` lists the
instructions of the optimized HLO that move the most bytes, to find what a high ratio is made of.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp

from kiln.compile.executable import Program
from kiln.models.config import ModelConfig
from kiln.models.sampling import SamplingBatch, sample

# A program may move this many times its ideal bytes before `kiln compile` flags it.
BYTES_RATIO_LIMIT = 1.3


def _shard_bytes(a: jax.ShapeDtypeStruct) -> int:
    shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
    bits = 4 if a.dtype in (jnp.int4, jnp.uint4) else 8 * jnp.dtype(a.dtype).itemsize
    return math.prod(shape) * bits // 8


def _steps(program: Program) -> int:
    """Forward passes per call: a decode program's StepOut leaves have a leading (steps,) axis."""
    tokens = program.out[0].tokens
    return tokens.shape[0] if len(tokens.shape) == 2 else 1


def ideal(cfg: ModelConfig, program: Program) -> dict:
    """The bytes and flops one call of a step or decode program cannot do without, per device (see the module
    docstring). program.args = (weights, kv, batch, sampling) with shardings."""
    weights, kv, batch, _ = program.args
    num_tokens, (num_seqs, max_pages) = batch.token_ids.shape[0], batch.block_tables.shape
    steps = _steps(program)
    w_bytes = sum(_shard_bytes(a) for a in jax.tree.leaves(weights))
    if not cfg.tie_word_embeddings:  # the embedding is gathered: T rows of it
        embed = jax.tree.leaves(weights.embed)
        rows = num_tokens / cfg.vocab_size
        w_bytes -= sum(_shard_bytes(a) - int(_shard_bytes(a) * rows) for a in embed)
    k0 = kv.k[0]
    kvh, num_pages, page_size, head_dim = k0.sharding.shard_shape(k0.shape) if k0.sharding else k0.shape
    row = kvh * head_dim * jnp.dtype(k0.dtype).itemsize  # one token's K (or V) of one layer, this device's heads
    pages = min(num_pages, num_seqs * max_pages)
    kv_read = 2 * cfg.num_layers * pages * page_size * row
    kv_write = 2 * cfg.num_layers * num_tokens * row
    # flops: dense matmuls per token (this device's share: weight elements / bytes per element), the LM head on S rows
    matmul = sum(
        math.prod(a.sharding.shard_shape(a.shape) if a.sharding else a.shape)
        for layer in weights.layers
        for a in jax.tree.leaves(layer)
        if len(a.shape) >= 2
    )
    if cfg.num_experts:  # an MoE layer runs k of its experts per token
        matmul = matmul * cfg.num_experts_per_tok // cfg.num_experts
    head = weights.embed if cfg.tie_word_embeddings else weights.lm_head
    head_elems = math.prod(jax.tree.leaves(head)[0].sharding.shard_shape(jax.tree.leaves(head)[0].shape))
    context = min(max_pages, num_pages) * page_size
    heads = kvh * (cfg.num_heads // cfg.num_kv_heads)
    attn = 4 * num_tokens * heads * head_dim * context * cfg.num_layers
    flops = 2 * num_tokens * matmul + 2 * num_seqs * head_elems + attn
    total = w_bytes + kv_read + kv_write
    return {
        "weights": int(w_bytes) * steps,
        "kv_read": kv_read * steps,
        "kv_write": kv_write * steps,
        "bytes": int(total) * steps,
        "flops": int(flops) * steps,
    }


def static_cost(compiled: jax.stages.Compiled) -> dict:
    """XLA's cost analysis (bytes accessed, flops) and memory analysis of a compiled executable, per device; a
    figure the backend does not report is None."""
    out = {"bytes": None, "flops": None, "transcendentals": None}
    try:
        ca = compiled.cost_analysis()
    except Exception:  # a backend without a cost model
        ca = None
    if isinstance(ca, list | tuple):  # older jax: one dict per computation
        ca = ca[0] if ca else None
    if ca:
        out.update(bytes=ca.get("bytes accessed"), flops=ca.get("flops"), transcendentals=ca.get("transcendentals"))
        out = {k: (int(v) if v is not None else None) for k, v in out.items()}
    try:
        m = compiled.memory_analysis()
    except Exception:
        m = None
    if m is not None:
        for f in ("argument", "output", "alias", "temp"):
            out[f"{f}_bytes"] = int(getattr(m, f"{f}_size_in_bytes"))
    return out


def sampler_cost(cfg: ModelConfig, program: Program) -> dict:
    """XLA's static cost of the step's sampler alone ((S, V) float32 logits -> tokens), compiled for the program's
    devices: what to take off a program's figure to see the model's. On TPU, XLA's cost model charges the sampler's
    lax.cond branches about ten times over (cond(x + 1 | x) on 1.6 MB of logits: 15.7 MB), so at a small model's
    sizes the sampler would drown the forward pass's figures."""
    batch = program.args[2]
    return _sampler_cost(batch.block_tables.shape[0], cfg.vocab_size, batch.token_ids.sharding)


@functools.cache
def _sampler_cost(num_seqs: int, vocab: int, sharding) -> dict:
    logits = jax.ShapeDtypeStruct((num_seqs, vocab), jnp.float32, sharding=sharding)
    positions = jax.ShapeDtypeStruct((num_seqs,), jnp.int32, sharding=sharding)
    sampling = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), SamplingBatch.abstract(num_seqs, vocab)
    )
    compiled = jax.jit(sample).lower(logits, sampling, positions).compile()
    return static_cost(compiled)


def roofline(cfg: ModelConfig, program: Program, compiled: jax.stages.Compiled, with_sampler: bool = True) -> dict:
    """The manifest's figures for one program: XLA's static cost, the ideal, and their ratios.

    bytes_ratio: the whole program's bytes over the ideal; model_bytes_ratio: the same without the sampler's cost
    (sampler_cost, compiled alone for the program's S and V). XLA costs a loop's body once, so a decode program of n
    steps is set against one step's ideal (its figures in `ideal` are for all n)."""
    want, got = ideal(cfg, program), static_cost(compiled)
    steps = _steps(program)
    ratio = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
    out = {
        "static": got,
        "ideal": want,
        "steps": steps,
        "bytes_ratio": ratio(got["bytes"], want["bytes"] / steps),
        "flops_ratio": ratio(got["flops"], want["flops"] / steps),
    }
    if with_sampler and got["bytes"] is not None:
        sampler = sampler_cost(cfg, program)
        out["sampler_bytes"] = sampler["bytes"]
        if sampler["bytes"] is not None:
            out["model_bytes_ratio"] = ratio(got["bytes"] - sampler["bytes"], want["bytes"] / steps)
    return out


def is_step(program: Program) -> bool:
    """Whether a program is a step or decode program (the ones with a roofline)."""
    return len(program.args) == 4 and hasattr(program.args[2], "block_tables")


def format_line(name: str, r: dict) -> str:
    """One line for `kiln compile`'s output."""
    s, i = r["static"], r["ideal"]
    mb = lambda b: f"{b / 1e6:.1f} MB" if b is not None else "?"  # noqa: E731
    model = r.get("model_bytes_ratio")
    judged = model if model is not None else r["bytes_ratio"]
    flag = "" if judged is None or judged <= BYTES_RATIO_LIMIT else f"  (above {BYTES_RATIO_LIMIT}x)"
    n = r["steps"]
    sampler = f", sampler {mb(r['sampler_bytes'])}" if r.get("sampler_bytes") is not None else ""
    without = f", {model}x without the sampler" if model is not None else ""
    return (
        f"{name}: XLA counts {mb(s['bytes'])}{f' per step of {n}' if n > 1 else ''}{sampler} vs ideal "
        f"{mb(i['bytes'] / n)} (weights {mb(i['weights'] / n)}, KV read {mb(i['kv_read'] / n)}, written "
        f"{mb(i['kv_write'] / n)}): {r['bytes_ratio']}x bytes{without}, {r['flops_ratio']}x flops{flag}"
    )


# ---- what a high ratio is made of: the optimized HLO's biggest movers ----

_SHAPE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)\[([0-9,]*)\]"
                    r"(\{[^}]*\})?")  # fmt: skip
_BITS = {"pred": 8, "s4": 4, "u4": 4, "f8e4m3fn": 8, "f8e5m2": 8}
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")


def _bytes_of(shape_text: str) -> int:
    """Bytes of every array in an HLO shape (a tuple sums its elements), with TPU tiles' padding where the layout
    names them (T(8,128): the minor dims padded to 8 x 128)."""
    total = 0
    for dtype, dims, layout in _SHAPE.findall(shape_text):
        shape = [int(d) for d in dims.split(",") if d]
        tile = re.search(r"T\((\d+),(\d+)\)", layout or "")
        order = re.match(r"\{([0-9,]*)", layout or "")
        if tile and order and len(shape) >= 2 and order.group(1):
            minor = [int(x) for x in order.group(1).split(",")]
            a, b = int(tile.group(1)), int(tile.group(2))
            shape[minor[0]] = -(-shape[minor[0]] // b) * b
            shape[minor[1]] = -(-shape[minor[1]] // a) * a
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
        total += math.prod(shape) * bits // 8
    return total


def top_movers(hlo_text: str, n: int = 10) -> list[tuple[int, str]]:
    """The n instructions of an optimized HLO module (compiled.as_text()) outside fusions whose operands and result
    are largest, as (bytes, one-line description): where to look when a program moves more than its ideal. Sizes
    include TPU tile padding; a loop body's instructions are counted once."""
    shapes: dict[str, str] = {}
    rows = []
    fused = False
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):  # a computation's header
            fused = line.startswith("%fused") or "fused_computation" in line.split("(")[0]
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = shape
        if fused or op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        out_bytes = _bytes_of(shape)
        sizes = [_bytes_of(shapes.get(o, "")) for o in re.findall(r"%([\w.\-]+)", rest.split("), ")[0])]
        if op == "custom-call" or op == "gather" or "scatter" in name or "dynamic-update-slice" in name:
            # in place or by DMA: an operand far larger than the result is only touched in part (XLA counts it so too;
            # a Pallas kernel's share is its declared CostEstimate)
            sizes = [b for b in sizes if b <= 4 * out_bytes] if op != "fusion" else sorted(sizes)[:-1]
            out_bytes = 0 if "scatter" in name or "dynamic-update-slice" in name else out_bytes
        size = out_bytes + sum(sizes)
        meta = re.search(r'op_name="([^"]*)"', rest)
        rows.append((size, f"{op} {name} -> {shape.split('{')[0]}" + (f"  [{meta.group(1)[-80:]}]" if meta else "")))
    return sorted(rows, reverse=True)[:n]
