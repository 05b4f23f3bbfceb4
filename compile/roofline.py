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

    bytes_ratio: the whole program's bytes by XLA's count over the ideal; hbm_ratio (TPU, where XLA stages arrays in
    VMEM): its HBM bytes (`hbm_bytes`: XLA's count without that staging), the figure `kiln compile` judges there;
    model_bytes_ratio: XLA's count
    without the sampler's cost (sampler_cost, compiled alone for the program's S and V). XLA costs a loop's body once,
    so a decode program of n steps is set against one step's ideal (its figures in `ideal` are for all n)."""
    want, got = ideal(cfg, program), static_cost(compiled)
    got["hbm_bytes"] = hbm_bytes(compiled.as_text())[0] if _staged(program) else None
    steps = _steps(program)
    ratio = lambda a, b: round(a / b, 3) if a is not None and b else None  # noqa: E731
    out = {
        "static": got,
        "ideal": want,
        "steps": steps,
        "bytes_ratio": ratio(got["bytes"], want["bytes"] / steps),
        "hbm_ratio": ratio(got["hbm_bytes"], want["bytes"] / steps),
        "flops_ratio": ratio(got["flops"], want["flops"] / steps),
    }
    if with_sampler and got["bytes"] is not None:
        sampler = sampler_cost(cfg, program)
        out["sampler_bytes"] = sampler["bytes"]
        if sampler["bytes"] is not None:
            out["model_bytes_ratio"] = ratio(got["bytes"] - sampler["bytes"], want["bytes"] / steps)
    return out


def _staged(program: Program) -> bool:
    """Whether XLA may stage a program's arrays outside HBM (TPU's VMEM), so that its count exceeds the HBM traffic."""
    return any(d.platform == "tpu" for a in program.flat_args[:1] for d in a.sharding.device_set)


def is_step(program: Program) -> bool:
    """Whether a program is a step or decode program (the ones with a roofline)."""
    return len(program.args) == 4 and hasattr(program.args[2], "block_tables")


def judged_ratio(r: dict) -> float | None:
    """The ratio `kiln compile` flags above BYTES_RATIO_LIMIT: HBM bytes over the ideal (older manifests: XLA's count,
    without the sampler where known)."""
    if r.get("hbm_ratio") is not None:
        return r["hbm_ratio"]
    return r.get("model_bytes_ratio") if r.get("model_bytes_ratio") is not None else r["bytes_ratio"]


def format_line(name: str, r: dict) -> str:
    """One line for `kiln compile`'s output."""
    s, i = r["static"], r["ideal"]
    mb = lambda b: f"{b / 1e6:.1f} MB" if b is not None else "?"  # noqa: E731
    judged = judged_ratio(r)
    flag = "" if judged is None or judged <= BYTES_RATIO_LIMIT else f"  (above {BYTES_RATIO_LIMIT}x)"
    n = r["steps"]
    hbm = f"HBM {mb(s['hbm_bytes'])}, {r['hbm_ratio']}x; " if r.get("hbm_ratio") is not None else ""
    sampler = f", sampler {mb(r['sampler_bytes'])}" if r.get("sampler_bytes") is not None else ""
    model = r.get("model_bytes_ratio")
    without = f", {model}x without the sampler" if model is not None else ""
    return (
        f"{name}{f' (per step of {n})' if n > 1 else ''}: ideal {mb(i['bytes'] / n)} (weights {mb(i['weights'] / n)}, "
        f"KV read {mb(i['kv_read'] / n)}, written {mb(i['kv_write'] / n)}); {hbm}XLA counts {mb(s['bytes'])}{sampler}, "
        f"{r['bytes_ratio']}x{without}; {r['flops_ratio']}x flops{flag}"
    )


# ---- HBM bytes from the optimized HLO, and what a high ratio is made of ----
#
# XLA-TPU's cost analysis counts every operand and result of every instruction, wherever it lives. Its memory-space
# assignment stages weights and small intermediates in VMEM (an `S(1)` in the layout): the copy into VMEM is counted
# at its start and again at its done, source and destination, and the consumer's read from VMEM once more, so a
# prefetched weight counts ~5x its bytes (a 2 MB matmul weight: 10.6 MB). `hbm_bytes` counts what crosses HBM: each
# instruction's operands and results in memory space 0 (a prefetch once, on its HBM side), a fusion's operand as much
# as the fused code reads of it (slices their result; rows gathered or scattered the 8-row tile band XLA-TPU charges
# each), a result written in place only its update, a Pallas kernel its declared cost, a while's body once and a
# conditional its costliest branch. Compiled without VMEM prefetches it gives XLA's own count: within 3% on the
# pieces of tests/test_roofline.py, within 0.4% on the default tpu-v5e-8 artifact's largest programs (BENCHMARKS.md).

_SHAPE = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)\[([0-9,]*)\]"
                    r"(\{[^}]*\})?")  # fmt: skip
_BITS = {"pred": 8, "s4": 4, "u4": 4, "f8e4m3fn": 8, "f8e5m2": 8}
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) ")
_FREE = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-done", "slice-done", "after-all",
         "opt-barrier", "partition-id", "replica-id", "add-dependency", "async-done")  # fmt: skip
_VIEW = ("bitcast", "reshape", "get-tuple-element")
_SLICE = ("slice", "dynamic-slice", "gather")
_IN_PLACE = ("dynamic-update-slice", "scatter")


def _arrays(shape_text: str) -> list[tuple[int, int]]:
    """(bytes, memory space) of every array in an HLO shape (a tuple: each element), with TPU tiles' padding where the
    layout names them (T(8,128): the minor dims padded to 8 x 128)."""
    out = []
    for dtype, dims, layout in _SHAPE.findall(shape_text):
        shape = [int(d) for d in dims.split(",") if d]
        tile = re.search(r"T\(([0-9,]+)\)", layout or "")
        order = re.match(r"\{([0-9,]*)", layout or "")
        if tile and order and order.group(1):  # T(8,128): the two minor dims padded to 8 x 128; T(256): the minor one
            minor = [int(x) for x in order.group(1).split(",")]
            for dim, size in zip(minor, reversed([int(t) for t in tile.group(1).split(",")]), strict=False):
                shape[dim] = -(-shape[dim] // size) * size
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append((math.prod(shape) * bits // 8, int(space.group(1)) if space else 0))
    return out


def _space_bytes(shape_text: str, spaces: tuple[int, ...]) -> int:
    return sum(b for b, s in _arrays(shape_text) if s in spaces)


def _bytes_of(shape_text: str) -> int:
    """Bytes of every array in an HLO shape, any memory space."""
    return sum(b for b, _ in _arrays(shape_text))


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction: the %names of its argument list (optimized HLO prints no shapes there)."""
    return re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])


def _parse(hlo_text: str) -> tuple[dict, dict]:
    """{computation: [instruction dicts]} with the entry's name under None, and {instruction name: instruction dict}."""
    comps: dict = {}
    instrs: dict = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            m = _HEADER.match(line)
            current = m.group(2) if m else None
            if m:
                comps[current] = []
                if m.group(1):
                    comps[None] = current
            continue
        m = _INSTR.match(line)
        if m and current:
            root, name, shape, op, rest = m.groups()
            instr = {
                "name": name,
                "shape": shape,
                "op": op,
                "rest": rest,
                "root": bool(root),
                "operands": _operands(rest),
            }
            comps[current].append(instr)
            instrs[name] = instr
    return comps, instrs


def _called(instr: dict, key: str) -> list[str]:
    return re.findall(rf"{key}=%([\w.\-]+)", instr["rest"])


def _param(body: list[dict], k: int) -> str | None:
    return next((i["name"] for i in body if i["op"] == "parameter" and re.match(rf"{k}\)", i["rest"])), None)


def _nested(body: list[dict]) -> str | None:
    """'view' for a fusion that is one parameter through bitcasts or reshapes, 'slice' for one slice of it."""
    ops = [i["op"] for i in body if i["op"] != "parameter"]
    if ops and sum(i["op"] == "parameter" for i in body) == 1:
        if all(o in _VIEW for o in ops):
            return "view"
        if ops[-1] in _SLICE and all(o in _VIEW for o in ops[:-1]):
            return "slice"
    return None


def _slice_read(instr: dict, whole: int, operand: str) -> int:
    """What a slice, dynamic slice or gather reads of its operand (whole: the operand's bytes): a slice its result; a
    gather of whole rows 8 rows each (XLA-TPU's cost analysis counts each row as an 8-row band of its tile, however
    small the table), a gather of anything smaller the whole operand (an upper bound: XLA counts more)."""
    result = _bytes_of(instr["shape"])
    if instr["op"] != "gather":
        return min(result, whole)
    sizes = re.search(r"slice_sizes=\{([0-9,]*)\}", instr["rest"])
    dims = _SHAPE.search(operand)
    if sizes and dims:
        sizes, dims = [int(x) for x in sizes.group(1).split(",")], [int(x) for x in dims.group(2).split(",") if x]
        if sizes[-1:] == dims[-1:] and all(x == 1 for x in sizes[:-1]):
            return 8 * result
    return whole


def _update_bytes(instr: dict, update: str, whole: int) -> int:
    """What an in-place update moves in its buffer (whole: the buffer's bytes): a dynamic-update-slice its update; a
    scatter each updated row's tile band read and written (XLA-TPU's cost analysis counts a row as 8 rows of tile)."""
    if instr["op"] != "scatter":
        return min(_bytes_of(update), whole)
    return 16 * _bytes_of(update)


def _read(comps: dict, body: str, param: str, whole: int) -> int:
    """Bytes a fused computation reads of its parameter (whole: the operand's bytes): slices and gathers what
    `_slice_read` says, each; a nested fusion is followed, bitcasts pass through, any other use reads it whole."""
    total, names = 0, [param]
    while names:
        name = names.pop()
        for u in comps[body]:
            if name not in u["operands"]:
                continue
            if u["op"] in _SLICE and u["operands"][0] == name:
                total += _slice_read(u, whole, next(i["shape"] for i in comps[body] if i["name"] == name))
            elif u["op"] in _VIEW:
                names.append(u["name"])
            elif u["op"] == "fusion":
                inner = _called(u, "calls")[0]
                kind = _nested(comps[inner])
                if kind == "view":
                    names.append(u["name"])
                elif kind == "slice":
                    total += _bytes_of(u["shape"])
                else:
                    total += sum(_read(comps, inner, _param(comps[inner], k), whole)
                                 for k, o in enumerate(u["operands"]) if o == name)  # fmt: skip
            else:
                return whole
    return total


def _fusion(comps: dict, producers: dict, instr: dict, operands: list[str], hbm) -> int:
    """A fusion's HBM bytes: each HBM operand as much as the fused code reads of it, plus its HBM results; a result
    written in place (a dynamic-update-slice or scatter into a parameter) counts its update only, results that share
    an operand's buffer (output_to_operand_aliasing) count it once, and a freshly allocated buffer is not read."""
    name = _called(instr, "calls")[0]
    body = comps[name]
    local = {i["name"]: i for i in body}
    root = next((i for i in body if i["root"]), body[-1])
    roots = [local[o] for o in root["operands"]] if root["op"] == "tuple" else [root]
    tupled = instr["shape"].startswith("(")
    sizes = [hbm(f"{d}[{s}]{lay}") for d, s, lay in _SHAPE.findall(instr["shape"])] if tupled else [hbm(instr["shape"])]
    in_place = set()
    for o, r in enumerate(roots[: len(sizes)]):
        target = local.get(r["operands"][0]) if r["operands"] else None
        if r["op"] in _IN_PLACE and target and target["op"] == "parameter":
            update = local.get(r["operands"][-1] if r["op"] == "scatter" else r["operands"][1])
            sizes[o] = _update_bytes(r, update["shape"] if update else "", sizes[o]) if sizes[o] else 0
            in_place.add(target["name"])
    aliased: dict[int, list[int]] = {}
    if "output_to_operand_aliasing=" in instr["rest"]:
        pairs = instr["rest"].split("output_to_operand_aliasing=", 1)[1].split("}}", 1)[0]
        for out, k in re.findall(r"\{(\d*)\}: \((\d+),", pairs + "}"):
            aliased.setdefault(int(k), []).append(int(out or 0))
    total = sum(sizes)
    for outs in aliased.values():  # whole results into one buffer: the buffer once
        whole = [sizes[o] for o in outs if o < min(len(sizes), len(roots)) and roots[o]["op"] not in _IN_PLACE]
        total -= sum(whole) - max(whole, default=0)
    for k, (operand, shape) in enumerate(zip(instr["operands"], operands, strict=False)):
        whole = hbm(shape)
        p = _param(body, k)
        fresh = k in aliased and "AllocateBuffer" in producers.get(operand, {}).get("rest", "")
        if whole and p not in in_place and not fresh:
            total += _read(comps, name, p, whole)
    return total


def _instr(comps: dict, instrs: dict, i: dict, spaces: tuple[int, ...], cost) -> int:
    op = i["op"]
    hbm = functools.partial(_space_bytes, spaces=spaces)
    if op in _FREE:
        return 0
    if op == "while":  # the body once, as XLA's cost analysis counts a loop
        return sum(cost(c) for c in _called(i, "condition") + _called(i, "body"))
    if op == "conditional":  # the costliest branch
        names = _called(i, "true_computation") + _called(i, "false_computation")
        for group in re.findall(r"branch_computations=\{([^}]*)\}", i["rest"]):
            names += re.findall(r"%([\w.\-]+)", group)
        return max((cost(c) for c in names), default=0)
    if op == "call":
        return sum(cost(c) for c in _called(i, "to_apply"))
    if op == "custom-call" and "AllocateBuffer" in i["rest"]:  # an output buffer, not written yet
        return 0
    operands = [instrs[o]["shape"] if o in instrs else "" for o in i["operands"]]
    if op in ("copy-start", "slice-start"):  # (destination, source, context): a DMA, counted on its HBM side(s)
        (dst, dst_space), (src, src_space) = _arrays(i["shape"])[:2]
        return min(dst, src) * ((dst_space in spaces) + (src_space in spaces))
    if op == "custom-call" and "tpu_custom_call" in i["rest"]:  # a Pallas kernel: its declared cost
        m = re.search(r'bytes_accessed\\?":\\?"(\d+)', i["rest"])
        if m:
            return int(m.group(1))
    if op == "fusion":
        return _fusion(comps, instrs, i, operands, hbm)
    if op in _SLICE:
        read = _slice_read(i, hbm(operands[0]), operands[0]) if hbm(operands[0]) else 0
        return hbm(i["shape"]) + sum(hbm(s) for s in operands[1:]) + read
    if op in _IN_PLACE:
        update = operands[-1] if op == "scatter" else operands[1]
        written = _update_bytes(i, update, hbm(operands[0])) if hbm(operands[0]) else 0
        return hbm(update) + sum(hbm(s) for s in operands[1:-1] if op == "scatter") + written
    return hbm(i["shape"]) + sum(hbm(s) for s in operands)


def hbm_bytes(hlo_text: str, spaces: tuple[int, ...] = (0,)) -> tuple[int, list[tuple[int, str]]]:
    """(bytes, movers): what an optimized HLO module (compiled.as_text()) moves through the memory spaces `spaces`
    (0: HBM; the section's comment says how it counts), and every instruction outside fusions that moves any, as
    (bytes, one-line description), largest first."""
    comps, instrs = _parse(hlo_text)
    rows = []

    def cost(name: str) -> int:
        total = 0
        for i in comps[name]:
            b = _instr(comps, instrs, i, spaces, cost)
            if b and i["op"] not in ("while", "conditional", "call"):
                meta = re.search(r'op_name="([^"]*)"', i["rest"])
                where = f"  [{meta.group(1)[-80:]}]" if meta else ""
                rows.append((b, f"{i['op']} {i['name']} -> {i['shape'].split('{')[0][:80]}{where}"))
            total += b
        return total

    return cost(comps[None]), sorted(rows, reverse=True)


def top_movers(hlo_text: str, n: int = 10) -> list[tuple[int, str]]:
    """The n instructions of an optimized HLO module outside fusions that move the most bytes in any memory space, as
    (bytes, one-line description): where to look when a program moves more than its ideal."""
    return hbm_bytes(hlo_text, spaces=tuple(range(8)))[1][:n]
