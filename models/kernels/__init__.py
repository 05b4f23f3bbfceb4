"""Paged-attention implementations behind one signature (see reference.paged_attention).

`get_attention(name)` returns the implementation a target asks for: `reference` (plain jax.numpy, any device),
`pallas_tpu` (Mosaic) or `pallas_gpu` (Pallas on GPU; Triton lowering on CUDA and ROCm).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from kiln.models.errors import KilnError

IMPLEMENTATIONS = {
    "reference": "kiln.models.kernels.reference",
    "pallas_tpu": "kiln.models.kernels.pallas_tpu",
    "pallas_gpu": "kiln.models.kernels.pallas_gpu",
}


def get_attention(name: str) -> Callable:
    """The paged_attention function of implementation `name`."""
    if name not in IMPLEMENTATIONS:
        raise KilnError(f"Unknown attention implementation {name!r}; choose one of {', '.join(IMPLEMENTATIONS)}.")
    return importlib.import_module(IMPLEMENTATIONS[name]).paged_attention
