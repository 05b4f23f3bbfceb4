"""GGUF block formats as kiln weight formats: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K tensors kept exactly as
llama.cpp stores them.

A weight W (out N, in K) in one of these formats is a kiln.models.quant.QuantArray with `kind` set and two leaves that
split each GGUF block (32 consecutive weights along K; 256 for the K-quants) into its float16 fields and the rest of
its bytes, both in the file's order:

* scale float16 (N, B) or (N, B, 2), B = K // block: the block's d, or (d, m) / (d, dmin) where it has two fields.
* q (N, B * bytes): every other byte of the block, as llama.cpp's block struct has them. Q8_0: int8 (N, K), the
  quants. Q4_0 / Q4_1: uint8 (N, K // 2), byte j holding element j (low nibble) and j + 16 (high nibble). Q4_K: the
  12 bytes of 6-bit sub-block scales and mins, then 128 bytes of nibbles. Q5_K: those 12, 32 bytes of fifth bits, 128
  of nibbles. Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 sub-block scales (its d is the block's last
  field).

Every kind dequantizes as W = dsub * v - msub per sub-block (`unpack`: integer values v, per-sub-block float32 scale
dsub and offset msub), computed as gguf.quants.dequantize computes it, so the values are gguf's bit for bit
(tests/test_gguf_quant.py). Q8_0: v = q, dsub = d. Q4_0: v = nibble - 8, dsub = d. Q4_1: v = nibble, dsub = d, msub
= -m. Q4_K / Q5_K: 8 sub-blocks of 32, v = the 4 / 5-bit value, dsub = d * scale_j, msub = dmin * min_j. Q6_K: 16
sub-blocks of 16, v = the 6-bit value - 32, dsub = d * scale_j.

A model's weight format string says which tensor has which kind: a base kind, then `name=kind` exceptions by flat
weight name, e.g. "q4_1,embed=q8_0" (SmolLM2's Q4_1 GGUF: Q4_1 layers, a Q8_0 embedding that is also the tied LM
head). "gguf" asks for the source's own: a GGUF file's tensors of the kinds above are kept as they are; its other
quantized linears (Q5_0, Q5_1, ...) and float ones beside quantized ones become Q8_0 from their dequantized values; a
GGUF without any of the kinds, and every non-GGUF source, stays float. Float weights can be quantized to Q8_0, Q4_0
and Q4_1 (gguf's own quantizer); the K-quants are only kept from a file.

The dot on the cpu platform is the C++ kernel (kiln.models.kernels.cpu_quant, an XLA FFI custom call: activations
quantized on the fly to int8 per block, 32 for the legacy kinds and 256 for the K-quants, as llama.cpp does);
elsewhere, or without the built kernel, the weight is dequantized inside the graph and multiplied by XLA.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.errors import KilnError
from kiln.models.kernels import cpu_quant


@dataclasses.dataclass(frozen=True)
class Layout:
    """One GGUF block: `elems` weights along K in `nbytes` bytes, float16 fields at byte offsets `halves`, `subs`
    sub-blocks with a scale each."""

    elems: int
    nbytes: int
    halves: tuple[int, ...]
    subs: int = 1

    @property
    def qbytes(self) -> int:  # the block's bytes in q
        return self.nbytes - 2 * len(self.halves)


LAYOUTS = {
    "q8_0": Layout(32, 34, (0,)),
    "q4_0": Layout(32, 18, (0,)),
    "q4_1": Layout(32, 20, (0, 2)),
    "q4_k": Layout(256, 144, (0, 2), 8),
    "q5_k": Layout(256, 176, (0, 2), 8),
    "q6_k": Layout(256, 210, (208,), 16),
}
GGUF_KINDS = tuple(LAYOUTS)
QUANTIZABLE = ("q8_0", "q4_0", "q4_1")  # what gguf's quantizer makes from float weights
BLOCK = 32
# llama.cpp tensor name (after blk.N.) -> the kiln LayerWeights field of a linear layer
LINEAR_NAMES = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate",
                "ffn_up": "w_up", "ffn_down": "w_down"}  # fmt: skip
TOP_NAMES = {"token_embd": "embed", "output": "lm_head"}


# ---- format strings ---------------------------------------------------------------------------------------------


def parse_format(weight_format: str) -> tuple[str, dict[str, str]] | None:
    """(base kind, {flat name: kind}) of a GGUF-kind format string ("q4_1", "q4_1,embed=q8_0"), None for any other
    format; a malformed one is a KilnError."""
    base, *rest = weight_format.split(",")
    if base not in GGUF_KINDS:
        return None
    overrides = {}
    for item in rest:
        name, _, kind = item.partition("=")
        if kind not in GGUF_KINDS or not name:
            raise KilnError(
                f"Bad weight format {weight_format!r}: {item!r} is not name=kind with a kind of {GGUF_KINDS}."
            )
        overrides[name] = kind
    return base, overrides


def tensor_kind(weight_format: str, name: str) -> str | None:
    """The GGUF kind of the quantizable weight `name` ("embed", "lm_head", "layers.3.wq") in a format string, or
    None when the format is not a GGUF-kind one."""
    parsed = parse_format(weight_format)
    if parsed is None:
        return None
    base, overrides = parsed
    return overrides.get(name, base)


def format_string(kinds: dict[str, str]) -> str:
    """The shortest format string for {flat name: kind}: the commonest kind as the base, the rest as exceptions."""
    base = collections.Counter(kinds.values()).most_common(1)[0][0]
    return ",".join([base] + [f"{n}={k}" for n, k in kinds.items() if k != base])


# ---- blocks <-> (q, scale), dequantization ----------------------------------------------------------------------


def from_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """GGUF rows of blocks (N, B * block bytes) uint8 -> (q, scale) in kiln's split layout (module doc)."""
    lay = LAYOUTS[kind]
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, lay.nbytes)  # (N, B, bytes)
    is_half = np.zeros(lay.nbytes, bool)
    for o in lay.halves:
        is_half[o : o + 2] = True
    scale = np.ascontiguousarray(blocks[..., is_half]).view(np.float16)  # (N, B, 1 or 2)
    q = np.ascontiguousarray(blocks[..., ~is_half]).reshape(n, -1)
    return q.view(np.int8) if kind == "q8_0" else q, scale[..., 0] if len(lay.halves) == 1 else scale


def to_blocks(q: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """The inverse of from_blocks: GGUF rows of blocks (N, B * block bytes) uint8."""
    lay = LAYOUTS[kind]
    n, b = scale.shape[:2]
    blocks = np.empty((n, b, lay.nbytes), np.uint8)
    is_half = np.zeros(lay.nbytes, bool)
    for o in lay.halves:
        is_half[o : o + 2] = True
    blocks[..., is_half] = np.ascontiguousarray(scale, np.float16).reshape(n, b, -1).view(np.uint8)
    blocks[..., ~is_half] = np.ascontiguousarray(q).view(np.uint8).reshape(n, b, -1)
    return blocks.reshape(n, -1)


def quantize(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """An (out, in) float weight in a GGUF kind with gguf's own quantizer (llama.cpp's reference rounding)."""
    from gguf import GGMLQuantizationType, quants

    if kind not in QUANTIZABLE:
        raise KilnError(f"kiln cannot quantize float weights to {kind}; it keeps {kind} tensors of a GGUF file only.")
    w = np.asarray(w, np.float32)
    if w.shape[1] % BLOCK:
        raise KilnError(f"GGUF block formats need input features divisible by 32, not {w.shape[1]}.")
    return from_blocks(quants.quantize(w, GGMLQuantizationType[kind.upper()]), kind)


def _bits(xp, v, shifts, mask):
    """(..., L) uint8 -> (..., len(shifts), L): (v >> shift) & mask for each shift."""
    return (v[..., None, :] >> xp.asarray(shifts, xp.uint8)[:, None]) & xp.uint8(mask)


def unpack(q, scale, kind: str, xp=np):
    """The integer values and sub-block scales of (q, scale) in `kind`, with numpy or jax.numpy (xp): v (N, B, S, L)
    int (B blocks of S sub-blocks of L weights; float32 where the values exceed int8), dsub (N, B, S) float32 and msub
    (N, B, S) float32 or None; W = dsub * v - msub per sub-block (module doc), all float32 products exact."""
    lay = LAYOUTS[kind]
    n = q.shape[0]
    b = scale.shape[1]
    s = scale.reshape(n, b, -1).astype(xp.float32)  # (N, B, 1 or 2)
    d = s[..., :1]  # (N, B, 1)
    blk = q.reshape(n, b, lay.qbytes)
    if kind == "q8_0":
        return blk.reshape(n, b, 1, 32), d, None
    if kind in ("q4_0", "q4_1"):
        v = _bits(xp, blk, (0, 4), 0x0F).reshape(n, b, 1, 32)  # low nibbles are elements 0..15, high 16..31
        if kind == "q4_0":
            return v.astype(xp.int8) - xp.int8(8), d, None
        return v, d, -s[..., 1:]
    if kind == "q6_k":
        ql = _bits(xp, blk[..., :128].reshape(n, b, 2, 64), (0, 4), 0x0F).reshape(n, b, 2, 4, 32)
        qh = _bits(xp, blk[..., 128:192].reshape(n, b, 2, 32), (0, 2, 4, 6), 0x03)  # (N, B, 2, 4, 32)
        v = (ql | (qh << xp.uint8(4))).astype(xp.int8) - xp.int8(32)  # (N, B, 2, 4, 32)
        sc = blk[..., 192:208].view(xp.int8) if xp is np else jax.lax.bitcast_convert_type(blk[..., 192:208], xp.int8)
        return v.reshape(n, b, 16, 16), d * sc.astype(xp.float32), None
    # q4_k, q5_k: 6-bit scales and mins of 8 sub-blocks packed in 12 bytes (llama.cpp's get_scale_min_k4)
    packed = blk[..., :12].reshape(n, b, 3, 4)
    lo, hi, mix = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]  # (N, B, 4) each
    sc = xp.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # (N, B, 8)
    mn = xp.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    v = _bits(xp, blk[..., -128:].reshape(n, b, 4, 32), (0, 4), 0x0F).reshape(n, b, 8, 32)
    if kind == "q5_k":
        v = v | (_bits(xp, blk[..., 12:44], tuple(range(8)), 0x01) << xp.uint8(4))  # (N, B, 8, 32)
    return v, d * sc.astype(xp.float32), s[..., 1:] * mn.astype(xp.float32)


def dequantize_np(q: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """(N, K) float32 on the host, computed as gguf.quants.dequantize computes it."""
    v, dsub, msub = unpack(q, scale, kind)
    w = dsub[..., None] * v.astype(np.float32)  # (N, B, S, L)
    if msub is not None:
        w = w - msub[..., None]
    return w.reshape(q.shape[0], -1)


def dequantize(q: jax.Array, scale: jax.Array, kind: str, dtype=jnp.float32) -> jax.Array:
    """(N, K) in dtype inside a graph: float32 arithmetic as in dequantize_np, then cast."""
    v, dsub, msub = unpack(q, scale, kind, jnp)
    w = dsub[..., None] * v.astype(jnp.float32)  # (N, B, S, L)
    if msub is not None:
        w = w - msub[..., None]
    return w.reshape(q.shape[0], -1).astype(dtype)


# ---- the graph side ---------------------------------------------------------------------------------------------


def abstract(out_in: tuple[int, int], kind: str) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The (q, scale) ShapeDtypeStructs of an (out, in) weight in `kind`."""
    lay = LAYOUTS[kind]
    n, k = out_in
    if k % lay.elems:
        raise KilnError(f"GGUF {kind} blocks need input features divisible by {lay.elems}, not {k}.")
    b = k // lay.elems
    q = jax.ShapeDtypeStruct((n, b * lay.qbytes), jnp.int8 if kind == "q8_0" else jnp.uint8)
    scale = (n, b) if len(lay.halves) == 1 else (n, b, len(lay.halves))
    return q, jax.ShapeDtypeStruct(scale, jnp.float16)


def register_kernels(weight_format: str) -> None:
    """Register kiln's CPU custom calls (XLA must know them before an executable that names them is deserialized or
    compiled: kiln.compile.artifact.load calls this first). Every weight format: the cpu target's decode attention
    is one of them (kiln.models.kernels.xla_cpu), whatever the weights."""
    del weight_format
    cpu_quant.register()


def in_features(q: jax.Array, kind: str) -> int:
    lay = LAYOUTS[kind]
    return q.shape[1] // lay.qbytes * lay.elems


def dot(x: jax.Array, q: jax.Array, scale: jax.Array, kind: str) -> jax.Array:
    """x (T, K) @ W.T for W (N, K) given as (q, scale) in `kind`: (T, N) in x's dtype. The cpu platform runs the C++
    kernel when it is built; other platforms (and a missing kernel) dequantize W in the graph and run XLA's dot."""

    def xla(x, q, scale):
        w = dequantize(q, scale, kind, x.dtype)  # (N, K)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)

    if not cpu_quant.available():
        return xla(x, q, scale)

    def kernel(x, q, scale):
        return cpu_quant.matmul(x, q, scale, kind, q.shape[0]).astype(x.dtype)

    return jax.lax.platform_dependent(x, q, scale, cpu=kernel, default=xla)


def embed_rows(q: jax.Array, scale: jax.Array, kind: str, token_ids: jax.Array, dtype) -> jax.Array:
    """Rows (T, E) of an embedding table (V, E) in `kind`, only the gathered rows dequantized."""
    return dequantize(q[token_ids], scale[token_ids], kind, dtype)


# ---- keeping a GGUF file's blocks -------------------------------------------------------------------------------


def gguf_tensors(path: str | Path) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """The linear tensors of a GGUF file by kiln flat name: ({name: (kind, raw (N, bytes) uint8)} for the kept kinds,
    {name: GGUF type name} for the others), rows in kiln's order (llama-arch Q/K rows un-permuted)."""
    from kiln.models.checkpoint import gguf as reader_mod

    reader = reader_mod.open_reader(path)
    cfg = reader_mod.config_from_metadata(reader_mod.metadata(reader, path), reader, path)
    permute = cfg.family in ("llama", "mistral")
    kept, other = {}, {}
    for tensor in reader.tensors:
        m = reader_mod.LAYER_RE.match(tensor.name)
        if m and m.group(3) == "weight" and m.group(2) in LINEAR_NAMES:
            name = f"layers.{m.group(1)}.{LINEAR_NAMES[m.group(2)]}"
        elif tensor.name.endswith(".weight") and tensor.name[: -len(".weight")] in TOP_NAMES:
            name = TOP_NAMES[tensor.name[: -len(".weight")]]
        else:
            continue
        kind = tensor.tensor_type.name.lower()
        if kind not in GGUF_KINDS:
            other[name] = tensor.tensor_type.name
            continue
        raw = np.asarray(tensor.data)  # (N, K // block * block bytes)
        if permute and name.endswith(".wq"):
            raw = reader_mod.reverse_permute(raw, cfg.num_heads)
        elif permute and name.endswith(".wk"):
            raw = reader_mod.reverse_permute(raw, cfg.num_kv_heads)
        kept[name] = (kind, raw)
    return kept, other


def keep_gguf(weights, path: str | Path, quantized_names: tuple[str, ...]):
    """Weights with every linear layer, the embedding and an untied LM head as GGUF-kind QuantArrays: the file's own
    blocks where its type is one of GGUF_KINDS, Q8_0 of the float weight otherwise. Returns the float weights unchanged
    when the file holds none of those kinds."""
    from kiln.models.quant import QuantArray

    kept, _ = gguf_tensors(path)
    if not kept:
        return weights

    def convert(name: str, w):
        if name in kept:
            kind, raw = kept[name]
            q, scale = from_blocks(raw, kind)
        else:  # another GGUF type (or float): Q8_0 of the dequantized weight
            kind = "q8_0"
            q, scale = quantize(np.asarray(w, np.float32) if name == "embed" else np.asarray(w, np.float32).T, kind)
        expected = tuple(np.shape(w)) if name == "embed" else tuple(np.shape(w))[::-1]
        if (q.shape[0], in_features(q, kind)) != expected:
            raise KilnError(
                f"The GGUF tensor for {name} has shape {(q.shape[0], in_features(q, kind))}, not {expected}."
            )
        return QuantArray(q, scale, kind=kind)

    def layer(i, lw):
        present = [n for n in quantized_names if getattr(lw, n) is not None]
        return dataclasses.replace(lw, **{n: convert(f"layers.{i}.{n}", getattr(lw, n)) for n in present})

    layers = [layer(i, lw) for i, lw in enumerate(weights.layers)]
    lm_head = None if weights.lm_head is None else convert("lm_head", weights.lm_head)
    return dataclasses.replace(weights, layers=layers, embed=convert("embed", weights.embed), lm_head=lm_head)
