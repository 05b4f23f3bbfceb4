"""The programs of an artifact, described abstractly: the step program per token bucket and the KV initialiser.

Everything here is shapes, dtypes and shardings built from the model config and the KV geometry, so the same
Program objects are rebuilt at compile time (to lower them) and at load time (to rebuild the executables' pytree
signatures without pickle).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kiln.compile.convert import kv_sharding, replicated, weight_shardings
from kiln.compile.executable import Program
from kiln.models.batch import Batch, KVCache
from kiln.models.config import ModelConfig
from kiln.models.sampling import SamplingBatch, StepOut
from kiln.models.step import step


@dataclass(frozen=True)
class Geometry:
    """What the programs are compiled for: KV pages, buckets, dtypes, attention, tensor parallelism."""

    page_size: int
    num_pages: int
    max_pages_per_seq: int
    max_model_len: int
    max_num_seqs: int  # S of the largest step programs (a bucket of T tokens gets S = min(T, max_num_seqs))
    buckets: tuple[int, ...]  # T of the step programs
    compute_dtype: str
    kv_dtype: str
    attention: str
    tp: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Geometry:
        return cls(**{**d, "buckets": tuple(d["buckets"])})

    def seqs(self, num_tokens: int) -> int:
        """S of the step program of bucket T: a step of T tokens holds at most T sequences, so small (decode)
        buckets pad the sampler and logits to a small S instead of max_num_seqs."""
        return min(num_tokens, self.max_num_seqs)

    def kv_bytes(self, cfg: ModelConfig) -> int:
        """Bytes of the whole KV cache (all devices together)."""
        per_page = 2 * cfg.num_layers * cfg.num_kv_heads * self.page_size * cfg.head_dim
        return per_page * self.num_pages * jnp.dtype(self.kv_dtype).itemsize


def page_bytes(cfg: ModelConfig, page_size: int, kv_dtype: str) -> int:
    """Bytes of one page across all layers, K and V."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * jnp.dtype(kv_dtype).itemsize


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def _with(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def kv_abstract(cfg: ModelConfig, geom: Geometry, mesh: Mesh) -> KVCache:
    return KVCache.abstract(cfg, geom.num_pages, geom.page_size, jnp.dtype(geom.kv_dtype), sharding=kv_sharding(mesh))


def step_args(cfg: ModelConfig, geom: Geometry, mesh: Mesh, num_tokens: int) -> tuple:
    """Abstract (weights, kv, batch, sampling) of the step program of bucket `num_tokens`, with shardings."""
    rep = replicated(mesh)
    weights = weight_shardings(cfg, mesh, jnp.dtype(geom.compute_dtype))
    num_seqs = geom.seqs(num_tokens)
    batch = _with(Batch.abstract(num_tokens, num_seqs, geom.max_pages_per_seq), rep)
    sampling = _with(SamplingBatch.abstract(num_seqs, cfg.vocab_size), rep)
    return weights, kv_abstract(cfg, geom, mesh), batch, sampling


def step_out(cfg: ModelConfig, geom: Geometry, mesh: Mesh, step_out_avals: list, num_tokens: int) -> tuple:
    """Abstract (StepOut, kv) of a step program; step_out_avals are StepOut's leaves (shape, dtype) in order, traced
    at bucket 1: every leaf has S leading, set here to the bucket's S."""
    names = [f.name for f in dataclasses.fields(StepOut)]
    if len(names) != len(step_out_avals):
        raise ValueError(f"StepOut has {len(names)} fields but the program returns {len(step_out_avals)}")
    rep = replicated(mesh)
    num_seqs = geom.seqs(num_tokens)
    leaves = [
        jax.ShapeDtypeStruct((num_seqs, *shape[1:]), jnp.dtype(dtype), sharding=rep) for shape, dtype in step_out_avals
    ]
    return StepOut(**dict(zip(names, leaves, strict=True))), kv_abstract(cfg, geom, mesh)


def step_out_avals(cfg: ModelConfig, geom: Geometry, mesh: Mesh) -> list[tuple[list[int], str]]:
    """StepOut's leaf shapes and dtypes, by tracing the step once (compile time only)."""
    with jax.set_mesh(mesh):
        out, _ = jax.eval_shape(functools.partial(step, cfg, geom.attention), *step_args(cfg, geom, mesh, 1))
    return [(list(a.shape), str(a.dtype)) for a in jax.tree.leaves(out)]


def step_program(cfg: ModelConfig, geom: Geometry, mesh: Mesh, num_tokens: int, out_avals: list) -> Program:
    """The step program of one token bucket: cfg and attention static; weights, kv (donated), batch, sampling."""
    return Program(
        name=f"step_t{num_tokens}",
        fn=functools.partial(step, cfg, geom.attention),
        args=step_args(cfg, geom, mesh, num_tokens),
        out=step_out(cfg, geom, mesh, out_avals, num_tokens),
        donate=(1,),
    )


def init_kv_program(cfg: ModelConfig, geom: Geometry, mesh: Mesh) -> Program:
    """A program with no inputs that returns a zeroed, sharded KV cache (so allocating it compiles nothing)."""
    kv = kv_abstract(cfg, geom, mesh)

    def init_kv():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), kv)

    return Program(name="init_kv", fn=init_kv, args=(), out=kv)


def programs(cfg: ModelConfig, geom: Geometry, mesh: Mesh, out_avals: list) -> list[Program]:
    """Every program of an artifact: init_kv, then the step programs from the largest bucket down."""
    steps = [step_program(cfg, geom, mesh, t, out_avals) for t in sorted(geom.buckets, reverse=True)]
    return [init_kv_program(cfg, geom, mesh), *steps]
