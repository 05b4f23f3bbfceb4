"""An L2 prefetch issued from inside a Pallas (Triton) kernel on Hopper: `cp.async.bulk.prefetch.L2`.

At batch 1 a decode step is a chain of launches, and the latency-bound ones (the attention, the norms, a launch's
ramp and drain) leave DRAM idle while the weight the step reads next does not depend on them. A kernel of ours can
then ask the copy engine (TMA) to bring that weight into L2, one bulk request per thread, without loads, registers
or shared memory: the request is a hint, nothing waits for it, and the GEMM after the kernel finds the weight in L2.
Pallas's Triton lowering exposes no pointers, so this module adds one primitive with its own Triton lowering rule
(inline PTX on the ref's address). It has no value and no semantics: the interpreter and other platforms skip it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import state
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering

MIN_CHUNK = 256  # bytes a request, at least (a multiple of 16, as the instruction requires)

_prefetch_p = jax_core.Primitive("kiln_l2_prefetch")
_prefetch_p.multiple_results = True


@_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(ref_aval, offsets_aval, enable_aval, *, chunk_bytes):
    del ref_aval, offsets_aval, enable_aval, chunk_bytes
    return [], {state.ReadEffect(0)}


# It has no outputs and a read is no effect to keep it for, so jaxpr's dead-code elimination would drop it: kept always
# (as pallas_call keeps itself). A call inside a cond of a kernel still goes with the cond if nothing else keeps that.
pe.dce_rules[_prefetch_p] = lambda used_outputs, eqn: ([True] * len(eqn.invars), eqn)


@triton_lowering.register_lowering(_prefetch_p)
def _lowering(ctx, ptr, offsets, enable, *, chunk_bytes):
    if ctx.context.platform != "cuda":
        return []
    shape = ir.RankedTensorType(offsets.type).shape
    ptrs = tt_dialect.splat(ir.RankedTensorType.get(shape, ptr.type), ptr)
    ptrs = tt_dialect.addptr(ptrs.type, ptrs, offsets)
    asm = (
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
        f"@p cp.async.bulk.prefetch.L2.global [$1], {chunk_bytes}; }} mov.u32 $0, 0;"
    )
    i32 = ir.IntegerType.get_signless(32)
    tt_dialect.elementwise_inline_asm(
        [ir.RankedTensorType.get(shape, i32)], asm, constraints="=r,l,r", pure=False, packed_element=1,
        args=[ptrs, enable],
    )  # fmt: skip
    return []


def plan(nbytes: int, programs: int, threads: int) -> tuple[int, int]:
    """(chunk bytes, chunks) to cover an array of nbytes with one request per thread of `programs` x `threads`: the
    chunk a power of two >= MIN_CHUNK dividing nbytes (so no request reads past the array's end)."""
    chunk = max(MIN_CHUNK, 1 << max(0, math.ceil(math.log2(max(1, nbytes / (programs * threads))))))
    while nbytes % chunk:
        chunk //= 2
    if chunk < 16:
        raise ValueError(f"an L2 prefetch needs an array of a multiple of 16 bytes, got {nbytes}")
    return chunk, nbytes // chunk


def prefetch(ref, program, *, programs: int, threads: int, start=0, size: int | None = None) -> None:
    """Inside a kernel: program `program` (a scalar in [0, programs)) of a launch with `threads` threads a program
    asks L2 for its share of ref's flat elements [start, start + size) (the whole ref by default), one bulk request a
    thread. start may be traced; start and size times the item size: multiples of 16 bytes."""
    itemsize = jnp.dtype(ref.dtype).itemsize
    size = math.prod(ref.shape) if size is None else size
    chunk, chunks = plan(size * itemsize, programs, threads)
    for r in range(-(-chunks // (programs * threads))):  # one round unless the chunk had to shrink to divide the size
        idx = (r * programs + program) * threads + jnp.arange(threads, dtype=jnp.int32)  # a chunk a thread
        offsets = (start + jnp.minimum(idx, chunks - 1) * (chunk // itemsize)).astype(jnp.int32)
        _prefetch_p.bind(ref, offsets, (idx < chunks).astype(jnp.int32), chunk_bytes=chunk)


def supported() -> bool:
    """Whether the default device can take the prefetch (CUDA, compute capability 9.0 or newer)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    cc = getattr(dev, "compute_capability", None)
    return dev.platform == "gpu" and cc is not None and float(cc) >= 9.0
