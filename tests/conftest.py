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


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2's float32 reference run (test_quant.smollm2_reference), computed once for every narrow-format test."""
    from test_quant import smollm2_reference

    return smollm2_reference()
