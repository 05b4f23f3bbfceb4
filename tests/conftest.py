"""Test-wide setup: tests run on the CPU (libtpu, a test dependency for deviceless TPU compilation, must not make
jax look for a local TPU)."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, shared by the xdist workers and the processes tests start: the
# same SmolLM2 programs are compiled by many test files (a 30-layer program costs 10-30 s on two cores). Artifacts'
# executables never come from it (kiln.compile.executable compiles them with the cache off).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).parent / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2's float32 reference run (test_quant.smollm2_reference), computed once for every narrow-format test."""
    from test_quant import smollm2_reference

    return smollm2_reference()
