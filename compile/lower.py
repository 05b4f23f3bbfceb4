"""The programs of an artifact, described abstractly: the step program per token bucket, the multi-step decode
program per decode bucket (and on one device its run-ahead token gather), and the KV initialiser.

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
from kiln.models.step import decode_steps, step


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
    decode_steps: int = 1  # > 1: a multi-step decode program (decode_t<T>) for every bucket T <= max_num_seqs
    weight_format: str = "float"  # kiln.models.quant.WEIGHT_FORMATS: "float" (compute_dtype), "int8", "int4", "fp8"
    expert_parallel: bool = False  # a mixture of experts' experts split over the "tp" devices (else their width)
    fused_linears: bool = True  # q|k|v and gate|up stored fused (kiln.models.transformer.fuse_linears)

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """Buckets with a multi-step decode program: those of T <= max_num_seqs (S = T, so a decode batch of up to T
        sequences fits) and the smallest above it (S = max_num_seqs), so every decode batch size has one."""
        if self.decode_steps <= 1:
            return ()
        cover = next((t for t in self.buckets if t >= self.max_num_seqs), None)
        return tuple(t for t in self.buckets if t <= self.max_num_seqs or t == cover)

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
    """Abstract (weights, kv, batch, sampling) of the step program of bucket `num_tokens`, with shardings. sampling
    carries the structured-output token bitmask (S, ceil(V / 32)) int32, so a constrained request needs no other
    program."""
    rep = replicated(mesh)
    weights = weight_shardings(
        cfg, mesh, jnp.dtype(geom.compute_dtype), geom.weight_format, geom.expert_parallel, geom.fused_linears
    )
    num_seqs = geom.seqs(num_tokens)
    batch = _with(Batch.abstract(num_tokens, num_seqs, geom.max_pages_per_seq), rep)
    sampling = _with(SamplingBatch.abstract(num_seqs, cfg.vocab_size), rep)
    return weights, kv_abstract(cfg, geom, mesh), batch, sampling


def step_out(cfg: ModelConfig, geom: Geometry, mesh: Mesh, avals: list, num_tokens: int, steps: int = 1) -> tuple:
    """Abstract (StepOut, kv) of a step program; avals are StepOut's leaves (shape, dtype) in order, traced
    at bucket 1: every leaf has S leading, set here to the bucket's S (after a (steps,) axis for a decode program)."""
    names = [f.name for f in dataclasses.fields(StepOut)]
    if len(names) != len(avals):
        raise ValueError(f"StepOut has {len(names)} fields but the program returns {len(avals)}")
    rep = replicated(mesh)
    num_seqs = geom.seqs(num_tokens)
    lead = (steps, num_seqs) if steps > 1 else (num_seqs,)
    leaves = [jax.ShapeDtypeStruct((*lead, *shape[1:]), jnp.dtype(dtype), sharding=rep) for shape, dtype in avals]
    return StepOut(**dict(zip(names, leaves, strict=True))), kv_abstract(cfg, geom, mesh)


def graph_config(cfg: ModelConfig, geom: Geometry) -> ModelConfig:
    """The config the programs trace: with expert parallelism, the dense MoE dispatch, which the partitioner splits by
    expert (kiln.models.moe)."""
    return dataclasses.replace(cfg, moe_dispatch="dense") if geom.expert_parallel else cfg


def step_out_avals(cfg: ModelConfig, geom: Geometry, mesh: Mesh) -> list[tuple[list[int], str]]:
    """StepOut's leaf shapes and dtypes, by tracing the step once (compile time only)."""
    with jax.set_mesh(mesh):
        fn = functools.partial(step, graph_config(cfg, geom), geom.attention)
        out, _ = jax.eval_shape(fn, *step_args(cfg, geom, mesh, 1))
    return [(list(a.shape), str(a.dtype)) for a in jax.tree.leaves(out)]


def step_program(cfg: ModelConfig, geom: Geometry, mesh: Mesh, num_tokens: int, out_avals: list) -> Program:
    """The step program of one token bucket: cfg and attention static; weights, kv (donated), batch, sampling."""
    return Program(
        name=f"step_t{num_tokens}",
        fn=functools.partial(step, graph_config(cfg, geom), geom.attention),
        args=step_args(cfg, geom, mesh, num_tokens),
        out=step_out(cfg, geom, mesh, out_avals, num_tokens),
        donate=(1,),
        compiler_options=functools.partial(_xla_options, geom, num_tokens, "step"),
    )


def decode_program(cfg: ModelConfig, geom: Geometry, mesh: Mesh, num_tokens: int, out_avals: list) -> Program:
    """The multi-step decode program of one bucket (kiln.models.step.decode_steps): the step program's arguments,
    geom.decode_steps tokens per sequence per call."""
    return Program(
        name=f"decode_t{num_tokens}",
        fn=functools.partial(decode_steps, graph_config(cfg, geom), geom.attention, geom.decode_steps),
        args=step_args(cfg, geom, mesh, num_tokens),
        out=step_out(cfg, geom, mesh, out_avals, num_tokens, geom.decode_steps),
        donate=(1,),
        compiler_options=functools.partial(_xla_options, geom, num_tokens),  # at compile time: no import at a serve
    )


def _xla_options(geom: Geometry, num_tokens: int, kind: str = "decode") -> dict | None:
    """The XLA compile options of the decode program (kind "decode") or the step program (kind "step") of a bucket:
    pallas_gpu.compiler_options on cuda (for the geometry's weight format; imported here only: jax's Triton dialect
    costs a CPU start 0.2 s), None elsewhere."""
    if geom.attention != "pallas_gpu":
        return None
    from kiln.models.kernels import pallas_gpu

    return pallas_gpu.compiler_options(kind, num_tokens, geom.weight_format)


def init_kv_program(cfg: ModelConfig, geom: Geometry, mesh: Mesh) -> Program:
    """A program with no inputs that returns a zeroed, sharded KV cache (so allocating it compiles nothing)."""
    kv = kv_abstract(cfg, geom, mesh)

    def init_kv():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), kv)

    return Program(name="init_kv", fn=init_kv, args=(), out=kv)


def last_tokens(tokens: jax.Array, index: jax.Array) -> jax.Array:
    """(T,) input tokens of a decode batch from a multi-step decode's sampled tokens (steps, S): row index[i] of the
    last step, 0 where index is -1 (padding). kiln.serving.runner.Runner.dispatch_ahead's token gather."""
    return jnp.where(index >= 0, tokens[-1][jnp.maximum(index, 0)], 0).astype(jnp.int32)


def gather_program(cfg: ModelConfig, geom: Geometry, mesh: Mesh, num_tokens: int, out_avals: list) -> Program:
    """The run-ahead token gather of decode bucket T (last_tokens on decode_t<T>'s sampled tokens and a (T,) index),
    compiled ahead of time like the others: jitted at start, the three of a CPU artifact cost 0.16-0.27 CPU-s (tracing
    and lowering, most of it holding the GIL) of a SmolLM2 start before ready; deserialized, 5 ms."""
    rep = replicated(mesh)
    tokens = step_out(cfg, geom, mesh, out_avals, num_tokens, geom.decode_steps)[0].tokens
    index = jax.ShapeDtypeStruct((num_tokens,), jnp.int32, sharding=rep)
    out = jax.ShapeDtypeStruct((num_tokens,), jnp.int32, sharding=rep)
    return Program(name=f"gather_t{num_tokens}", fn=last_tokens, args=(tokens, index), out=out)


def program_names(geom: Geometry) -> list[str]:
    """The names of an artifact's programs: init_kv, the step programs from the largest bucket down, then the
    multi-step decode programs and, on one device (where the runner runs ahead), their token gathers."""
    steps = [f"step_t{t}" for t in sorted(geom.buckets, reverse=True)]
    decodes = [f"decode_t{t}" for t in sorted(geom.decode_buckets, reverse=True)]
    gathers = [f"gather_t{t}" for t in sorted(geom.decode_buckets, reverse=True)] if geom.tp == 1 else []
    return ["init_kv", *steps, *decodes, *gathers]


def program(cfg: ModelConfig, geom: Geometry, mesh: Mesh, out_avals: list, name: str) -> Program:
    """The program of that name (program_names): a load builds only those it deserializes (a deferred CPU load's
    first ones before ready; all twelve of a SmolLM2 CPU artifact's signatures took 0.06-0.15 CPU-s there)."""
    if name == "init_kv":
        return init_kv_program(cfg, geom, mesh)
    kind, num_tokens = name.rsplit("_t", 1)
    build = {"step": step_program, "decode": decode_program, "gather": gather_program}[kind]
    return build(cfg, geom, mesh, int(num_tokens), out_avals)


def programs(cfg: ModelConfig, geom: Geometry, mesh: Mesh, out_avals: list) -> list[Program]:
    """Every program of an artifact, in program_names' order."""
    return [program(cfg, geom, mesh, out_avals, name) for name in program_names(geom)]
