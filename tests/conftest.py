"""Test-wide setup: tests run on the CPU (libtpu, a test dependency for deviceless TPU compilation, must not make
jax look for a local TPU)."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache (~35 MB), shared by the xdist workers and the processes tests start. One run from
# a clean clone gains little (most programs compile once); a later local run skips the jit compiles (test_kv_fp8
# 164 -> 71 s). Artifacts' executables never come from it (kiln.compile.executable compiles them with it off).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).parent / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
sys.path.insert(0, str(Path(__file__).parent))


# The heaviest files first (CPU-seconds, a full run with --durations, 2026-12-01), so that the two xdist workers take
# the light ones last and end together (pyproject's addopts turn xdist's reorder by test count off).
HEAVY_FIRST = ("test_engine", "test_moe", "test_agent_api", "test_quant", "test_parity", "test_fp8", "test_kv_fp8",
               "test_deploy", "test_artifact", "test_tp", "test_server", "test_fp8_checkpoint", "test_tpu_compile",
               "test_gguf", "test_multihost", "test_kernel_tpu", "test_gguf_quant", "test_structured", "test_hub",
               "test_fused_layout", "test_user_errors", "test_compile")  # fmt: skip


# The files that take the session fixture `smollm2` (a 25-40 s float32 reference run) go to one worker together, so it
# is computed once; every other file is a unit of its own (xdist's loadfile). pyproject's addopts: --dist loadgroup.
# Likewise the files of the session fixture `tiny_cpu` (a tiny model's cpu artifact).
GROUPS = {name: "smollm2" for name in ("test_quant", "test_fp8", "test_kv_fp8", "test_gguf", "test_gguf_quant")}
GROUPS |= {"test_artifact": "tiny_cpu", "test_cold_start": "tiny_cpu"}
# And the files whose SmolLM2 engines share one geometry (server_harness.SMOL_ENGINE_ARGS), so that its step and decode
# programs compile once (jit caches live in one process), with the other users of server_harness.tiny_llm (the tiny
# AsyncLLM of test_server, built once per process with its warm-up compiles) and of its geometry (test_decode_steps:
# the same step programs, and its K = 4 decode programs).
ENGINES = ("test_engine", "test_agent_api", "test_server", "test_structured", "test_faults", "test_server_errors",
           "test_decode_steps")  # fmt: skip
GROUPS |= {name: "engines" for name in ENGINES}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the other files keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(GROUPS.get(item.path.stem, item.path.stem)))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2's float32 reference run (test_quant.smollm2_reference), computed once for every narrow-format test and
    for the GGUF tests' float32 side (test_gguf: against transformers; test_gguf_quant: the kept blocks)."""
    from test_quant import smollm2_reference

    return smollm2_reference()


@pytest.fixture(scope="session")
def tiny_cpu(tmp_path_factory):
    """(model folder, artifact) of test_artifact.compile_tiny: a tiny llama compiled once for test_artifact and
    test_cold_start."""
    from test_artifact import compile_tiny

    return compile_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def cheap_compiles():
    """A module of tiny programs, where XLA:CPU's compiles cost more than the runs, compiles them without most
    optimizations (jax_disable_most_optimizations: LLVM -O0, no expensive passes); the flag is restored after the
    module. Not for SmolLM2's programs (its decode runs ~34% slower at -O0). Take it with
    `pytestmark = pytest.mark.usefixtures("cheap_compiles")`."""
    import jax

    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", False)
