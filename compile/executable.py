"""Programs as bytes without pickle: jax.export for the portable form, XLA's own serialization for executables.

A Program is a flat-argument function (a tuple of arrays in, a tuple of arrays out) plus the trees that give it
kiln's structured signature back. `export` writes StableHLO with jax.export; `compile_exported` compiles it for the
local devices (or a deviceless TPU topology); `serialize` / `load_executable` move a compiled executable to bytes
and back. The pytree structures, avals and shardings are never stored: they are rebuilt from the manifest's model
config and KV geometry, so an artifact holds no pickle.

`load_executable` rebuilds jax's Compiled object around a deserialized XLA executable, as
jax.experimental.serialize_executable does but without its pickle; it uses jax internals and is only used when the
jax and jaxlib versions match those that wrote the executable (the artifact's manifest checks that first).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
from jax._src import compilation_cache, config, core, stages
from jax._src.interpreters import pxla
from jax._src.lib import xla_client as xc
from jax.experimental.layout import Format, Layout

from kiln.models.errors import KilnError

# Pallas GPU kernels lower to custom calls that jax.export gives no compatibility guarantee for. They are allowed:
# such an artifact recompiles from .exported under the jax that wrote it (the manifest records it); under another
# jax the recompile may fail, and the artifact must be compiled again. kiln_gguf_matmul: kiln's own CPU kernel of the
# GGUF weight formats (kiln.models.kernels.cpu_quant, registered before an artifact loads); kiln_paged_attention: its
# decode attention of the cpu target (kiln.models.kernels.xla_cpu); __cudnn$fmhaSoftmax: cuDNN's flash attention of a
# prefill step's pieces (kiln.models.kernels.cudnn_gpu).
UNGUARANTEED_KERNELS = [
    jax.export.DisabledSafetyCheck.custom_call(t)
    for t in ("__gpu$xla.gpu.triton", "mosaic_gpu", "kiln_gguf_matmul", "kiln_paged_attention", "__cudnn$fmhaSoftmax")
]


@dataclass
class Program:
    """One program's signature: structured abstract inputs and outputs with their shardings, donated arguments.

    args: the positional arguments as a tuple of pytrees of jax.ShapeDtypeStruct, each carrying its sharding.
    out: the outputs as a pytree of jax.ShapeDtypeStruct with shardings (its structure is the result's).
    donate: positions of `args` whose buffers the program consumes (the KV cache).
    """

    name: str
    fn: Callable
    args: tuple
    out: object
    donate: tuple[int, ...] = ()
    # XLA options of its compile (compile_exported), e.g. the GEMM backend, or a callable that gives them then (a serve
    # that deserializes its executables builds Programs for their signatures and must not import what the options need)
    compiler_options: dict | Callable[[], dict | None] | None = None

    @property
    def flat_args(self) -> list[jax.ShapeDtypeStruct]:
        return jax.tree.leaves(self.args)

    @property
    def flat_out(self) -> list[jax.ShapeDtypeStruct]:
        return jax.tree.leaves(self.out)

    @property
    def donated_flat(self) -> list[bool]:
        """Per flat argument, whether it is donated."""
        flags = []
        for i, arg in enumerate(self.args):
            flags += [i in self.donate] * len(jax.tree.leaves(arg))
        return flags

    def flat_fn(self) -> Callable:
        """fn over flat arguments returning a flat tuple (what jax.export stores without custom pytree nodes)."""
        in_tree = jax.tree.structure(self.args)

        def flat(*leaves):
            return tuple(jax.tree.leaves(self.fn(*jax.tree.unflatten(in_tree, leaves))))

        return flat


def export(program: Program, platform: str) -> jax.export.Exported:
    """Trace and lower `program` for `platform` into a portable jax.export.Exported."""
    in_sh = [a.sharding for a in program.flat_args]
    out_sh = [a.sharding for a in program.flat_out]
    jitted = jax.jit(program.flat_fn(), in_shardings=in_sh, out_shardings=tuple(out_sh), keep_unused=True)
    with _mesh_of(program):  # kernels see the "tp" mesh and run per device on their heads
        exported = jax.export.export(jitted, platforms=[platform], disabled_checks=UNGUARANTEED_KERNELS)(
            *program.flat_args
        )
    if len(exported.out_avals) != len(out_sh):
        raise RuntimeError(
            f"{program.name}: the step returned {len(exported.out_avals)} arrays, expected {len(out_sh)}"
        )
    return exported


def _mesh_of(program: Program):
    meshes = {a.sharding.mesh for a in program.flat_args + program.flat_out}
    return jax.set_mesh(meshes.pop()) if len(meshes) == 1 else contextlib.nullcontext()


def compile_exported(exported: jax.export.Exported, program: Program) -> jax.stages.Compiled:
    """Compile an Exported for the devices named by `program`'s shardings; the donated arguments alias outputs."""
    donate = tuple(i for i, d in enumerate(program.donated_flat) if d)
    platform = exported.platforms[0]
    in_sh = [_format(a, platform) for a in program.flat_args]
    out_sh = tuple(_format(a, platform) for a in program.flat_out)
    jitted = jax.jit(exported.call, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate, keep_unused=True)
    with _no_persistent_cache():
        options = program.compiler_options
        return jitted.lower(*program.flat_args).compile(options() if callable(options) else options)


@contextlib.contextmanager
def _no_persistent_cache():
    """An artifact's executables are compiled, never read from jax's persistent compilation cache: on the CPU (jaxlib
    0.10.2) an executable read back from that cache serializes without its kernels' code, and the artifact then fails
    at its first call ("Function compare_reduce_fusion not found"), seen with JAX_COMPILATION_CACHE_DIR set and the
    same program compiled twice. jax decides once per process whether it uses the cache; the reset makes it ask again,
    with the cache off in this thread, and again after."""
    with config.enable_compilation_cache(False):
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            compilation_cache.reset_cache()


def _format(a: jax.ShapeDtypeStruct, platform: str):
    """The sharding of an argument or result, with the KV pages (the only 4-D arrays) pinned to the row-major
    layout on TPU. Left free, XLA-TPU gives a head_dim-64 cache a page-major entry layout and then copies every
    layer's K and V in and out of the kernel's layout on every step (seen in the compiled HLO: 1.5x the cache in
    temporaries); pinned, the scatter and the kernel work in place (at the price of padding head_dim to 128 lanes,
    which kv sizing counts)."""
    if platform == "tpu" and len(a.shape) == 4:
        return Format(Layout(major_to_minor=tuple(range(4))), a.sharding)
    return a.sharding


def serialize(compiled: jax.stages.Compiled) -> bytes:
    """XLA's serialization of a compiled executable (a protobuf, no pickle)."""
    exe = compiled.runtime_executable()
    if isinstance(exe, xc.LoadedExecutable):
        return bytes(exe.client.serialize_executable(exe))
    return bytes(exe.serialize())  # deviceless (TPU topology) compilation gives an unloaded executable


def load_executable(
    blob: bytes,
    program: Program,
    devices: Sequence,
    checked: Callable[[Callable[[], None]], object] | None = None,
    xla_exe=None,
) -> Callable:
    """A callable program(*args) -> out over structured arguments, from serialized executable bytes.

    devices: the runtime devices of the program's mesh (the shardings of `program` must live on them). No
    compilation happens here or when the result is called with arguments of the program's shapes. The executable's
    signature is checked (check_signature) before this returns, or, given `checked`, by the thunk handed to it (a
    loader runs it on another thread and waits for it before anything runs the program). xla_exe: `blob` already
    deserialized for `devices` (kiln.compile.checks.Prefetch.deserialize_first).
    """
    backend = devices[0].client
    device_list = xc.DeviceList(tuple(devices))
    if xla_exe is None:
        xla_exe = backend.deserialize_executable(blob, executable_devices=device_list)
    check = functools.partial(check_signature, xla_exe, program, devices[0].platform)
    check() if checked is None else checked(check)
    flat_args, flat_out = program.flat_args, program.flat_out
    in_avals = [core.ShapedArray(a.shape, a.dtype) for a in flat_args]
    out_avals = [core.ShapedArray(a.shape, a.dtype) for a in flat_out]
    in_sh = [a.sharding for a in flat_args]
    out_sh = [a.sharding for a in flat_out]
    xla_in, xla_out = pxla._get_layouts_from_executable(
        xla_exe, [None] * len(in_avals), [None] * len(out_avals), 0, in_avals, out_avals
    )
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=xla_exe,
        device_list=device_list,
        backend=backend,
        input_avals=in_avals,
        input_shardings=in_sh,
        output_avals=out_avals,
        output_shardings=out_sh,
        committed=True,
        name=program.name,
        unordered_effects=[],
        ordered_effects=[],
        keepalive=[],
        host_callbacks=[],
        kept_var_idx=set(range(len(in_avals))),
        mut=None,
        xla_in_layouts=xla_in,
        dispatch_in_layouts=pxla.get_dispatch_layouts(xla_in, in_sh, in_avals),
        xla_out_layouts=xla_out,
        all_args_info=None,
        pgle_profiler=None,
    )
    in_tree = jax.tree.structure((program.args, {}))
    args_info = in_tree.unflatten([stages.ArgInfo(a, d) for a, d in zip(in_avals, program.donated_flat, strict=True)])
    loaded = _accept_int4_arrays(unloaded.load())
    return stages.Compiled(loaded, [], args_info, jax.tree.structure(program.out), no_kwargs=True)


def _shard_bytes(a: jax.ShapeDtypeStruct, int4_packed: bool) -> int:
    shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
    n = math.prod(shape)
    if a.dtype in (jax.numpy.int4, jax.numpy.uint4):
        return (n + 1) // 2 if int4_packed else n
    return n * a.dtype.itemsize


def check_signature(xla_exe, program: Program, platform: str) -> None:
    """Refuse, in one sentence, an executable whose inputs and outputs are not the program's (the artifact's geometry
    and its executables disagree): their number, and their bytes per device (a KV cache of another size, another
    vocabulary or dtype), before anything runs on mismatched buffers. Checked on a CPU, where it is tested; elsewhere
    the manifest's sha256 is the check."""
    if platform != "cpu":
        return
    n_in, n_out = len(xla_exe.get_parameter_layouts()), len(xla_exe.get_output_layouts())
    want_in, want_out = len(program.flat_args), len(program.flat_out)
    problem = None
    if (n_in, n_out) != (want_in, want_out):
        problem = f"{n_in} inputs and {n_out} outputs where the geometry gives {want_in} and {want_out}"
    else:  # XLA's CPU buffers are dense, so bytes compare exactly
        stats = xla_exe.get_compiled_memory_stats()
        got = (stats.argument_size_in_bytes, stats.output_size_in_bytes)
        args, outs = program.flat_args, program.flat_out
        # int4 counted packed or not; a tuple of several results adds a table of 8-byte pointers
        wants = {(sum(_shard_bytes(a, p) for a in args), sum(_shard_bytes(a, p) for a in outs)) for p in (True, False)}
        wants |= {(a, o + 8 * len(outs)) for a, o in wants}
        if got not in wants:
            (a, o) = min(wants)
            problem = f"inputs of {got[0]} bytes and outputs of {got[1]} where the geometry gives {a} and {o}"
    if problem:
        raise KilnError(
            f"The artifact's program {program.name} takes {problem}; the manifest and the executables disagree, "
            f"recompile it with `kiln compile`."
        )


def _accept_int4_arrays(exe: pxla.MeshExecutable) -> pxla.MeshExecutable:
    """Drop the layout check of 4-bit parameters (the int4 weight format's): on jax 0.10.2's CPU an executable reports
    them packed (sub_byte_element_size_in_bits=4) while the CPU client's int4 arrays report an unpacked layout, so a
    Compiled refuses the arrays that jit passes to the same executable (jit's dispatch checks nothing here)."""
    exe._xla_in_layouts = [
        None if aval.dtype in (jax.numpy.int4, jax.numpy.uint4) else layout
        for layout, aval in zip(exe._xla_in_layouts, exe.in_avals, strict=True)
    ]
    return exe


def from_flat_compiled(compiled: jax.stages.Compiled, program: Program) -> Callable:
    """Wrap a Compiled over flat arguments (compile_exported's result) as program(*args) -> structured out."""
    out_tree = jax.tree.structure(program.out)
    _accept_int4_arrays(compiled._executable)

    def call(*args):
        return jax.tree.unflatten(out_tree, compiled(*jax.tree.leaves(args)))

    return call
