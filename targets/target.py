"""Target: the data that describes one hardware target, and the built-in targets.

A target says what a compiled artifact runs on (platform, device kind and count, the TPU topology used to compile
without the hardware), how the model is laid out there (the tensor-parallel mesh axis, compute and KV dtypes, the
attention implementation) and the shape of the work it is compiled for (page size, token buckets, max_num_seqs,
memory fraction). It holds no model math and no code that touches devices; detect.py resolves `auto`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.models.errors import KilnError
from kiln.models.quant import WEIGHT_FORMATS, is_weight_format

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# What a KV cache may hold, by the names users give (fp8 = float8_e4m3fn: half a bf16 cache's bytes, each value
# rounded to 3 mantissa bits when written; the attention widens it back to the compute dtype in registers).
KV_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp8": "float8_e4m3fn",
             "float8_e4m3fn": "float8_e4m3fn"}  # fmt: skip
GiB = 1 << 30


@dataclass(frozen=True)
class Target:
    """One hardware target. Frozen data; `replace` derives a variant (e.g. another attention for debugging)."""

    name: str
    platform: str  # cpu | cuda | rocm | tpu
    description: str
    needs: str  # what a machine needs to compile for and to serve this target
    device_kind: str | None = None  # jax's device_kind ("TPU v5 lite", "NVIDIA H200"); None = whatever is there
    device_count: int = 1  # devices of the slice or host
    topology: str | None = None  # libtpu topology name for deviceless compilation ("v5e:2x2")
    mesh_axes: tuple[str, ...] = ("tp",)  # the 1-D tensor-parallel axis
    attention: str = "reference"  # reference | xla_cpu | pallas_tpu | pallas_gpu
    compute_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    # how the artifact stores the weights: "float" (compute_dtype), "int8", "int4", "fp8", or GGUF blocks ("gguf": a
    # GGUF source's own, float for other sources; kiln.models.quant)
    weight_format: str = "float"
    page_size: int = 16  # tokens per KV page
    token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)  # T of the step programs
    max_num_seqs: int = 256  # S of the step programs
    decode_steps: int = 8  # decode tokens per dispatch when every running sequence decodes (1 = one per step)
    max_model_len: int = 8192  # cap on the model's own context length
    memory_fraction: float = 0.9  # of device memory for weights + KV + workspace
    device_memory_bytes: int | None = None  # per device; None = read from the device where it is present
    xla_flags: tuple[str, ...] = ()  # extra XLA_FLAGS (LIBTPU_INIT_ARGS on TPU) for serving

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise KilnError(f"Target {self.name!r} names the unknown platform {self.platform!r}.")
        if not self.token_buckets or list(self.token_buckets) != sorted(set(self.token_buckets)):
            raise KilnError(f"Target {self.name!r} needs increasing, distinct token buckets.")
        if not is_weight_format(self.weight_format):
            raise KilnError(
                f"Target {self.name!r} has weight format {self.weight_format!r}; choose one of "
                f"{', '.join(WEIGHT_FORMATS)}."
            )
        if not 0 < self.memory_fraction <= 1:
            raise KilnError(f"Target {self.name!r} has memory fraction {self.memory_fraction}, not in (0, 1].")

    def replace(self, **changes) -> Target:
        return dataclasses.replace(self, **changes)

    def env(self) -> dict[str, str]:
        """Environment variables a serving process of this target sets before jax starts."""
        if not self.xla_flags:
            return {}
        return {("LIBTPU_INIT_ARGS" if self.platform == "tpu" else "XLA_FLAGS"): " ".join(self.xla_flags)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Target:
        d = dict(d)
        for key in ("mesh_axes", "token_buckets", "xla_flags"):
            d[key] = tuple(d.get(key) or ())
        return cls(**d)


def _tpu(generation: str, chips: int, topology: str, kind: str, hbm_gib: int) -> Target:
    return Target(
        name=f"tpu-{generation}-{chips}",
        platform="tpu",
        description=f"TPU {generation} slice of {chips} chip{'s' if chips > 1 else ''} ({topology})",
        needs="libtpu to compile (any machine, deviceless); that TPU slice to serve",
        device_kind=kind,
        device_count=chips,
        topology=topology,
        attention="pallas_tpu",
        device_memory_bytes=hbm_gib * GiB,
    )


BUILTIN: dict[str, Target] = {
    t.name: t
    for t in [
        Target(
            name="cpu",
            platform="cpu",
            description="the host CPU (a GGUF's blocks kept for kiln's C++ kernels, else float32; --quantize float)",
            needs="nothing beyond jax; compiles and serves on any machine",
            attention="xla_cpu",
            compute_dtype="float32",
            kv_dtype="float32",
            # a GGUF keeps its blocks (kiln.models.gguf_quant; a GGUF without kept kinds, and any other checkpoint,
            # stays float32; without the C++ kernels so does a GGUF: kiln.compile.plan.resolve_target). Served
            # SmolLM2 Q4_1 against its float32 artifact: BENCHMARKS.md, issue 20, session 10. With int8 activations
            # the default model's greedy answer to the README's chat question flips on a 0.08-logit near-tie, to the
            # one llama.cpp gives on the same file; --quantize float keeps float32's.
            weight_format="gguf",
            # A CPU pays for padded rows in FLOPs (measured: SmolLM2's lm_head at M=16 costs 8x M=1), so decode gets
            # small buckets; a bucket of T tokens runs S = min(T, max_num_seqs) sequences.
            token_buckets=(1, 4, 16, 64, 256),
            max_num_seqs=16,
            # measured on 2 cores: 4 decode steps per dispatch cut SmolLM2's TPOT by 11-21% (the host's Python
            # competes with XLA for the cores); the 3 decode programs add ~20 s to the compile
            decode_steps=4,
            max_model_len=2048,
            memory_fraction=0.5,
        ),
        Target(
            name="cuda",
            platform="cuda",
            description="NVIDIA GPUs of this host (Pallas GPU attention)",
            needs="jax[cuda] and an NVIDIA GPU to compile executables and to serve (elsewhere only the portable "
            "programs are written; they compile once at first start)",
            attention="pallas_gpu",
        ),
        Target(
            name="rocm",
            platform="rocm",
            description="AMD GPUs of this host (Pallas GPU attention)",
            needs="jax with the ROCm plugin and an AMD GPU to compile executables and to serve (elsewhere only the "
            "portable programs are written)",
            attention="pallas_gpu",
        ),
        _tpu("v5e", 1, "v5e:1x1", "TPU v5 lite", 16),
        _tpu("v5e", 4, "v5e:2x2", "TPU v5 lite", 16),
        _tpu("v5e", 8, "v5e:2x4", "TPU v5 lite", 16),
        _tpu("v6e", 1, "v6e:1x1", "TPU v6 lite", 32),
        _tpu("v6e", 4, "v6e:2x2", "TPU v6 lite", 32),
        _tpu("v6e", 8, "v6e:2x4", "TPU v6 lite", 32),
        # multi-host slices (4 hosts of 4 chips): every host runs kiln serve (kiln.serving.multihost)
        _tpu("v5e", 16, "v5e:4x4", "TPU v5 lite", 16),
        _tpu("v6e", 16, "v6e:4x4", "TPU v6 lite", 32),
    ]
}
AUTO = "auto"


def target_names() -> list[str]:
    return [*BUILTIN, AUTO]


def get_target(name: str) -> Target:
    """A built-in target by name; `auto` is what this machine has (see detect.detect_target)."""
    if name == AUTO:
        from kiln.targets.detect import detect_target

        return detect_target()
    if name not in BUILTIN:
        raise KilnError(f"Unknown target {name!r}; choose one of {', '.join(target_names())}.")
    return BUILTIN[name]
