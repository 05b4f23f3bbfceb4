"""The plan: (model, target, options) -> what the step programs are built for. Every option's default and check.

`kiln compile` lowers and compiles the plan's programs into an artifact; `kiln serve SRC --target jit`, `kiln generate`
and `LLM(source)` jit the same programs on the local device. Both ask `resolve_target` (the target with the options
applied, every option checked, before any weights are read) and then `make_geometry` (context length, KV pages,
tensor parallelism, once the model's config and weight bytes are known), so an option is defined and validated here
and nowhere else. An artifact's manifest records the plan; loading it back needs none of this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp

from kiln.compile import lower
from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.kernels import check_attention
from kiln.targets.detect import local_devices
from kiln.targets.target import KV_DTYPES, Target, get_target

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Options:
    """What a user may override (`kiln compile`/`serve`/`generate` flags, `LLM(...)` keywords); None = the target's
    or the model's default."""

    max_model_len: int | None = None
    kv_tokens: int | None = None
    kv_memory_fraction: float | None = None
    tp: int | None = None
    attention: str | None = None  # the target's fast path unless given; "reference" is the debugging oracle
    buckets: tuple[int, ...] | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None  # the largest bucket; the target's smaller buckets are kept
    dtype: str | None = None  # compute and KV dtype ("float32", "bfloat16")
    kv_dtype: str | None = None  # the KV cache's alone ("fp8": float8_e4m3fn, half the bytes of bf16); None = dtype
    decode_steps: int | None = None  # tokens per multi-step decode dispatch (1 = no decode programs)
    quantize: str | None = None  # the weight format ("float", "int8", "int4", ...); None = the target's
    expert_parallel: bool | None = None  # a mixture of experts' experts split over the --tp devices (else by width)

    @classmethod
    def from_kwargs(cls, **options) -> Options:
        """Options from keywords; an unknown one is a one-sentence KilnError."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(options) - names):
            raise KilnError(f"Unknown option {unknown[0]!r}; the options are {', '.join(sorted(names))}.")
        if options.get("buckets") is not None:
            options["buckets"] = tuple(options["buckets"])
        return cls(**options)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def resolve_target(target: str | Target, opts: Options) -> Target:
    """The target (a name, "auto" = this machine's) with the options applied, every option checked: what an
    artifact's manifest records as its target (before a GPU's device kind and count are filled in)."""
    target = get_target(target) if isinstance(target, str) else target
    for name in ("max_model_len", "kv_tokens", "tp", "max_num_seqs", "max_num_batched_tokens", "decode_steps"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise KilnError(f"--{name.replace('_', '-')} must be a positive number, not {value}.")
    if opts.buckets is not None and (not opts.buckets or min(opts.buckets) < 1):
        raise KilnError("--buckets must be positive token counts.")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise KilnError(f"Unknown dtype {opts.dtype!r}; choose one of {', '.join(DTYPES)}.")
    if opts.kv_dtype is not None and opts.kv_dtype not in KV_DTYPES:
        raise KilnError(f"Unknown KV dtype {opts.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}.")
    buckets = tuple(sorted(set(opts.buckets))) if opts.buckets else target.token_buckets
    if opts.max_num_batched_tokens:
        buckets = (*[b for b in buckets if b < opts.max_num_batched_tokens], opts.max_num_batched_tokens)
    target = target.replace(
        attention=opts.attention or target.attention,
        token_buckets=buckets,
        max_num_seqs=opts.max_num_seqs or target.max_num_seqs,
        compute_dtype=opts.dtype or target.compute_dtype,
        kv_dtype=KV_DTYPES.get(opts.kv_dtype or "", opts.kv_dtype) or opts.dtype or target.kv_dtype,
        decode_steps=opts.decode_steps or target.decode_steps,
        weight_format=opts.quantize or default_weight_format(target),
    )
    if jnp.dtype(target.kv_dtype).itemsize == 1 and target.attention == "pallas_tpu":
        raise KilnError("An fp8 KV cache needs --attention pallas_gpu, xla_cpu or reference (not pallas_tpu).")
    check_attention(target.attention)
    return target


def default_weight_format(target: Target) -> str:
    """The target's weight format, except that a cpu target's "gguf" default is float where kiln's C++ kernels are
    not built (GGUF blocks would run as XLA ops, slower than float32: BENCHMARKS.md, issue 20)."""
    if target.weight_format == "gguf" and target.platform == "cpu":
        from kiln.models.kernels import cpu_quant

        if not cpu_quant.available():  # logs once that the kernels are missing
            return "float"
    return target.weight_format


def make_geometry(cfg: ModelConfig, target: Target, opts: Options, *, tp: int, weight_bytes: int) -> lower.Geometry:
    """What the programs are compiled for, once the model is known: context length (the model's, capped by the
    target's, or --max-model-len), KV pages (kv_pages) and the target's buckets, dtypes and attention."""
    max_len = opts.max_model_len or min(cfg.max_position_embeddings, target.max_model_len)
    if max_len > cfg.max_position_embeddings:
        raise KilnError(f"--max-model-len {max_len} exceeds the model's {cfg.max_position_embeddings} positions.")
    max_pages = lower.pages_for(max_len, target.page_size)
    num_pages = kv_pages(cfg, target, opts, max_pages, weight_bytes, tp)
    buckets = target.token_buckets
    if cfg.num_experts and opts.buckets is None and buckets[0] > 1:
        # a mixture of experts decodes one sequence in a 1-row bucket: padding rows cost its dispatch (one Qwen3-30B-A3B
        # layer on an H200, the grouped kernel: 70 us at 1 row, 160 at 8; gather on the CPU copies every pair's experts)
        buckets = (1, *buckets)
    if opts.expert_parallel:
        if not cfg.num_experts:
            raise KilnError("--expert-parallel needs a mixture-of-experts model; this one is dense.")
        if tp < 2 or cfg.num_experts % tp:
            raise KilnError(
                f"--expert-parallel spreads the model's {cfg.num_experts} experts over the --tp devices; give --tp N "
                f"with N > 1 dividing {cfg.num_experts} (an artifact: `kiln compile --tp N --expert-parallel`)."
            )
    return lower.Geometry(
        page_size=target.page_size,
        num_pages=num_pages,
        max_pages_per_seq=max_pages,
        max_model_len=max_len,
        max_num_seqs=target.max_num_seqs,
        buckets=buckets,
        compute_dtype=target.compute_dtype,
        kv_dtype=target.kv_dtype,
        attention=target.attention,
        tp=tp,
        decode_steps=target.decode_steps,
        weight_format=target.weight_format,
        expert_parallel=bool(opts.expert_parallel),
        fused_linears=fuses_linears(target),
    )


def fuses_linears(target: Target) -> bool:
    """Are q|k|v and gate|up stored fused (kiln.models.transformer.fuse_linears)? On GPUs one GEMM each instead of
    XLA's per-step concatenation of the weights (H200 decode at batch 1: 5.07 -> 4.78 ms a token); on the CPU too (the
    same programs); not on TPUs, where splitting the fused projections moved a v5e step program's static bytes from
    <= 1.3x to 1.36x its ideal (tests/test_roofline.py)."""
    return target.platform != "tpu"


# full-length sequences a CPU's KV pool holds by default (--kv-tokens sets any size): a host's fresh memory costs its
# first touch at start-up, ~0.7 ns a byte of kernel time on the 2-core VM (SmolLM2's 16 x 2048 tokens, 1.51 GB: 1.1
# CPU-s of a 6-9 CPU-s start), and 2 cores serve a few long sequences at a time; 4 x 2048 tokens: 377 MB, the 16
# sequences' 512 tokens on average
CPU_KV_SEQS = 4


def kv_pages(
    cfg: ModelConfig, target: Target, opts: Options, max_pages_per_seq: int, weight_bytes: int, tp: int
) -> int:
    """Pages of the KV pool: --kv-tokens, or what the memory fraction leaves after weights and a workspace estimate,
    capped at max_num_seqs full-length sequences (a CPU's: CPU_KV_SEQS of them)."""
    page = target.page_size
    cap = target.max_num_seqs * max_pages_per_seq
    if target.platform == "cpu":
        cap = min(cap, CPU_KV_SEQS * max_pages_per_seq)
    if opts.kv_tokens is not None:
        pages = lower.pages_for(opts.kv_tokens, page)
        if pages < max_pages_per_seq:
            raise KilnError(
                f"--kv-tokens {opts.kv_tokens} holds less than one sequence of max_model_len "
                f"{max_pages_per_seq * page}; raise it or lower --max-model-len."
            )
        return pages
    memory = target.device_memory_bytes
    here = local_devices()
    if here.platform == target.platform and here.memory_bytes:
        memory = here.memory_bytes
    if memory is None:
        raise KilnError(f"The device memory of target {target.name} is unknown here; pass --kv-tokens N.")
    fraction = opts.kv_memory_fraction if opts.kv_memory_fraction is not None else target.memory_fraction
    if not 0 < fraction <= 1:
        raise KilnError(f"--kv-memory-fraction must be in (0, 1], not {fraction}.")
    # Workspace: activations of the largest bucket plus the sampler's (S, V) temporaries, in float32.
    max_bucket, max_num_seqs = max(target.token_buckets), target.max_num_seqs
    workspace = 4 * (
        max_bucket * (4 * cfg.hidden_size + 3 * cfg.intermediate_size // tp) + 8 * max_num_seqs * cfg.vocab_size
    )
    budget = memory * fraction - weight_bytes / tp - workspace
    per_page = lower.page_bytes(cfg, page, target.kv_dtype) / tp
    if target.platform == "tpu":  # the pinned row-major KV layout pads head_dim to whole 128-lane tiles
        per_page *= -(-cfg.head_dim // 128) * 128 / cfg.head_dim
    pages = min(cap, int(budget // per_page))
    if pages < max_pages_per_seq:
        raise KilnError(
            f"The KV cache for one sequence of {max_pages_per_seq * page} tokens does not fit in {fraction:.0%} of "
            f"{memory / 2**30:.1f} GiB after the weights; lower --max-model-len or raise --kv-memory-fraction."
        )
    return pages
