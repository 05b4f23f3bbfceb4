"""The TPU-only forms that cut what XLA-TPU moves (BENCHMARKS.md, issue 21), checked on the CPU against the forms the
other platforms run: the penalties with only their tally under a cond (sampling.penalise_tally_gated), and the tied
embedding read by columns (pallas_tpu.embed_columns, in Pallas's TPU interpret mode). The attention kernel's
lane-dense q layout is covered by tests/test_kernel_tpu.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.kernels.pallas_tpu import embed_columns
from kiln.models.sampling import SamplingBatch, apply_penalties, penalise_tally_gated

V, H = 384, 32


def test_tally_gated_penalties_equal_the_gated_ones():
    rng = np.random.default_rng(3)
    n = 16
    lg = (rng.normal(size=(n, V)) * 3).astype(np.float32)
    lg[0, :5] = -np.inf  # blocked or masked tokens stay -inf
    sb = SamplingBatch.neutral(n, H, vocab_size=V)
    run = jax.jit(penalise_tally_gated)
    # no row penalised: the logits come back bit for bit (a zero tally changes nothing)
    np.testing.assert_array_equal(np.asarray(run(lg, sb)), lg)
    for s in range(n):
        k = rng.integers(0, H + 1)
        sb.history[s, :k] = rng.integers(0, 8, k)
        sb.history_prompt[s] = rng.integers(0, k + 1)
    sb.repetition_penalty[: n // 2] = rng.uniform(0.5, 2.0, n // 2)  # half the rows penalised, half neutral
    sb.presence_penalty[: n // 2] = rng.uniform(-2, 2, n // 2)
    sb.frequency_penalty[: n // 2] = rng.uniform(-2, 2, n // 2)
    np.testing.assert_array_equal(np.asarray(run(lg, sb)), np.asarray(jax.jit(apply_penalties)(lg, sb)))


def test_embed_columns_equal_the_gather():
    rng = np.random.default_rng(4)
    table = jnp.asarray(rng.normal(size=(V, 48)), jnp.bfloat16)
    ids = jnp.asarray([5, 0, V - 1, 128, 127, 255, 7, 300, 1, 2, 129], jnp.int32)  # 11: a padded grid step
    got = embed_columns(table.T, ids, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table[ids]))
