"""The TPU kernel compiles for real TPUs without one: libtpu's deviceless topologies give compile-only devices,
lowering inside jax.default_device(device) tells Pallas the TPU generation, Mosaic compiles the kernel, and the
executable serializes. Checked for the kernel alone and for the whole step program of a tiny model, on a v5e and a
v6e topology.

Loading the serialized executable back needs a TPU client (libtpu's compile-only client answers "PjRtCompiler must
be constructed with a Client to call DeserializeLoadedExecutable"), so that half is left to a machine with a TPU.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import serialize_executable, topologies

from kiln.models.batch import Batch, KVCache
from kiln.models.config import ModelConfig
from kiln.models.kernels import pallas_tpu
from kiln.models.sampling import SamplingBatch
from kiln.models.step import jit_step
from kiln.models.transformer import Weights

TOPOLOGIES = {"v5e:2x2": "TPU v5 lite", "v6e:2x2": "TPU v6 lite"}
KERNEL = "kiln_ragged_paged_attention"


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def device(request) -> jax.Device:
    """The first compile-only device of a TPU topology."""
    # deviceless compilation opens no TPU: do not let libtpu's one-process lockfile fail a second test process
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(platform="tpu", topology_name=request.param)
    dev = topology.devices[0]
    assert dev.platform == "tpu" and dev.device_kind == TOPOLOGIES[request.param]
    return dev


def on(dev: jax.Device, tree):
    """Abstract values (ShapeDtypeStruct pytree) placed on dev."""
    sharding = jax.sharding.SingleDeviceSharding(dev)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_and_serialize(dev: jax.Device, fn, *args) -> jax.stages.Compiled:
    """Lower fn for dev (inside default_device, so Pallas targets its generation), compile, serialize."""
    with jax.default_device(dev):
        lowered = fn.lower(*args)
        assert KERNEL in lowered.as_text(), "the Mosaic kernel is not in the program"
        compiled = lowered.compile()
    shardings = jax.tree.leaves(compiled.input_shardings)
    assert shardings and all(s.device_set == {dev} for s in shardings)
    payload, _, _ = serialize_executable.serialize(compiled)
    assert isinstance(payload, bytes) and len(payload) > 1000
    return compiled


def test_kernel_compiles_and_serializes(device):
    """Llama-3-8B attention shapes at a 2048-token bucket, 256 sequences of up to 32K tokens: the block tables
    (2 MiB) would not fit SMEM as a scalar prefetch, and the K/V write must not copy the 256 MiB cache."""
    t, s, max_pages, kvh, group, d, ps, num_pages = 2048, 256, 2048, 8, 4, 128, 16, 8192
    bf16 = jnp.bfloat16
    spec = jax.ShapeDtypeStruct
    pages = spec((kvh, num_pages, ps, d), bf16)
    args = on(
        device,
        (
            spec((t, kvh * group, d), bf16),
            spec((t, kvh, d), bf16),
            spec((t, kvh, d), bf16),
            pages,
            pages,
            Batch.abstract(t, s, max_pages),
        ),
    )
    fn = jax.jit(
        lambda *a: pallas_tpu.paged_attention(*a, scale=d**-0.5, sliding_window=4096, soft_cap=30.0),
        donate_argnums=(3, 4),
    )
    compiled = compile_and_serialize(device, fn, *args)
    cache_bytes = pages.size * pages.dtype.itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes / 16, "the K/V write copies the cache"


def test_step_program_compiles_and_serializes(device):
    cfg = ModelConfig(
        family="llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    t, s, max_pages, num_pages, ps = 32, 4, 8, 32, 16
    args = on(
        device,
        (
            Weights.abstract(cfg, jnp.bfloat16),
            KVCache.abstract(cfg, num_pages, ps, jnp.bfloat16),
            Batch.abstract(t, s, max_pages),
            SamplingBatch.abstract(s, cfg.vocab_size),
        ),
    )
    compile_and_serialize(device, jit_step(cfg, "pallas_tpu"), *args)


def test_multihost_slice_compiles():
    """A v5e 4x4 slice (16 chips on 4 hosts; the tpu-v5e-16 target): the step program of a model split over all 16
    chips compiles deviceless for the devices of every process, as each host's kiln serve runs it
    (kiln.serving.multihost)."""
    from kiln.compile import executable, lower
    from kiln.compile.build import compile_site
    from kiln.compile.convert import make_mesh
    from kiln.targets.target import get_target

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    target = get_target("tpu-v5e-16")
    site = compile_site(target)
    assert len(site.devices) == 16 and {d.process_index for d in site.devices} == {0, 1, 2, 3}
    cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=16, num_kv_heads=16, head_dim=128, max_position_embeddings=1024)  # fmt: skip
    geom = lower.Geometry(page_size=16, num_pages=256, max_pages_per_seq=16, max_model_len=256, max_num_seqs=8,
                          buckets=(16,), compute_dtype="bfloat16", kv_dtype="bfloat16", attention="pallas_tpu",
                          tp=16)  # fmt: skip
    mesh = make_mesh(site.devices, 16)
    with site.context():
        prog = lower.step_program(cfg, geom, mesh, 16, lower.step_out_avals(cfg, geom, mesh))
        compiled = executable.compile_exported(executable.export(prog, "tpu"), prog)
    kv = jax.tree.leaves(compiled.input_shardings)[len(jax.tree.leaves(prog.args[0]))]
    assert {d.process_index for d in kv.device_set} == {0, 1, 2, 3}
    assert len(executable.serialize(compiled)) > 1000
