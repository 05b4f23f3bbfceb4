"""The CPU matmul of the GGUF block formats (cpu_quant.cc) as the XLA FFI custom call "kiln_gguf_matmul".

The C++ library is built by the package's own build (setup.py: the optional extension
`kiln.models.kernels._cpu_quant`, a plain shared library that Python loads through ctypes). `register()` hands its
handler to XLA for the cpu platform; it runs once per process, before any program that names the call is traced or
an executable that names it is loaded (kiln serve calls it before loading an artifact). Without the library (no C++
compiler at install time) `available()` is False, says so once in the log, and kiln.models.gguf_quant computes the
dot with XLA ops instead.

`matmul(x, q, scale, kind)` is the call; `reference_matmul` is its numpy oracle (the same arithmetic: activations
quantized per block to int8, 32 weights or 256 for the K-quants, integer sub-block dots, float scales), which the tests
compare it with.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("kiln.kernels")

TARGET = "kiln_gguf_matmul"
ATTENTION_TARGET = "kiln_paged_attention"  # the decode-sized paged attention of kiln.models.kernels.xla_cpu
KINDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 3, "q5_k": 4, "q6_k": 5}  # the kernel's `kind` attribute
ISAS = ("scalar", "avx2", "avx-vnni", "avx512-vnni")


def library_path() -> Path | None:
    """The built shared library next to this file, or None."""
    found = sorted(Path(__file__).parent.glob("_cpu_quant*.so")) + sorted(Path(__file__).parent.glob("_cpu_quant*.pyd"))
    return found[0] if found else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = library_path()
    if path is None:
        log.warning(
            "kiln's CPU kernels are not built (no C++ compiler at install time?); GGUF-format matmuls and the CPU "
            "decode attention run as XLA ops (slower). Reinstall kiln with a C++ compiler to build them."
        )
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("kiln's CPU kernels at %s do not load (%s); GGUF-format matmuls run as XLA ops.", path, e)
        return None


@functools.cache
def register() -> bool:
    """Register the custom call with XLA for the cpu platform (once); False when the library is missing."""
    lib = _library()
    if lib is None:
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.KilnGgufMatmul), platform="cpu")
    if hasattr(lib, "KilnPagedAttention"):  # a library built before the attention kernel has only the matmul
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.KilnPagedAttention), platform="cpu")
    lib.kiln_cpu_quant_isa.restype = ctypes.c_int
    log.info("kiln CPU kernels registered (%s)", ISAS[lib.kiln_cpu_quant_isa()])
    return True


def available() -> bool:
    """Whether the kernel is built and registered in this process."""
    return register()


def isa() -> str | None:
    """The SIMD path the kernel runs on this CPU (one of ISAS), None without the library."""
    return ISAS[_library().kiln_cpu_quant_isa()] if register() else None


def set_isa(name: str) -> bool:
    """Pin the kernel's SIMD path (one of ISAS) for this process, for tests and benchmarks; False where this CPU
    (or the built library) cannot run it. Not while a matmul runs."""
    if not register() or not hasattr(_library(), "kiln_cpu_quant_set_isa"):
        return False
    return _library().kiln_cpu_quant_set_isa(ISAS.index(name)) >= 0


def matmul(x: jax.Array, q: jax.Array, scale: jax.Array, kind: str, n: int) -> jax.Array:
    """x (T, K) @ W.T for W (N, K) in the GGUF format `kind`, given as its quants q and float16 scales (see
    kiln.models.gguf_quant): (T, N) float32. Only the cpu platform has the call."""
    register()
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), q, scale, kind=np.int32(KINDS[kind]))


def attention_available() -> bool:
    """Whether the paged attention kernel is built and registered in this process."""
    return register() and hasattr(_library(), "KilnPagedAttention")


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    tables: jax.Array,
    lens: jax.Array,
    *,
    scale: float,
    soft_cap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """Token t of q (T, H, D) float32 attends keys [max(0, lens[t] - window), lens[t]) of the float32 pages (KVH, P,
    page_size, D) through its page row tables[t] (T, max_pages) int32, the step's K/V already written; lens[t] = 0
    (padding) gives zeros. (T, H, D) float32; only the cpu platform has the call."""
    register()
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_TARGET, out)(
        q, k_pages, v_pages, tables.astype(jnp.int32), lens.astype(jnp.int32), scale=np.float32(scale),
        soft_cap=np.float32(soft_cap or 0.0), window=np.int32(window or 0),
    )  # fmt: skip


def matmul_serial(x: np.ndarray, q: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """The same kernel on host arrays through ctypes, on the calling thread, without XLA (tests run every M through
    it; benchmarks time the kernel alone): (T, N) float32."""
    if not register():
        raise RuntimeError("kiln's CPU kernels are not built")
    x = np.ascontiguousarray(x, np.float32)
    q, scale = np.ascontiguousarray(q), np.ascontiguousarray(scale, np.float16)
    out = np.empty((x.shape[0], q.shape[0]), np.float32)
    ptr = ctypes.c_void_p
    fn = _library().kiln_gguf_matmul_serial
    fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
    if fn(x.ctypes.data, q.ctypes.data, scale.ctypes.data, out.ctypes.data, *x.shape, q.shape[0], KINDS[kind]):
        raise ValueError(f"bad arguments for a {kind} matmul: x {x.shape}, q {q.shape}")
    return out


# ---- the oracle ---------------------------------------------------------------------------------------------------


def quantize_activations(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """x (T, K) per block of `block` as the kernel does: q (T, K // block, block) int8 and d (T, K // block) float32,
    d = max |x| / 127, q = round-half-even(x * (1 / d))."""
    t, k = x.shape
    xb = np.asarray(x, np.float32).reshape(t, k // block, block)
    d = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    return np.rint(xb * inv[..., None]).astype(np.int8), d


def reference_matmul(x: np.ndarray, q: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """numpy oracle of `matmul`: (T, N) float64 of the kernel's arithmetic (integer sub-block dots exact, scales
    applied in float64): out = sum over blocks b and sub-blocks s of dx_b * (dsub * dot(v, qx) - msub * sum(qx)), the
    weight's (v, dsub, msub) from kiln.models.gguf_quant.unpack."""
    from kiln.models import gguf_quant

    v, dsub, msub = gguf_quant.unpack(q, scale, kind)  # (N, B, S, L), (N, B, S), (N, B, S) or None
    n, b, subs, sub_len = v.shape
    xq, xd = quantize_activations(x, subs * sub_len)  # (T, B, E), (T, B)
    xq = xq.reshape(x.shape[0], b, subs, sub_len).astype(np.int64)
    dots = np.einsum("tbsl,nbsl->tnbs", xq, v.astype(np.int64)).astype(np.float64)  # (T, N, B, S) exact
    per_block = np.einsum("tnbs,nbs->tnb", dots, dsub.astype(np.float64))
    if msub is not None:
        per_block -= np.einsum("tbs,nbs->tnb", xq.sum(axis=3).astype(np.float64), msub.astype(np.float64))
    return np.einsum("tnb,tb->tn", per_block, xd.astype(np.float64))
