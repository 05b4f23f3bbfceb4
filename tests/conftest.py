"""Test-wide setup: tests run on the CPU (libtpu, a test dependency for deviceless TPU compilation, must not make
jax look for a local TPU)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
