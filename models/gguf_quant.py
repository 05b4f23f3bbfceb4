"""GGUF block formats as kiln weight formats: Q8_0, Q4_0 and Q4_1 tensors kept exactly as llama.cpp stores them.

A weight W (out N, in K) in one of these formats is a kiln.models.quant.QuantArray with `kind` set and two leaves
holding the GGUF blocks (32 consecutive weights along K) split into arrays:

* "q8_0": q int8 (N, K), the quants; scale float16 (N, K // 32), d. W = d * q.
* "q4_0": q uint8 (N, K // 2), byte j of a block holding element j (low nibble) and j + 16 (high nibble), exactly the
  block's qs bytes; scale float16 (N, K // 32), d. W = d * (q - 8).
* "q4_1": q as Q4_0's; scale float16 (N, K // 32, 2), the block's (d, m). W = d * q + m.

The bits are the file's, so dequantizing gives gguf.quants.dequantize's values exactly (tests/test_gguf_quant.py).

A model's weight format string says which tensor has which kind: a base kind, then `name=kind` exceptions by flat
weight name, e.g. "q4_1,embed=q8_0" (SmolLM2's Q4_1 GGUF: Q4_1 layers, a Q8_0 embedding that is also the tied LM
head). "gguf" asks for the source's own: a GGUF file's Q8_0/Q4_0/Q4_1 tensors are kept as they are; its other
quantized linears (K-quants, Q5_x) and float ones beside quantized ones become Q8_0 from their dequantized values; a
GGUF without any of the three, and every non-GGUF source, stays float.

The dot on the cpu platform is the C++ kernel (kiln.models.kernels.cpu_quant, an XLA FFI custom call: activations
quantized per block to int8 on the fly, as llama.cpp does); elsewhere, or without the built kernel, the weight is
dequantized inside the graph and multiplied by XLA.
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

GGUF_KINDS = ("q8_0", "q4_0", "q4_1")
BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # one GGUF block: float16 d (and m) + the quants
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
    """GGUF rows of blocks (N, K // 32 * block bytes) uint8 -> (q, scale) in kiln's split layout (module doc)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES[kind])  # (N, B, bytes)
    head = 4 if kind == "q4_1" else 2
    scale = np.ascontiguousarray(blocks[..., :head]).view(np.float16)  # (N, B, 1 or 2)
    q = np.ascontiguousarray(blocks[..., head:]).reshape(n, -1)
    if kind == "q8_0":
        q = q.view(np.int8)
    return q, (scale if kind == "q4_1" else scale[..., 0])


def to_blocks(q: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """The inverse of from_blocks: GGUF rows of blocks (N, K // 32 * block bytes) uint8."""
    n = q.shape[0]
    b = scale.shape[1]
    head = np.ascontiguousarray(scale, np.float16).reshape(n, b, -1).view(np.uint8)  # (N, B, 2 or 4)
    body = np.ascontiguousarray(q).view(np.uint8).reshape(n, b, -1)
    return np.concatenate([head, body], axis=2).reshape(n, -1)


def quantize(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """An (out, in) float weight in a GGUF kind with gguf's own quantizer (llama.cpp's reference rounding)."""
    from gguf import GGMLQuantizationType, quants

    w = np.asarray(w, np.float32)
    if w.shape[1] % BLOCK:
        raise KilnError(f"GGUF block formats need input features divisible by 32, not {w.shape[1]}.")
    return from_blocks(quants.quantize(w, GGMLQuantizationType[kind.upper()]), kind)


def dequantize_np(q: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """(N, K) float32 on the host, computed as gguf.quants.dequantize computes it."""
    n = q.shape[0]
    b = scale.shape[1]
    s = np.asarray(scale).reshape(n, b, -1).astype(np.float32)  # (N, B, 1 or 2)
    if kind == "q8_0":
        return (q.reshape(n, b, BLOCK).astype(np.float32) * s[..., :1]).reshape(n, -1)
    packed = q.reshape(n, b, BLOCK // 2)
    wq = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # (N, B, 32) in 0..15
    if kind == "q4_0":
        return (s[..., :1] * (wq.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(n, -1)
    return (s[..., :1] * wq.astype(np.float32) + s[..., 1:]).reshape(n, -1)


def dequantize(q: jax.Array, scale: jax.Array, kind: str, dtype=jnp.float32) -> jax.Array:
    """(N, K) in dtype inside a graph: float32 arithmetic as in dequantize_np, then cast."""
    n = q.shape[0]
    b = scale.shape[1]
    s = scale.reshape(n, b, -1).astype(jnp.float32)  # (N, B, 1 or 2)
    if kind == "q8_0":
        w = q.reshape(n, b, BLOCK).astype(jnp.float32) * s[..., :1]
    else:
        packed = q.reshape(n, b, BLOCK // 2)
        wq = jnp.concatenate([packed & 0x0F, packed >> 4], axis=2)  # (N, B, 32)
        if kind == "q4_0":
            w = s[..., :1] * (wq.astype(jnp.int8) - 8).astype(jnp.float32)
        else:
            w = s[..., :1] * wq.astype(jnp.float32) + s[..., 1:]
    return w.reshape(n, -1).astype(dtype)


# ---- the graph side ---------------------------------------------------------------------------------------------


def abstract(out_in: tuple[int, int], kind: str) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The (q, scale) ShapeDtypeStructs of an (out, in) weight in `kind`."""
    n, k = out_in
    if k % BLOCK:
        raise KilnError(f"GGUF block formats need input features divisible by 32, not {k}.")
    q = jax.ShapeDtypeStruct((n, k), jnp.int8) if kind == "q8_0" else jax.ShapeDtypeStruct((n, k // 2), jnp.uint8)
    scale = (n, k // BLOCK, 2) if kind == "q4_1" else (n, k // BLOCK)
    return q, jax.ShapeDtypeStruct(scale, jnp.float16)


def register_kernels(weight_format: str) -> None:
    """Register the custom call that programs of this weight format name (XLA must know it before such an executable
    is deserialized or compiled: kiln.compile.artifact.load calls this first)."""
    if parse_format(weight_format) is not None:
        cpu_quant.register()


def in_features(q: jax.Array, kind: str) -> int:
    return q.shape[1] if kind == "q8_0" else 2 * q.shape[1]


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
        raw = np.asarray(tensor.data)  # (N, K // 32 * block bytes)
        if permute and name.endswith(".wq"):
            raw = reader_mod.reverse_permute(raw, cfg.num_heads)
        elif permute and name.endswith(".wk"):
            raw = reader_mod.reverse_permute(raw, cfg.num_kv_heads)
        kept[name] = (kind, raw)
    return kept, other


def keep_gguf(weights, path: str | Path, quantized_names: tuple[str, ...]):
    """Weights with every linear layer, the embedding and an untied LM head as GGUF-kind QuantArrays: the file's own
    blocks where its type is Q8_0/Q4_0/Q4_1, Q8_0 of the float weight otherwise. Returns the float weights unchanged
    when the file holds none of the three kinds."""
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
