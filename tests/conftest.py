"""Test-wide setup: tests run on the CPU (libtpu, a test dependency for deviceless TPU compilation, must not make
jax look for a local TPU)."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2's float32 reference run (test_quant.smollm2_reference), computed once for every narrow-format test."""
    from test_quant import smollm2_reference

    return smollm2_reference()
