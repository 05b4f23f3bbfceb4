"""The TPU-only forms that cut what XLA-TPU moves (BENCHMARKS.md, issue 21), checked on the CPU against the forms the
other platforms run: the tied embedding read by columns (pallas_tpu.embed_columns, in Pallas's TPU interpret mode).
The attention kernel's lane-dense q layout is covered by tests/test_kernel_tpu.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kiln.models.kernels.pallas_tpu import embed_columns

V = 384


def test_embed_columns_equal_the_gather():
    rng = np.random.default_rng(4)
    table = jnp.asarray(rng.normal(size=(V, 48)), jnp.bfloat16)
    ids = jnp.asarray([5, 0, V - 1, 128, 127, 255, 7, 300, 1, 2, 129], jnp.int32)  # 11: a padded grid step
    got = embed_columns(table.T, ids, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table[ids]))
