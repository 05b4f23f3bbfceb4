"""Weights in a target's layout: dtype, tensor-parallel sharding over the 1-D mesh axis "tp", flat names (weights.bin).

Megatron-style tensor parallelism: q/k/v/gate/up are column-parallel (output features split over "tp"), o/down are
row-parallel (input features split), so each device holds whole attention heads and a slice of the MLP; the KV cache
is split by KV head; the embedding and LM head are split over the vocabulary. A dimension that "tp" does not divide
(an odd vocabulary or MLP width) stays replicated. XLA's partitioner inserts the all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.quant import NARROW_DTYPES, QuantArray, stored_split_dim
from kiln.models.transformer import Weights

AXIS = "tp"

# Weights field -> which dimension is split over "tp": 0 = the first (rows), 1 = the second (columns).
SPLIT_DIM = {
    "wq": 1, "wk": 1, "wv": 1, "bq": 0, "bk": 0, "bv": 0,  # column-parallel: whole heads per device
    "wqkv": 1, "bqkv": 0, "w_gate_up": 1,  # the fused layout, grouped so that each device's piece is whole heads
    "wo": 0,  # row-parallel
    "w_gate": 1, "w_up": 1, "w_down": 0,  # MLP intermediate
    "experts_gate": 2, "experts_up": 2, "experts_down": 1,  # every expert's intermediate, like the MLP's (router: none)
    "embed": 0, "lm_head": 1,  # vocabulary
}  # fmt: skip
EXPERT_PARALLEL = {"experts_gate": 0, "experts_up": 0, "experts_down": 0}  # --expert-parallel: whole experts per device


def check_tp(cfg: ModelConfig, tp: int, device_count: int) -> None:
    """Raise a one-sentence KilnError unless `tp` devices can split this model's heads."""
    if tp < 1:
        raise KilnError(f"--tp must be a positive number of devices, not {tp}.")
    if cfg.num_kv_heads % tp:
        raise KilnError(
            f"--tp {tp} does not divide the model's {cfg.num_kv_heads} KV heads; choose a divisor of "
            f"{cfg.num_kv_heads}."
        )
    if tp > device_count:
        raise KilnError(f"--tp {tp} needs {tp} devices but the target has {device_count}.")


def default_tp(cfg: ModelConfig, device_count: int) -> int:
    """The widest tensor parallelism that both the KV heads and the device count allow."""
    return math.gcd(cfg.num_kv_heads, device_count)


def make_mesh(devices: Sequence, tp: int) -> Mesh:
    """The 1-D "tp" mesh over the first `tp` devices."""
    return Mesh(np.asarray(list(devices)[:tp]), (AXIS,))


def field_spec(field: str, shape: tuple[int, ...], tp: int, narrow: bool = False, expert_parallel: bool = False) -> P:
    """PartitionSpec of a weight tensor, by its Weights field name (a narrow weight's scale: "<field>_qscale");
    narrow: the q (out, in) of a narrow weight format's QuantArray. Where a split lands on a narrow weight's tensors is
    kiln.models.quant.stored_split_dim's business: a per-channel scale (out,) is split with a column-parallel weight
    and replicated with a row-parallel one, an int4 scale (out, in // g) like its q, when "tp" divides it.
    expert_parallel: a mixture of experts' stacked experts are split by expert (EXPERT_PARALLEL), not by width."""
    scale = field.endswith("_qscale")
    base = field.removesuffix("_qscale")
    dim = (EXPERT_PARALLEL if expert_parallel else SPLIT_DIM).get(base, SPLIT_DIM.get(base))
    if dim is not None and (narrow or scale):
        dim = stored_split_dim(base, dim, len(shape) if scale else None)
    if tp == 1 or dim is None or shape[dim] % tp:
        return P()
    return P(*[AXIS if i == dim else None for i in range(len(shape))])


def _field(path) -> str:
    """The field name of a Weights leaf for field_spec: its dataclass field, "<field>_qscale" for a QuantArray's
    scale."""
    name = path[-1].name
    if name in ("q", "scale") and len(path) > 1:  # a QuantArray's leaves
        return path[-2].name + ("_qscale" if name == "scale" else "")
    return name


def weight_shardings(
    cfg: ModelConfig,
    mesh: Mesh,
    dtype,
    weight_format: str = "float",
    expert_parallel: bool = False,
    fused: bool = False,
) -> Weights:
    """Weights.abstract(cfg, dtype, weight_format, fused) with each leaf's NamedSharding attached (expert_parallel: see
    field_spec; fused: kiln.models.transformer.fuse_linears's layout)."""
    tp = mesh.shape[AXIS]

    def spec(path, leaf):
        narrow = leaf.dtype in NARROW_DTYPES.values()
        sharding = NamedSharding(mesh, field_spec(_field(path), leaf.shape, tp, narrow, expert_parallel))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(spec, Weights.abstract(cfg, dtype, weight_format, fused))


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages (num_kv_heads, num_pages, page_size, head_dim) split by KV head."""
    return NamedSharding(mesh, P(AXIS) if mesh.shape[AXIS] > 1 else P())


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def leaf_name(path) -> str:
    """Flat checkpoint name of a Weights leaf: "embed", "layers.3.wq"; a QuantArray's q and scale are "layers.3.wq"
    and "layers.3.wq_qscale" (the names the artifact has always stored)."""
    name = jax.tree_util.keystr(path, simple=True, separator=".")
    if name.endswith(".q"):
        return name[:-2]
    if name.endswith(".scale"):
        return name[: -len(".scale")] + "_qscale"
    return name


def to_flat(weights: Weights) -> dict[str, object]:
    """{flat name: leaf} of a Weights (weights.bin holds this flat dict, compile/weightfile.py)."""
    return {leaf_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(weights)[0]}


def from_flat(template: Weights, flat: dict[str, object]) -> Weights:
    """Rebuild Weights from {flat name: leaf}, taking the structure from `template` (e.g. Weights.abstract)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: flat[leaf_name(path)], template)


def convert(weights: Weights, dtype) -> dict[str, np.ndarray]:
    """Host weights as the flat dict the artifact stores: float tensors cast to the target's compute dtype, int8 and
    int4 ones (a narrow weight format) kept (weights.bin stores int4 as two values a byte)."""
    np_dtype = np.dtype(dtype)
    kept = set()  # a GGUF block format's leaves keep their dtypes (uint8/int8 quants, float16 block scales)
    for path, leaf in jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, QuantArray))[0]:
        if isinstance(leaf, QuantArray) and leaf.kind:
            kept |= {leaf_name(path), leaf_name(path) + "_qscale"}

    def cast(name, a):
        a = np.asarray(a)
        return np.ascontiguousarray(a if a.dtype in NARROW_DTYPES.values() or name in kept else a.astype(np_dtype))

    return {name: cast(name, a) for name, a in to_flat(weights).items()}
