"""On-device sampling (models/sampling.py), against numpy: each option does what it says, measured over many draws
(one jitted call samples thousands of rows, each row its own (seed, position))."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kiln.models.sampling import (
    CANDIDATES,
    MAX_LOGPROBS,
    SamplingBatch,
    _argmax,
    apply_mask,
    apply_penalties,
    gumbel,
    mask_words,
    plain,
    sample,
    sample_greedy,
    top_k_pieces,
)
from kiln.models.sampling import _sample as sample_every_option

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # small programs: compiling costs more than running

S, V, H = 4096, 32, 16


@pytest.fixture(scope="module")
def run():
    fn = jax.jit(sample)

    def call(logits, sb, positions):
        out = fn(np.asarray(logits, np.float32), sb, np.asarray(positions, np.int32))
        return jax.tree.map(np.asarray, out)

    return call


def batch(**rows) -> SamplingBatch:
    sb = SamplingBatch.neutral(S, H, vocab_size=V)
    for name, value in rows.items():
        getattr(sb, name)[...] = value
    return sb


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(size=V).astype(np.float32) * 2.0  # (V,)


def draws(run, logits, **params):
    sb = batch(**{"seeds": np.arange(S), "temperature": 1.0, **params})
    out = run(np.tile(logits, (S, 1)), sb, np.full(S, 5))
    return out.tokens


def freqs(tokens):
    return np.bincount(tokens, minlength=V) / len(tokens)


def test_greedy_and_top_k_1_are_argmax(run):
    rng = np.random.default_rng(1)
    lg = rng.normal(size=(S, V)).astype(np.float32)
    greedy = run(lg, batch(), np.zeros(S)).tokens
    assert (greedy == lg.argmax(-1)).all()
    top1 = run(lg, batch(temperature=1.0, top_k=1, seeds=np.arange(S)), np.zeros(S)).tokens
    assert (top1 == greedy).all()


def test_argmax_first_among_equals_on_every_row_count():
    """_argmax (two reductions on the CPU from 2 rows up) equals numpy's argmax: ties to the lowest index, a NaN as
    the largest (its first), rows of -inf."""
    rng = np.random.default_rng(7)
    for rows in (1, 2, 5, 16):
        x = rng.integers(-3, 4, size=(rows, 999)).astype(np.float32)  # many ties
        x[0, :] = -np.inf
        x[-1, [17, 500]] = np.nan
        got = np.asarray(jax.jit(_argmax)(x))
        np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_temperature_draws_follow_the_scaled_softmax(run, logits):
    for t in (0.5, 1.0, 2.0):
        f = freqs(draws(run, logits, temperature=t))
        assert 0.5 * np.abs(f - softmax(logits / t)).sum() < 0.04, t


def test_top_k_top_p_min_p_restrict_the_support(run, logits):
    order = np.argsort(-logits)
    p = softmax(logits)
    f = freqs(draws(run, logits, top_k=3))
    assert set(np.flatnonzero(f)) == set(order[:3].tolist())
    ref = np.zeros(V)
    ref[order[:3]] = p[order[:3]] / p[order[:3]].sum()
    assert 0.5 * np.abs(f - ref).sum() < 0.03

    cum = np.cumsum(p[order])
    n = int(np.searchsorted(cum, 0.6) + 1)  # smallest prefix with mass >= 0.6
    f = freqs(draws(run, logits, top_p=0.6))
    assert set(np.flatnonzero(f)) == set(order[:n].tolist())

    f = freqs(draws(run, logits, min_p=0.2))
    assert set(np.flatnonzero(f)) == set(np.flatnonzero(p >= 0.2 * p.max()).tolist())

    # top-p applies to the top-k distribution: with k=4 and p=0.99 the support is the top 4
    f = freqs(draws(run, logits, top_k=4, top_p=0.99))
    assert set(np.flatnonzero(f)) == set(order[:4].tolist())


def test_a_seeded_draw_depends_only_on_seed_position_and_its_logits(run):
    rng = np.random.default_rng(2)
    lg = rng.normal(size=(S, V)).astype(np.float32)
    seeds = rng.integers(0, 2**32, S, dtype=np.uint32)
    pos = rng.integers(0, 1000, S)
    sb = batch(temperature=0.9, top_p=0.95, seeds=seeds)
    a = run(lg, sb, pos).tokens
    perm = rng.permutation(S)
    sb2 = batch(temperature=0.9, top_p=0.95, seeds=seeds[perm])
    sb2.temperature[perm[:100]] = 0.9  # same rows, other neighbours differ in nothing but order
    b = run(lg[perm], sb2, pos[perm]).tokens
    assert (a[perm] == b).all()
    # different neighbours: half the batch greedy, penalised, or at another temperature
    sb3 = batch(temperature=0.9, top_p=0.95, seeds=seeds)
    sb3.temperature[::2] = 0.0
    sb3.repetition_penalty[1::4] = 1.3
    c = run(lg, sb3, pos).tokens
    same = (sb3.temperature > 0) & (sb3.repetition_penalty == 1)
    assert (c[same] == a[same]).all()
    # another position (or seed) gives a fresh draw
    d = run(lg, sb, pos + 1).tokens
    assert (d != a).mean() > 0.5


def test_blocked_tokens_are_never_chosen(run):
    rng = np.random.default_rng(3)
    lg = rng.normal(size=(S, V)).astype(np.float32)
    sb = batch(seeds=np.arange(S))
    best = lg.argmax(-1)
    sb.blocked[:, 0] = best
    sb.temperature[S // 2 :] = 1.5
    out = run(lg, sb, np.zeros(S)).tokens
    assert not (out == best).any()
    second = np.argsort(-lg, -1)[:, 1]
    assert (out[: S // 2] == second[: S // 2]).all()


def test_logprobs_are_the_raw_distribution(run):
    rng = np.random.default_rng(4)
    lg = rng.normal(size=(S, V)).astype(np.float32)
    out = run(lg, batch(temperature=0.5, seeds=np.arange(S), want_top=np.ones(S, np.int32)), np.zeros(S))
    lp = np.log(softmax(lg.astype(np.float64)))
    np.testing.assert_allclose(out.logprobs, lp[np.arange(S), out.tokens], atol=1e-5)
    assert (out.top_ids == np.argsort(-lg, -1, kind="stable")[:, :MAX_LOGPROBS]).all()
    np.testing.assert_allclose(out.top_logprobs, np.sort(lp, -1)[:, ::-1][:, :MAX_LOGPROBS], atol=1e-5)
    plain = run(lg, batch(temperature=0.5, seeds=np.arange(S)), np.zeros(S))  # no row asks: zeros
    assert (plain.tokens == out.tokens).all() and (plain.logprobs == out.logprobs).all()
    assert not plain.top_ids.any() and not plain.top_logprobs.any()
    some = run(lg, batch(temperature=0.5, seeds=np.arange(S), want_top=np.arange(S) % 2), np.zeros(S))
    assert (some.top_ids[1::2] == out.top_ids[1::2]).all() and not some.top_ids[::2].any()  # only the rows that ask


def test_a_plain_batch_samples_greedily_without_the_other_options():
    """sample runs sample_greedy where no row samples, has a penalty or asks for top logprobs: the same tokens,
    logprobs and (zero) top logprobs as the whole sampler, blocked ids and token masks included."""
    rng = np.random.default_rng(9)
    lg = rng.normal(size=(S, V)).astype(np.float32)
    sb = batch()
    sb.blocked[:, 0] = lg.argmax(-1)
    sb.allowed[: S // 2] = rng.integers(-(2**31), 2**31, size=(S // 2, mask_words(V)), dtype=np.int64).astype(np.int32)
    sb.allowed[: S // 2, 0] |= 1  # token 0 stays allowed
    pos = np.zeros(S, np.int32)
    assert bool(plain(sb))
    fast, full, gated = (jax.tree.map(np.asarray, jax.jit(f)(lg, sb, pos)) for f in (sample_greedy, sample_every_option,
                                                                                     sample))  # fmt: skip
    for a, b in ((fast, full), (gated, full)):
        assert all((x == y).all() for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    for row in ({"temperature": 0.5}, {"repetition_penalty": 1.2}, {"want_top": 1}):
        assert not bool(plain(batch(**{k: np.where(np.arange(S) == 7, v, getattr(sb, k)) for k, v in row.items()})))


def numpy_penalties(logits, history, n_prompt, rep, pres, freq):
    out = logits.astype(np.float64).copy()
    for s in range(len(out)):
        h = [t for t in history[s] if t >= 0]
        seen = set(h)
        counts = np.bincount(h[n_prompt[s] :], minlength=V) if h[n_prompt[s] :] else np.zeros(V)
        for t in seen:
            out[s, t] = out[s, t] / rep[s] if out[s, t] > 0 else out[s, t] * rep[s]
        out[s] -= freq[s] * counts + pres[s] * (counts > 0)
    return out


def test_penalties_match_numpy_and_push_the_right_way(run):
    rng = np.random.default_rng(5)
    n = 64
    lg = rng.normal(size=(n, V)).astype(np.float32) * 3
    sb = SamplingBatch.neutral(n, H, vocab_size=V)
    for s in range(n):
        k = rng.integers(0, H + 1)
        sb.history[s, :k] = rng.integers(0, 6, k)  # few distinct ids: many repeats
        sb.history_prompt[s] = rng.integers(0, k + 1)
    sb.repetition_penalty[:] = rng.uniform(0.5, 2.0, n)
    sb.presence_penalty[:] = rng.uniform(-2, 2, n)
    sb.frequency_penalty[:] = rng.uniform(-2, 2, n)
    got = np.asarray(jax.jit(apply_penalties)(lg, sb))
    ref = numpy_penalties(lg, sb.history, sb.history_prompt, sb.repetition_penalty, sb.presence_penalty,
                          sb.frequency_penalty)  # fmt: skip
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

    # in the sampler: a repeated greedy favourite loses to the runner-up under a strong penalty
    lg = np.zeros((S, V), np.float32)
    lg[:, 7], lg[:, 9] = 3.0, 2.0
    sb = batch()
    sb.history[:, :3] = 7
    sb.history_prompt[:] = 0
    base = run(lg, sb, np.zeros(S)).tokens
    assert (base == 7).all()
    for field, value in (("repetition_penalty", 2.0), ("frequency_penalty", 0.5), ("presence_penalty", 1.5)):
        sb2 = batch()
        sb2.history[:, :3] = 7
        getattr(sb2, field)[:] = value
        assert (run(lg, sb2, np.zeros(S)).tokens == 9).all(), field
    # presence/frequency ignore prompt tokens; repetition does not
    sb3 = batch(presence_penalty=1.5)
    sb3.history[:, :3] = 7
    sb3.history_prompt[:] = 3
    assert (run(lg, sb3, np.zeros(S)).tokens == 7).all()
    # sampled: a frequency penalty lowers the penalised token's share to what numpy predicts
    sb4 = batch(temperature=1.0, seeds=np.arange(S))
    plain = (run(lg, sb4, np.zeros(S)).tokens == 7).mean()
    assert abs(plain - softmax(lg[0])[7]) < 0.03
    sb4.history[:, :3] = 7
    sb4.frequency_penalty[:] = 0.3
    penalised = lg[0].copy()
    penalised[7] -= 0.9
    share = (run(lg, sb4, np.zeros(S)).tokens == 7).mean()
    assert abs(share - softmax(penalised)[7]) < 0.03 and share < plain - 0.1


# --- the structured-output token mask ---------------------------------------------------------------------------
def random_masks(rng, rows: int, vocab: int, density: float) -> np.ndarray:
    """Bitmasks (rows, mask_words(vocab)) int32 in llguidance's layout, each row allowing >= 1 token."""
    allowed = rng.random((rows, vocab)) < density  # (rows, V)
    allowed[np.arange(rows), rng.integers(0, vocab, rows)] = True
    padded = np.zeros((rows, mask_words(vocab) * 32), bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32), allowed


def test_mask_matches_llguidance_reference():
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(7)
    for vocab in (V, 45, 64):  # a vocabulary that does not fill its last word, and one that does
        lg = rng.normal(size=(64, vocab)).astype(np.float32)
        words, allowed = random_masks(rng, 64, vocab, 0.3)
        ref = lg.copy()
        apply_token_bitmask_inplace(ref, words)
        got = np.asarray(jax.jit(apply_mask)(lg, words))
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(np.isfinite(got), allowed)


def test_sampled_token_is_always_allowed(run):
    rng = np.random.default_rng(8)
    lg = rng.normal(size=(S, V)).astype(np.float32) * 3
    words, allowed = random_masks(rng, S, V, 0.2)
    free = rng.random(S) < 0.25  # some rows unconstrained in the same batch
    words[free] = -1
    allowed[free] = True
    params = dict(
        temperature=rng.choice([0.0, 0.7, 1.5], S), top_k=rng.choice([0, 3], S), top_p=rng.choice([1.0, 0.8], S),
        seeds=np.arange(S), allowed=words,
    )  # fmt: skip
    out = run(lg, batch(**params), np.arange(S))
    assert allowed[np.arange(S), out.tokens].all()
    greedy = out.tokens[params["temperature"] == 0]
    masked = np.where(allowed, lg, -np.inf)[params["temperature"] == 0]
    np.testing.assert_array_equal(greedy, masked.argmax(-1))  # greedy = argmax over the allowed tokens
    # logprobs stay those of the raw distribution
    raw = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(S), out.tokens], rtol=1e-4, atol=1e-4)


def test_all_ones_mask_changes_nothing(run):
    rng = np.random.default_rng(9)
    lg = rng.normal(size=(S, V)).astype(np.float32)
    params = dict(temperature=rng.choice([0.0, 1.0], S), seeds=np.arange(S))
    plain = run(lg, batch(**params), np.arange(S))
    # one constrained row makes the sampler apply the mask to every row: the free rows (all ones) are unchanged
    words = batch(**params).allowed
    words[0, 0] = 1
    masked = run(lg, batch(**params, allowed=words), np.arange(S))
    np.testing.assert_array_equal(plain.tokens[1:], masked.tokens[1:])
    assert masked.tokens[0] == 0


# --- truncation among the CANDIDATES largest logits (a vocabulary larger than them) -------------------------------
def test_truncation_among_the_candidates():
    """top-k is capped at CANDIDATES; top-p and min-p are exact when their support fits in the candidates, and on
    CPUs and GPUs also when it does not (a search for the cut-off over the whole vocabulary): each row draws what a
    sort's support and the same per-token noise give; rows that do not truncate still draw from the whole
    vocabulary."""
    vocab, rows = 4 * CANDIDATES, 1024
    rng = np.random.default_rng(11)
    peaked = rng.normal(size=vocab).astype(np.float32) * 4.0  # the nucleus at 0.9 fits in the candidates
    flat = rng.normal(size=vocab).astype(np.float32) * 0.1  # it does not
    order = {name: np.argsort(-lg) for name, lg in (("peaked", peaked), ("flat", flat))}
    fn = jax.jit(sample)
    seeds, positions = np.arange(rows, dtype=np.uint32), np.full(rows, 3, np.int32)

    def tokens(lg, **params):
        sb = SamplingBatch.neutral(rows, H, vocab_size=vocab)
        sb.seeds[:], sb.temperature[:] = seeds, 1.0
        for name, value in params.items():
            getattr(sb, name)[...] = value
        return np.asarray(fn(np.tile(lg, (rows, 1)), sb, positions).tokens)

    def support(lg, **params):
        return set(tokens(lg, **params).tolist())

    p = softmax(peaked.astype(np.float64))
    cum = np.cumsum(p[order["peaked"]])
    n = int(np.searchsorted(cum, 0.9) + 1)
    assert n < CANDIDATES
    assert support(peaked, top_p=0.9) == set(order["peaked"][:n].tolist())
    assert support(peaked, min_p=0.05) == set(np.flatnonzero(p >= 0.05 * p.max()).tolist())
    # top-k past the candidates keeps the candidates (1024 draws over 128 near-equal tokens cover almost all)
    top = set(order["flat"][:CANDIDATES].tolist())
    got = support(flat, top_k=1000)
    assert got <= top and len(got) > 0.9 * CANDIDATES
    # top-p and min-p supports wider than the candidates: exactly the sorted support's Gumbel-max, row by row
    noise = np.asarray(gumbel(seeds, positions, np.arange(vocab)))  # (rows, vocab)
    pf = softmax(flat.astype(np.float64))
    cum = np.cumsum(pf[order["flat"]])
    for params, keep in (
        ({"top_p": 0.5}, order["flat"][: int(np.searchsorted(cum, 0.5) + 1)]),
        ({"top_p": 0.99}, order["flat"][: int(np.searchsorted(cum, 0.99) + 1)]),
        ({"min_p": 0.5}, np.flatnonzero(pf >= 0.5 * pf.max())),
        ({"top_p": 0.9, "min_p": 0.8}, np.intersect1d(order["flat"][: int(np.searchsorted(cum, 0.9) + 1)],
                                                      np.flatnonzero(pf >= 0.8 * pf.max()))),
    ):  # fmt: skip
        allowed = np.full(vocab, -np.inf)
        allowed[keep] = 0.0
        expect = np.argmax(flat[None, :] + noise + allowed[None, :], axis=-1)
        got = tokens(flat, **params)
        assert (got == expect).all(), (params, len(keep), int((got != expect).sum()))
    assert len(np.flatnonzero(pf >= 0.5 * pf.max())) > CANDIDATES
    # no truncation: the whole vocabulary
    assert len(support(flat) - top) > 0.5 * (vocab - CANDIDATES)


def test_top_k_pieces_is_lax_top_k():
    """The GPUs' top_k in rounds over pieces gives lax.top_k's values, ids and order, ties (lowest id first) and -inf
    rows included, for one round, two rounds, a width that is not whole pieces, and no round at all."""
    rng = np.random.default_rng(3)
    for rows, width, k, piece in ((3, 128256, 128, 4096), (2, 9000, 20, 64), (2, 1000, 7, 64), (2, 50, 5, 64)):
        x = (np.round(rng.normal(size=(rows, width)) * 4) / 4).astype(np.float32)  # many equal values
        x[0, : width - 3] = -np.inf  # fewer finite entries than k
        x[1, ::3] = -np.inf
        want = jax.lax.top_k(x, k)
        got = jax.jit(lambda x, k=k, piece=piece: top_k_pieces(x, k, piece))(x)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
