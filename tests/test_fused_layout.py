"""The fused layout (kiln.models.transformer.fuse_linears: q|k|v and gate|up stored as one weight each, grouped by KV
head) computes what the separate weights compute, for every family and every format that has it, and its abstract
shapes and dtypes are those fuse_linears makes. Sharded over tp it must keep each device's heads together:
tests/test_tp.py checks artifacts of tp 1, 2 and 4 agree (and are stored fused)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_runs import logits_step
from tiny_models import FAMILIES, make_model

from kiln.models.batch import KVCache, SeqChunk, make_batch
from kiln.models.checkpoint import load_checkpoint
from kiln.models.quant import quantize_weights
from kiln.models.transformer import Weights, _interleave, fuse_linears, gate_up_groups

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # tiny models: compiling costs more than running

PAGE, PAGES_PER_SEQ = 16, 4


def run_logits(cfg, weights) -> np.ndarray:
    """Float32 logits (27, V) of two random prompts in one ragged prefill."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (20, 7)]
    chunks = [SeqChunk(p, 0, range(s * PAGES_PER_SEQ, (s + 1) * PAGES_PER_SEQ)) for s, p in enumerate(prompts)]
    kv = KVCache.create(cfg, num_pages=2 * PAGES_PER_SEQ, page_size=PAGE)
    batch = make_batch(chunks, PAGE, num_tokens=32, num_seqs=2, max_pages=PAGES_PER_SEQ)
    return np.asarray(logits_step(cfg)(weights, kv, batch)[0])[:27]


def test_interleave_takes_the_pieces_group_by_group():
    a, b = np.arange(8).reshape(1, 8), 100 + np.arange(4).reshape(1, 4)
    assert _interleave([a, b], 2, axis=1).tolist() == [[0, 1, 2, 3, 100, 101, 4, 5, 6, 7, 102, 103]]
    assert _interleave([a.T, b.T], 2, axis=0)[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 4, 5, 6, 7, 102, 103]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_layout_gives_the_separate_weights_logits(tmp_path, family):
    make_model(family, tmp_path / "m")
    cfg, weights = load_checkpoint(tmp_path / "m")
    fused = fuse_linears(cfg, weights)
    lw = fused.layers[0]
    assert lw.wq is None and lw.wqkv is not None and (lw.bqkv is not None) == cfg.qkv_bias
    assert (lw.w_gate_up is not None) == (not cfg.is_moe(0))
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(Weights.abstract(cfg, fused=True)), strict=True):
        assert got.shape == want.shape
    np.testing.assert_allclose(run_logits(cfg, fused), run_logits(cfg, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_fused_layout_of_a_narrow_format_gives_its_logits(tmp_path, fmt):
    """Per-output-channel formats fuse along the rows of q and of its scale (int4: (out, in // g) too), bfloat16."""
    make_model("qwen2", tmp_path / "m", num_attention_heads=8, num_key_value_heads=4, intermediate_size=96)
    cfg, weights = load_checkpoint(tmp_path / "m", dtype=jnp.bfloat16)
    q = quantize_weights(weights, fmt)
    fused = fuse_linears(cfg, q)
    assert gate_up_groups(cfg) == 4 and fused.weight_format == fmt
    abstract = Weights.abstract(cfg, jnp.bfloat16, fmt, fused=True)
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(abstract), strict=True):
        assert got.shape == want.shape  # (the artifact casts float32 scales to the compute dtype: convert)
    assert (
        fused.layers[0].wqkv.dtype == q.layers[0].wq.dtype and fused.layers[0].w_gate_up.dtype == q.layers[0].w_up.dtype
    )
    got, want = run_logits(cfg, fused), run_logits(cfg, q)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()  # bfloat16: one GEMM's rounding against three


def test_gguf_blocks_keep_the_separate_layout(tmp_path):
    make_model("llama", tmp_path / "m")
    cfg, weights = load_checkpoint(tmp_path / "m")
    q = quantize_weights(weights, "q8_0")
    assert fuse_linears(cfg, q) is q
    assert "wq" in Weights.layer_fields(cfg, "q8_0", fused=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_attention_reading_the_fused_qkv_gives_the_same_logits(tmp_path, family):
    """forward with pallas_gpu's fused-qkv entry point (Pallas interpret mode): q, k and v RoPE'd and read out of
    one array give the reference's logits (qkv biases, sliding windows and soft caps included)."""
    from functools import partial

    from kiln.models.kernels import pallas_gpu
    from kiln.models.transformer import forward, logits

    make_model(family, tmp_path / "m")
    cfg, weights = load_checkpoint(tmp_path / "m")
    fused = fuse_linears(cfg, weights)

    attention_qkv = partial(pallas_gpu.paged_attention_qkv, interpret=True)
    attention_qkv.takes_rope = True  # as the function itself: forward passes the un-rotated qkv and the RoPE tables

    @jax.jit
    def run(weights, kv, batch):
        hidden, _ = forward(
            cfg, weights, kv, batch,
            attention=partial(pallas_gpu.paged_attention, interpret=True), attention_qkv=attention_qkv,
        )  # fmt: skip
        return logits(cfg, weights, hidden)

    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (20, 7)]
    chunks = [SeqChunk(p, 0, range(s * PAGES_PER_SEQ, (s + 1) * PAGES_PER_SEQ)) for s, p in enumerate(prompts)]
    kv = KVCache.create(cfg, num_pages=2 * PAGES_PER_SEQ, page_size=PAGE)
    batch = make_batch(chunks, PAGE, num_tokens=32, num_seqs=2, max_pages=PAGES_PER_SEQ)
    got = np.asarray(run(fused, kv, batch))[:27]
    np.testing.assert_allclose(got, run_logits(cfg, weights), rtol=1e-4, atol=1e-4)
