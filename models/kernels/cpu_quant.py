"""The CPU matmul of the GGUF block formats (cpu_quant.cc) as the XLA FFI custom call "kiln_gguf_matmul".

The C++ library is built by the package's own build (setup.py: the optional extension
`kiln.models.kernels._cpu_quant`, a plain shared library that Python loads through ctypes). `register()` hands its
handler to XLA for the cpu platform; it runs once per process, before any program that names the call is traced or
an executable that names it is loaded (kiln serve calls it before loading an artifact). Without the library (no C++
compiler at install time) `available()` is False, says so once in the log, and kiln.models.gguf_quant computes the
dot with XLA ops instead.

`matmul(x, q, scale, kind)` is the call; `reference_matmul` is its numpy oracle (the same arithmetic: activations
quantized per 32-block to int8, integer block dots, float32 scales), which the tests compare it with.
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
KINDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # the kernel's `kind` attribute
BLOCK = 32
ISAS = ("scalar", "avx2", "avx-vnni")


def library_path() -> Path | None:
    """The built shared library next to this file, or None."""
    found = sorted(Path(__file__).parent.glob("_cpu_quant*.so")) + sorted(Path(__file__).parent.glob("_cpu_quant*.pyd"))
    return found[0] if found else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = library_path()
    if path is None:
        log.warning(
            "kiln's CPU kernels for GGUF weights are not built (no C++ compiler at install time?); GGUF-format matmuls "
            "run as XLA ops (slower). Reinstall kiln with a C++ compiler to build them."
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
    lib.kiln_cpu_quant_isa.restype = ctypes.c_int
    log.info("kiln CPU kernels registered (%s)", ISAS[lib.kiln_cpu_quant_isa()])
    return True


def available() -> bool:
    """Whether the kernel is built and registered in this process."""
    return register()


def isa() -> str | None:
    """The SIMD path the kernel runs on this CPU ("scalar", "avx2", "avx-vnni"), None without the library."""
    return ISAS[_library().kiln_cpu_quant_isa()] if register() else None


def matmul(x: jax.Array, q: jax.Array, scale: jax.Array, kind: str, n: int) -> jax.Array:
    """x (T, K) @ W.T for W (N, K) in the GGUF format `kind`, given as its quants q and float16 scales (see
    kiln.models.gguf_quant): (T, N) float32. Only the cpu platform has the call."""
    register()
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), q, scale, kind=np.int32(KINDS[kind]))


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


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (T, K) per 32-block as the kernel does: q (T, K // 32, 32) int8 and d (T, K // 32) float32, d = max |x| / 127,
    q = round-half-even(x * (1 / d))."""
    t, k = x.shape
    xb = np.asarray(x, np.float32).reshape(t, k // BLOCK, BLOCK)
    d = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    return np.rint(xb * inv[..., None]).astype(np.int8), d


def reference_matmul(x: np.ndarray, q: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """numpy oracle of `matmul`: (T, N) float64 of the kernel's arithmetic (integer block dots exact, scales applied
    in float64)."""
    xq, xd = quantize_activations(x)  # (T, B, 32), (T, B)
    t, b, _ = xq.shape
    n = q.shape[0]
    if kind == "q8_0":
        wq = q.reshape(n, b, BLOCK).astype(np.int64)
    else:
        packed = q.reshape(n, b, BLOCK // 2)
        wq = np.concatenate([packed & 0x0F, packed >> 4], axis=2).astype(np.int64)  # (N, B, 32) in 0..15
        if kind == "q4_0":
            wq = wq - 8
    dots = np.einsum("tbi,nbi->tnb", xq.astype(np.int64), wq)  # (T, N, B) exact
    s = scale.reshape(n, b, -1).astype(np.float64)  # (N, B, 1 or 2)
    out = np.einsum("tnb,nb,tb->tn", dots.astype(np.float64), s[..., 0], xd.astype(np.float64))
    if kind == "q4_1":
        xsum = xq.astype(np.int64).sum(axis=2) * xd.astype(np.float64)  # (T, B)
        out += np.einsum("nb,tb->tn", s[..., 1], xsum)
    return out
