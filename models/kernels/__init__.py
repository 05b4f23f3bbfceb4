"""Paged-attention implementations behind one signature (see reference.paged_attention).

`get_attention(name)` returns the implementation a target asks for: `reference` (plain jax.numpy, any device; the
oracle), `xla_cpu` (plain jax.numpy arranged for XLA's CPU), `pallas_tpu` (Mosaic) or `pallas_gpu` (Pallas on GPU;
Triton lowering on CUDA and ROCm). `get_attention_qkv(name)`: its entry point for a fused qkv, where it has one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from kiln.models.errors import KilnError

TP_AXIS = "tp"  # the tensor-parallel mesh axis (kiln.compile.convert)

IMPLEMENTATIONS = {
    "reference": "kiln.models.kernels.reference",
    "xla_cpu": "kiln.models.kernels.xla_cpu",
    "pallas_tpu": "kiln.models.kernels.pallas_tpu",
    "pallas_gpu": "kiln.models.kernels.pallas_gpu",
}


DECODE_BATCH = contextvars.ContextVar("kiln_decode_batch", default=False)


@contextlib.contextmanager
def decode_batch():
    """While tracing under it, every attention call's batch is a decode batch (query token s is sequence s's only
    one: kiln.models.step.decode_steps), and an implementation may take a decode-only path (pallas_gpu does)."""
    token = DECODE_BATCH.set(True)
    try:
        yield
    finally:
        DECODE_BATCH.reset(token)


def check_attention(name: str) -> None:
    """A one-sentence KilnError unless `name` is an implementation this kiln has."""
    if name not in IMPLEMENTATIONS:
        raise KilnError(f"Unknown attention implementation {name!r}; choose one of {', '.join(IMPLEMENTATIONS)}.")
    try:
        importlib.import_module(IMPLEMENTATIONS[name])
    except ModuleNotFoundError:
        raise KilnError(
            f"The attention implementation {name} is not part of this kiln yet; pass --attention reference."
        ) from None


def get_attention(name: str) -> Callable:
    """The paged_attention function of implementation `name`."""
    check_attention(name)
    fn = importlib.import_module(IMPLEMENTATIONS[name]).paged_attention
    mesh = jax.sharding.get_abstract_mesh()  # set by jax.set_mesh while kiln.compile lowers the step
    if mesh.empty or dict(mesh.shape).get(TP_AXIS, 1) == 1:
        return fn
    return _per_device_heads(fn, mesh)


def get_attention_qkv(name: str) -> Callable | None:
    """The fused-qkv entry point of implementation `name` (paged_attention_qkv: q, k and v read out of one (T, KVH,
    G + 2, D) array, kiln.models.transformer.fuse_linears's layout), or None where the model cuts q, k and v apart
    itself (every implementation but pallas_gpu)."""
    if name != "pallas_gpu":
        return None
    check_attention(name)
    fn = importlib.import_module(IMPLEMENTATIONS[name]).paged_attention_qkv
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or dict(mesh.shape).get(TP_AXIS, 1) == 1:
        return fn

    def attention(qkv, k_pages, v_pages, batch, **kwargs):  # per device: its KV heads' rows of qkv
        return jax.shard_map(
            functools.partial(fn, **kwargs),
            mesh=mesh,
            in_specs=(P(None, TP_AXIS, None, None), P(TP_AXIS), P(TP_AXIS), P()),
            out_specs=(P(None, TP_AXIS, None), P(TP_AXIS), P(TP_AXIS)),
            check_vma=False,
        )(qkv, k_pages, v_pages, batch)

    return attention


def _per_device_heads(fn: Callable, mesh) -> Callable:
    """fn run per device on its own query and KV heads of the "tp" mesh axis, so that kernels XLA cannot
    partition (Mosaic, Triton) work under tensor parallelism."""

    @functools.wraps(fn)
    def attention(q, k, v, k_pages, v_pages, batch, **kwargs):
        heads, pages = P(None, TP_AXIS, None), P(TP_AXIS)  # (T, H, D) by head; (KVH, pages, page, D) by KV head
        return jax.shard_map(
            functools.partial(fn, **kwargs),
            mesh=mesh,
            in_specs=(heads, heads, heads, pages, pages, P()),
            out_specs=(heads, pages, pages),
            check_vma=False,
        )(q, k, v, k_pages, v_pages, batch)

    return attention
