"""The fp8 weight format (kiln.models.quant, `--quantize fp8`): float8_e4m3fn weights with per-output-channel scales.
Both dots (weight-only up to FP8_WEIGHT_ONLY_MAX_ROWS rows, fp8 x fp8 above) against float64 oracles of the same
arithmetic, the rounding bound, a tiny model's logits, and SmolLM2 against float32 (logit error, greedy agreement on
the parity prompts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant import NEW_TOKENS, greedy, logits_three_ways, rounding_error
from tiny_models import make_model

from kiln.models import quant
from kiln.models.checkpoint import load_checkpoint
from kiln.models.quant import FP8_MAX, FP8_WEIGHT_ONLY_MAX_ROWS, QuantArray, linears, quantize_fp8, quantize_weights
from kiln.models.transformer import forward, logits


def fp8_round(a: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.float8_e4m3fn)).astype(np.float64)


def test_quantize_fp8_rounds_to_three_mantissa_bits():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 96)) * rng.exponential(1.0, (40, 96))).astype(np.float32)
    w[5] = 0  # an all-zero channel gets scale 1 and zeros
    q, scale = quantize_fp8(w)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (40, 96) and scale.shape == (40,) and scale.dtype == np.float32
    qf = np.asarray(q).astype(np.float64)
    assert np.abs(qf).max() == FP8_MAX and (qf[5] == 0).all() and scale[5] == 1
    err = np.abs(qf * scale[:, None] - w)
    # e4m3: relative rounding error <= 2^-4 for normal values; subnormals (|q| < 2^-6) have an absolute step of 2^-9
    assert (err <= np.maximum(np.abs(w) * 2**-4, scale[:, None] * 2**-10) * (1 + 1e-6)).all()


def test_fp8_terms_second_quantizes_what_the_first_leaves():
    """quant.quantize_fp8_terms (the fp8_x kernel's rows): one term is quantize_fp8_rows; two terms leave at most 2^-8
    of the row's largest value (each term's e4m3 rounding is <= 2^-4 of what it quantizes), about bf16's precision."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((8, 256)) * rng.exponential(1.0, (8, 256))).astype(np.float32)
    x[3] = 0  # a zero row stays zero in both terms
    (q1, s1), _ = quant.quantize_fp8_terms(jnp.asarray(x), 2)
    qr, sr = quant.quantize_fp8_rows(jnp.asarray(x))
    assert (np.asarray(q1, np.float32) == np.asarray(qr, np.float32)).all() and np.allclose(s1, sr)
    top = np.abs(x).max(axis=1, keepdims=True)
    for terms, bound in ((1, 2**-4), (2, 2**-8)):
        parts = quant.quantize_fp8_terms(jnp.asarray(x), terms)
        assert len(parts) == terms and all(q.dtype == jnp.float8_e4m3fn for q, _ in parts)
        got = sum(np.asarray(q, np.float64) * np.asarray(s, np.float64) for q, s in parts)
        err = np.abs(got - x)
        assert (err <= top * bound * (1 + 1e-6)).all() and (got[3] == 0).all(), (terms, (err / top.clip(1e-30)).max())


@pytest.mark.parametrize("rows, weight_only_rows", [(1, None), (5, None), (FP8_WEIGHT_ONLY_MAX_ROWS + 8, None), (5, 0)])
def test_fp8_linear_matches_oracle(rows, weight_only_rows, monkeypatch):
    """Weight-only up to FP8_WEIGHT_ONLY_MAX_ROWS rows; above, fp8 x fp8 with the rows quantized per row: one term,
    or two up to FP8_TWO_TERM_MAX_ROWS (reached here with weight_only_rows 0)."""
    if weight_only_rows is not None:
        monkeypatch.setattr(quant, "FP8_WEIGHT_ONLY_MAX_ROWS", weight_only_rows)  # read when traced: a fresh jit
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 96)).astype(np.float32) * 3
    w = rng.standard_normal((96, 40)).astype(np.float32)
    q, scale = quantize_fp8(w.T)  # (N, K) float8_e4m3fn, (N,)
    # a fresh function: jax.jit(linears) would reuse the trace of the same shapes under the other row limits
    (got,) = jax.jit(lambda x, w: linears(x, w))(jnp.asarray(x), QuantArray(jnp.asarray(q), jnp.asarray(scale)))
    wd = np.asarray(q).astype(np.float64) * scale[:, None]  # (N, K)
    if rows <= quant.FP8_WEIGHT_ONLY_MAX_ROWS:  # weight-only: x itself times the dequantized weight
        want = x.astype(np.float64) @ wd.T
    else:  # x quantized per row to float8_e4m3fn with scale max |x| / 448; a second term for what it leaves
        xs = np.abs(x).max(axis=1, keepdims=True).astype(np.float64) / FP8_MAX
        xq = fp8_round(x / xs) * xs
        if rows <= quant.FP8_TWO_TERM_MAX_ROWS:
            r = x - xq
            rs = np.abs(r).max(axis=1, keepdims=True) / FP8_MAX
            xq = xq + fp8_round(r / rs) * rs
        want = xq @ wd.T
    assert got.dtype == jnp.float32 and got.shape == (rows, 40)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fp8_x_fp8_dot_writes_bf16_rows():
    """bf16 rows above FP8_WEIGHT_ONLY_MAX_ROWS: the fp8 x fp8 dot's result is bf16 (FP8_DOT_OUT None: x's dtype, so
    cuBLASLt writes half the bytes that the scaling fusion reads back), then scaled: within two bf16 roundings of the
    float64 oracle on the same fp8 rows."""
    rows = FP8_WEIGHT_ONLY_MAX_ROWS + 8
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((rows, 96)) * 3, jnp.bfloat16)
    q, scale = quantize_fp8(rng.standard_normal((40, 96)).astype(np.float32))  # (N, K), (N,)
    w = QuantArray(jnp.asarray(q), jnp.asarray(scale))
    dots = [e for e in jax.make_jaxpr(quant.dot)(x, w).eqns if e.primitive.name == "dot_general"]
    assert [e.outvars[0].aval.dtype for e in dots] == [jnp.bfloat16]
    got = np.asarray(jax.jit(quant.dot)(x, w), np.float64)
    xf = np.asarray(x, np.float64)
    xs = np.abs(xf).max(axis=1, keepdims=True) / FP8_MAX
    want = (fp8_round(xf / xs) * xs) @ (np.asarray(q).astype(np.float64) * scale[:, None]).T
    np.testing.assert_allclose(got, want, atol=2 * 2**-8 * np.abs(want).max())


def test_tiny_model_fp8_logits(tmp_path):
    make_model("llama", tmp_path / "m")
    cfg, weights = load_checkpoint(tmp_path / "m")
    q = quantize_weights(weights, "fp8")
    assert q.weight_format == "fp8" and q.layers[0].wq.dtype == jnp.float8_e4m3fn
    _, ref, got, deq = logits_three_ways(cfg, weights, q, "fp8")
    # 27 rows (<= FP8_WEIGHT_ONLY_MAX_ROWS): weight-only, so float32 on the dequantized weights: 1e-5 allowed
    assert np.linalg.norm(got - deq) / np.linalg.norm(deq) < 1e-5
    eps = rounding_error(weights, q)  # ~2^-5 relative RMS per tensor
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"fp8 logit error {err:.4f}, weight rounding error {eps:.4f}")
    assert 0 < eps < 0.04 and err < 5 * eps, (err, eps)


@pytest.mark.parametrize("path", ["weight-only", "fp8 x fp8"])
def test_smollm2_fp8_against_float32(smollm2, path, monkeypatch):
    """Teacher-forced along float32's greedy path: logit error and argmax agreement per parity prompt; "fp8 x fp8"
    runs every dot with quantized activations (as prefill buckets above FP8_WEIGHT_ONLY_MAX_ROWS do)."""
    cfg, weights, tok, prompts, run, ref_seqs, ref = smollm2
    q = quantize_weights(weights, "fp8")
    if path == "fp8 x fp8":
        monkeypatch.setattr(quant, "FP8_WEIGHT_ONLY_MAX_ROWS", 0)  # read when traced: a fresh jit below
        monkeypatch.setattr(quant, "FP8_TWO_TERM_MAX_ROWS", 0)  # one term, as prefill

        @jax.jit
        def run(weights, kv, batch):
            hidden, kv = forward(cfg, weights, kv, batch)
            return logits(cfg, weights, hidden), kv

    n = NEW_TOKENS if path == "weight-only" else NEW_TOKENS // 2  # fp8 x fp8: the first half (a CPU step ~1 s)
    _, forced = greedy(cfg, q, prompts, run, forced=ref_seqs, new_tokens=n)
    report = []
    for s in range(len(prompts)):
        err = float(np.linalg.norm(forced[s] - ref[s][:n]) / np.linalg.norm(ref[s][:n]))
        agree = int((forced[s].argmax(-1) == ref[s][:n].argmax(-1)).sum())
        report.append((agree, round(err, 4)))
    print(f"SmolLM2 fp8 ({path}) vs float32 per prompt (argmax agreement of {n}, logit error): {report}")
    # Measured (2026-11-30, weight-only): relative logit error 9.8%, 7.7%, 12.4% (int8: ~4%; e4m3 keeps 3 mantissa
    # bits, a relative RMS error of ~2.5% per tensor against int8's 0.7%); argmax agreement 28, 29, 31 of 32. The chat
    # prompt's first free-running token is a near-tie that fp8 takes the other way.
    # fp8 x fp8 (prefill buckets above 128 rows; decode runs weight-only): 28, 28, 30 in one run and 27, 29, 31 in
    # another, on this CPU under load; the issue's >= 28 of 32 holds for the weight-only path that decodes. Over the
    # first 16 (2026-12-01): 14, 14, 15, logit error 13.6%, 13.6%, 11.1%.
    least = 28 if path == "weight-only" else 13
    for agree, err in report:
        assert agree >= least, report
        assert err < 0.2, report
