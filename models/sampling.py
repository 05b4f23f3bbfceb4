"""On-device sampling inside the step program: only chosen token ids and logprobs leave the device.

SamplingBatch holds one row per sequence slot (padded to S). A row with temperature 0 is greedy.

Order of operations per row (vLLM's): raw logits -> repetition, frequency and presence penalties -> blocked tokens
(EOS and stop ids before min_tokens) -> the structured-output token mask -> greedy argmax, or temperature, then
top-k, top-p (over the top-k distribution) and min-p, then a Gumbel-max draw keyed by (seed, position) — so a seeded
row's draw depends on nothing else in the batch (see gumbel()). Logprobs are those of the raw model distribution
(OpenAI's and vLLM's default).

The token history the penalties need has a fixed shape: the last HISTORY_LEN tokens of each sequence (prompt then
output, -1 padded), and how many of them are prompt tokens. Repetition penalty applies to prompt and output tokens,
presence and frequency penalties to output tokens (OpenAI semantics).

Structured outputs: `allowed` is a per-row token bitmask filled on the host (llguidance's layout: bit v % 32 of int32
word v // 32 is set when token v may be chosen), so a grammar constrains a compiled program without recompiling it.
Free rows pass all ones (-1 words).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20  # top alternatives returned per token (OpenAI's limit)
HISTORY_LEN = 1024  # tokens of history seen by the penalties (the most recent ones)
MAX_BLOCKED = 8  # token ids a row can forbid (EOS and stop token ids while min_tokens is not reached)
# Truncation (top-k, top-p, min-p) chooses among each row's CANDIDATES largest logits (lax.top_k), not a sort of the
# whole vocabulary (vLLM-TPU's and JetStream's approach): top-k is capped at CANDIDATES. A top-p or min-p support wider
# than the candidates (a flat distribution at temperature 1: SmolLM2's 0.95 nucleus in 44% of positions, BENCHMARKS.md
# issue 21) is found exactly on GPUs and CPUs by a search for its cut-off logit over the whole vocabulary, only on
# steps that have such a row; TPUs keep the candidates for it (a cond's cost there, see _when).
# 128 is the largest k XLA-TPU's TopK takes in one pass over the logits; 256 sorts them.
CANDIDATES = 128


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of the token bitmask (32 tokens a word)."""
    return (vocab_size + 31) // 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    temperature: jax.Array  # (S,) float32; 0 = greedy
    top_k: jax.Array  # (S,) int32; 0 = off
    top_p: jax.Array  # (S,) float32; 1 = off
    min_p: jax.Array  # (S,) float32; 0 = off
    repetition_penalty: jax.Array  # (S,) float32; 1 = off
    presence_penalty: jax.Array  # (S,) float32; 0 = off
    frequency_penalty: jax.Array  # (S,) float32; 0 = off
    seeds: jax.Array  # (S,) uint32, per-request seed; a draw depends only on (seed, position)
    history: jax.Array  # (S, H) int32, the last H tokens of each sequence (prompt then output), -1 = none
    history_prompt: jax.Array  # (S,) int32, how many leading entries of history are prompt tokens
    blocked: jax.Array  # (S, MAX_BLOCKED) int32, token ids that cannot be chosen, -1 = none
    want_top: jax.Array  # (S,) int32, 1 = return the top MAX_LOGPROBS alternatives (computed only if a row asks)
    allowed: jax.Array  # (S, mask_words(V)) int32 token bitmask of structured outputs; -1 words = every token

    @staticmethod
    def abstract(num_seqs: int, vocab_size: int, history_len: int = HISTORY_LEN) -> SamplingBatch:
        """Shapes and dtypes for ahead-of-time lowering."""
        f32 = jax.ShapeDtypeStruct((num_seqs,), jnp.float32)
        i32 = jax.ShapeDtypeStruct((num_seqs,), jnp.int32)
        return SamplingBatch(
            temperature=f32,
            top_k=i32,
            top_p=f32,
            min_p=f32,
            repetition_penalty=f32,
            presence_penalty=f32,
            frequency_penalty=f32,
            seeds=jax.ShapeDtypeStruct((num_seqs,), jnp.uint32),
            history=jax.ShapeDtypeStruct((num_seqs, history_len), jnp.int32),
            history_prompt=i32,
            blocked=jax.ShapeDtypeStruct((num_seqs, MAX_BLOCKED), jnp.int32),
            want_top=i32,
            allowed=jax.ShapeDtypeStruct((num_seqs, mask_words(vocab_size)), jnp.int32),
        )

    @staticmethod
    def neutral(num_seqs: int, history_len: int = HISTORY_LEN, *, vocab_size: int) -> SamplingBatch:
        """Host-side (numpy) rows that sample greedily with every option off; the runner fills live rows in."""
        return SamplingBatch(
            temperature=np.zeros(num_seqs, np.float32),
            top_k=np.zeros(num_seqs, np.int32),
            top_p=np.ones(num_seqs, np.float32),
            min_p=np.zeros(num_seqs, np.float32),
            repetition_penalty=np.ones(num_seqs, np.float32),
            presence_penalty=np.zeros(num_seqs, np.float32),
            frequency_penalty=np.zeros(num_seqs, np.float32),
            seeds=np.zeros(num_seqs, np.uint32),
            history=np.full((num_seqs, history_len), -1, np.int32),
            history_prompt=np.zeros(num_seqs, np.int32),
            blocked=np.full((num_seqs, MAX_BLOCKED), -1, np.int32),
            want_top=np.zeros(num_seqs, np.int32),
            allowed=np.full((num_seqs, mask_words(vocab_size)), -1, np.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepOut:
    tokens: jax.Array  # (S,) int32
    logprobs: jax.Array  # (S,) float32, logprob of the chosen token
    top_ids: jax.Array  # (S, MAX_LOGPROBS) int32; zeros unless some row of the step set want_top
    top_logprobs: jax.Array  # (S, MAX_LOGPROBS) float32; likewise


def apply_penalties(logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties on logits (S, V)."""
    return _penalise(logits, _tally(sampling, logits.shape[-1]), sampling)


def _tally(sampling: SamplingBatch, vocab: int) -> jax.Array:
    """(S, V) float32 occurrences in each row's history: every one adds 1, an output one 1 + _out_weight(sampling)."""
    num_seqs, hist = sampling.history.shape[0], sampling.history  # (S, H)
    rows = jnp.arange(num_seqs)[:, None]  # (S, 1)
    idx = jnp.where(hist >= 0, hist, vocab)  # (S, H); out of range -> dropped
    is_output = jnp.arange(hist.shape[1])[None, :] >= sampling.history_prompt[:, None]  # (S, H)
    # one scatter counts both: every occurrence adds 1, an output one 1 + OUT (exact in float32: H * (OUT + 1) < 2^24)
    weight = 1.0 + _out_weight(sampling) * is_output
    return jnp.zeros((num_seqs, vocab), jnp.float32).at[rows, idx].add(weight, mode="drop")


def _out_weight(sampling: SamplingBatch) -> float:
    return float(2 ** int(np.ceil(np.log2(sampling.history.shape[1] + 1))))


def _penalise(logits: jax.Array, tally: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """The penalties on logits (S, V) given each row's tally (_tally); a zero tally leaves logits as they are."""
    counts = jnp.floor(tally / _out_weight(sampling))  # (S, V) output occurrences
    seen = tally > 0  # (S, V) any occurrence, prompt or output
    r = sampling.repetition_penalty[:, None]  # (S, 1)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - sampling.frequency_penalty[:, None] * counts
    return logits - sampling.presence_penalty[:, None] * (counts > 0)


def penalise(logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """apply_penalties on the steps where some row has a penalty (its (S, V) scatter is real work most steps skip),
    logits as they are on the others. On TPUs only the tally is under the cond and the penalties' selects always run,
    fused into the sampler's pass over the logits: a cond that returns the logits made XLA-TPU copy them in and out
    of it (at S = 256 the penalties counted 525 MB of the sampler's 1498 MB of bytes accessed, and 322 MB so: same
    tokens, a zero tally changes no logit)."""

    def gated(logits, sampling):
        return jax.lax.cond(jnp.any(_penalised(sampling)), apply_penalties, lambda x, _: x, logits, sampling)

    return jax.lax.platform_dependent(logits, sampling, tpu=penalise_tally_gated, default=gated)


def penalise_tally_gated(logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """penalise's TPU form: the tally under the cond (zeros on steps without penalties), the selects always."""
    num_seqs, vocab = logits.shape
    zeros = lambda s: jnp.zeros((num_seqs, vocab), jnp.float32)  # noqa: E731
    tally = jax.lax.cond(jnp.any(_penalised(sampling)), lambda s: _tally(s, vocab), zeros, sampling)
    return _penalise(logits, tally, sampling)


def remember(sampling: SamplingBatch, tokens: jax.Array, live: jax.Array) -> SamplingBatch:
    """sampling for the next decode step: each live row's sampled token (S,) appended to its penalty history (the
    oldest entry drops out of a full history, a prompt one first)."""
    hist = sampling.history  # (S, H)
    count = jnp.sum(hist >= 0, axis=1)  # (S,)
    full = count >= hist.shape[1]
    shifted = jnp.where(full[:, None], jnp.roll(hist, -1, axis=1), hist)
    col = jnp.where(full, hist.shape[1] - 1, count)  # (S,)
    appended = shifted.at[jnp.arange(hist.shape[0]), col].set(tokens)
    prompt = jnp.where(full, jnp.maximum(sampling.history_prompt - 1, 0), sampling.history_prompt)
    return dataclasses.replace(
        sampling,
        history=jnp.where(live[:, None], appended, hist),
        history_prompt=jnp.where(live, prompt, sampling.history_prompt),
    )


def is_blocked(blocked: jax.Array, vocab: int) -> jax.Array:
    """(S, V) bool: the token ids in each row of blocked (S, MAX_BLOCKED) (-1 = none). Compares, not a scatter: they
    fuse into the sampler's pass over the logits (XLA-TPU charges a scatter into (S, V) about nine passes)."""
    ids = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    hit = ids == blocked[:, :1]
    for j in range(1, blocked.shape[1]):
        hit = hit | (ids == blocked[:, j : j + 1])
    return hit


def apply_mask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """-inf on the logits (S, V) of the tokens whose bit is clear in the bitmask allowed (S, mask_words(V))."""
    num_seqs, vocab = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # (S, W, 32)
    return jnp.where(bits.reshape(num_seqs, -1)[:, :vocab] != 0, logits, -jnp.inf)


def candidates(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The CANDIDATES largest logits of each row (S, V), descending, and their token ids (S, CANDIDATES) int32."""
    values, ids = top_k(logits, min(CANDIDATES, logits.shape[-1]))
    return values, ids.astype(jnp.int32)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(x, k) of each row of x (S, N): values descending, the lowest index first among equals. On GPUs in
    rounds over pieces of at most TOPK_PIECE (top_k_pieces). XLA-GPU lowers a TopK to a sort of the whole row, and
    its SortRewriter hands a float32 sort of more than 31 rows of more than 65536 on Hopper (its H100 heuristic) to
    CUB, a custom call a CUDA graph does not record: a cond with one in a branch then copies its predicate to the
    host, which waits there for the device. On the H200 the 8-step decode program at S = 64 copied one predicate a
    step, and a call returned only as the program ended (58.0 of 58.0 ms); with pieces, none, and a call returns
    after 4.1 of 57.7 ms (BENCHMARKS.md, issue 16, 12-01 session 9). A sort of a 4096-wide piece stays XLA's own
    kernel whatever the number of rows."""

    def pieces(x):
        return top_k_pieces(x, k)

    return jax.lax.platform_dependent(x, cuda=pieces, rocm=pieces, default=lambda x: tuple(jax.lax.top_k(x, k)))


TOPK_PIECE = 4096  # XLA-GPU keeps a float32 sort of rows this wide for any number of rows (no CUB on Hopper)


def top_k_pieces(x: jax.Array, k: int, piece: int = TOPK_PIECE) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(x, k) of the rows of x (S, N), the same values, ids and order, by rounds of lax.top_k over pieces
    of at most `piece` entries: each piece's k largest (the row padded with -inf to whole pieces), then the k largest
    of those, until one piece is left. Exact, ties included: a row's k largest (by value, then lowest index) are among
    their pieces' k largest, and the survivors stay in index order, pieces before later pieces."""
    num_rows, width = x.shape
    ids = None  # (S, width) the row's ids of x's columns; None: the column index itself
    while width > piece and k <= piece // 2:
        count = -(-width // piece)
        low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
        x = jnp.pad(x, ((0, 0), (0, count * piece - width)), constant_values=low).reshape(num_rows, count, piece)
        values, local = jax.lax.top_k(x, k)  # (S, count, k)
        where = local + (jnp.arange(count, dtype=local.dtype) * piece)[:, None]  # columns of the padded row
        if ids is not None:
            padded = jnp.pad(ids, ((0, 0), (0, count * piece - width)))
            where = jnp.take_along_axis(padded, where.reshape(num_rows, -1), axis=-1).reshape(where.shape)
        x, ids, width = values.reshape(num_rows, count * k), where.reshape(num_rows, count * k), count * k
    values, local = jax.lax.top_k(x, k)
    return values, local if ids is None else jnp.take_along_axis(ids, local, axis=-1)


def truncate(scaled: jax.Array, norm: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """Top-k, then top-p over the top-k distribution, then min-p, on a row's candidates: scaled (S, K) the
    temperature-scaled logits of its K largest tokens, descending; norm (S,) the log of the whole vocabulary's
    softmax denominator (used when top-k is off). Returns which candidates stay in the support (S, K) bool; the
    first always does."""
    kmax = scaled.shape[-1]
    in_k = jnp.arange(kmax)[None, :] < jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, kmax), kmax)[:, None]
    # the top-k distribution's denominator: over the kept k candidates, or the whole vocabulary with top-k off
    top_norm = jax.nn.logsumexp(jnp.where(in_k, scaled, -jnp.inf), axis=-1)
    probs = jnp.where(in_k, jnp.exp(scaled - jnp.where(sampling.top_k > 0, top_norm, norm)[:, None]), 0.0)  # (S, K)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each candidate
    keep = in_k & (before < sampling.top_p[:, None])
    min_logit = scaled[:, :1] + jnp.log(jnp.maximum(sampling.min_p, 1e-30))[:, None]  # p >= min_p * p_max
    keep = keep & ((sampling.min_p[:, None] <= 0) | (scaled >= min_logit))
    return keep.at[:, 0].set(True)


def nucleus_floor(scaled: jax.Array, norm: jax.Array, top_p: jax.Array, hi: jax.Array, iters: int = 32) -> jax.Array:
    """(S,) the largest logit L such that the tokens with scaled >= L hold at least top_p of the probability (the
    nucleus of a sort: its last token is the first at which the mass reaches top_p), by bisection over [the row's
    smallest finite logit, hi], hi a logit whose tokens hold less than top_p. scaled (S, V), norm (S,) its log
    softmax denominator. After `iters` halvings L is within 2^-iters of that range below the true cut-off, so only
    tokens that close to it can be kept beyond a sort's nucleus."""
    lo = jnp.min(jnp.where(scaled > -jnp.inf, scaled, jnp.inf), axis=-1)  # every finite token: mass 1 >= top_p
    probs = jnp.exp(scaled - norm[:, None])
    hi = jnp.maximum(hi, lo)
    for _ in range(iters):  # unrolled, not a fori_loop: a loop keeps sample's cond out of XLA-GPU's CUDA graph
        mid = (lo + hi) / 2
        ok = jnp.sum(jnp.where(scaled >= mid[:, None], probs, 0.0), axis=-1) >= top_p
        lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    return lo


def _mix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection that scrambles every bit of x (uint32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel(seeds: jax.Array, positions: jax.Array, tokens: jax.Array) -> jax.Array:
    """Gumbel noise (S, N) for the token ids tokens ((N,) or (S, N)) that depends only on (seed, position, token id):
    a counter-based hash, so a row's draw is reproducible whatever else is in the batch, and a token's noise is the
    same whether the whole vocabulary or only the row's candidates are drawn from. (Cheaper to compile and run than
    threefry on a CPU.)"""
    row = _mix32(seeds.astype(jnp.uint32) ^ _mix32(positions.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))  # (S,)
    col = jnp.asarray(tokens).astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
    col = col[None, :] if col.ndim == 1 else col  # (1 or S, N)
    bits = _mix32(_mix32(row[:, None] ^ col) + row[:, None])  # (S, N)
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # (S, N) uniform in (0, 1)
    return -jnp.log(-jnp.log(u))


def _argmax(x: jax.Array) -> jax.Array:
    """Index of the largest entry of each row (S, N), the first among equals (a NaN counts as the largest, as in
    jnp.argmax), as int32 (S,).

    On the CPU with S >= 2 rows it is two reductions, the max and then the least index holding it: XLA's CPU runs
    argmax's variadic (value, index) reduce as a scalar loop (S = 16 rows of 49152: 3.6 ms against 1.6 ms as two
    reductions; S = 4: 1.0 against 0.46; one row: 0.28 against 0.35, so one row keeps argmax). Same indices."""

    def argmax(x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    if x.ndim != 2 or x.shape[0] < 2:
        return argmax(x)

    def two_pass(x):
        n = x.shape[1]
        top = jnp.max(x, axis=-1, keepdims=True)  # XLA's CPU max may skip NaNs: they are keyed below the rest
        ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
        first = jnp.min(jnp.where(jnp.isnan(x), ids - n, jnp.where(x == top, ids, n)), axis=-1)
        return jnp.where(first < 0, first + n, first)

    return jax.lax.platform_dependent(x, cpu=two_pass, default=argmax)


def _when(pred: jax.Array, fn, otherwise, *operands):
    """fn(*operands) where pred holds, otherwise(*operands) where it does not, for a fn whose result is right for
    every row either way (rows select their own path). On TPUs fn always runs: a lax.cond there keeps XLA from
    fusing the passes over the logits and XLA-TPU's cost model charges its branches many times over, while its TopK
    is one pass. Elsewhere a lax.cond skips fn's work on the steps that need none of it: with the draw, the TopK of 128
    candidates and the top-20 logprobs computed on every step, the H200's served Llama-3-8B at batch 1 fell from 202
    to 174 tok/s (43.5 against 37 ms per 8-step program; not profiled), and on CPUs the noise and TopK passes cost
    every greedy step. On GPUs see sample() for which conds cost the host a wait."""

    def gated(*ops):
        return jax.lax.cond(pred, fn, otherwise, *ops)

    return jax.lax.platform_dependent(*operands, tpu=fn, default=gated)


def _penalised(sampling: SamplingBatch) -> jax.Array:
    """(S,) bool: rows with a repetition, presence or frequency penalty."""
    return (sampling.repetition_penalty != 1) | (sampling.presence_penalty != 0) | (sampling.frequency_penalty != 0)


def plain(sampling: SamplingBatch) -> jax.Array:
    """() bool: no row samples, has a penalty or asks for top logprobs, so sample_greedy gives sample's result."""
    return ~jnp.any((sampling.temperature > 0) | _penalised(sampling) | (sampling.want_top > 0))


def _allowed(logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """logits (S, V) with -inf on the tokens a row may not choose: its blocked ids, those its token mask clears."""
    logits = jnp.where(is_blocked(sampling.blocked, logits.shape[-1]), -jnp.inf, logits)
    return apply_mask(logits, sampling.allowed)


def _no_top(raw: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros((raw.shape[0], MAX_LOGPROBS), jnp.int32), jnp.zeros((raw.shape[0], MAX_LOGPROBS), raw.dtype)


def sample_greedy(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> StepOut:
    """sample()'s result for a batch where plain(sampling) holds (greedy rows without penalties or top logprobs;
    blocked ids and token masks apply), without a cond."""
    del positions
    tokens = _argmax(_allowed(logits, sampling))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    top_ids, top_logprobs = _no_top(logits)
    return StepOut(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


def sample(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> StepOut:
    """Pick one token per row of logits (S, V) float32; positions (S,) (the sampled token's position) keys the
    seeded draw. A step where plain(sampling) holds (greedy rows only, no penalties, no top logprobs: the common
    case) takes sample_greedy under one cond and none of _sample's, except on TPUs (see _when).

    On XLA-GPU a cond is recorded in the program's CUDA graph (a conditional node, no host involved) only if every op
    of its branches can be. A cond that is not copies its predicate to the host, and the host waits there for the
    device, so the dispatch of a program with one in every step returns only as the program ends, and the engine's
    next program then waits for the host's work between two programs (H200, Llama-3-8B, 8-step decode program, one
    call in flight: with 2503822's sampler a call returned after 39.3 ms of a 39.4 ms program at c = 1; served 184
    tok/s). A fori_loop in a branch (nucleus_floor's, now unrolled) is one such op; so was a lax.top_k over the
    whole vocabulary at S >= 32 (Hopper's sort goes to CUB: see top_k), which made every step's cond wait at S = 64
    until top_k went by pieces (8-step program at c = 64: a call returned after 58.0 of 58.0 ms, now 4.1 of 57.7;
    BENCHMARKS.md, issue 16, 12-01 sessions 8 and 9)."""
    return _when(~plain(sampling), _sample, sample_greedy, logits, sampling, positions)


def _sample(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> StepOut:
    """Pick one token per row of logits (S, V) float32; positions (S,) (the sampled token's position) keys the
    seeded draw.

    Truncation (top-k, top-p, min-p) works on the row's CANDIDATES largest logits (lax.top_k), not on a sort of the
    vocabulary, so it is exact when the kept support fits in them; see CANDIDATES. The draw, the truncation and the
    top logprobs run only on steps where some row needs them, except on TPUs (see _when); the penalties' (S, V)
    scatter is skipped on steps without penalties on every platform."""
    vocab = logits.shape[-1]
    raw = logits
    raw_norm = jax.nn.logsumexp(raw, axis=-1)  # (S,) the raw distribution's log denominator
    logits = penalise(logits, sampling)
    logits = _allowed(logits, sampling)
    greedy = _argmax(logits)  # (S,)
    sampled_rows = sampling.temperature > 0
    truncates = sampled_rows & ((sampling.top_k > 0) | (sampling.top_p < 1) | (sampling.min_p > 0))

    def draw(logits):
        temp = jnp.where(sampled_rows, sampling.temperature, 1.0)[:, None]  # (S, 1)
        scaled = logits / temp  # (S, V)
        # rows that do not truncate: Gumbel-max over the whole vocabulary
        noisy = scaled + gumbel(sampling.seeds, positions, jnp.arange(vocab))
        full = _argmax(noisy)

        def truncated(scaled):  # truncating rows draw among the kept candidates with the same per-token noise
            values, ids = candidates(logits)  # (S, K); the same order as scaled's
            values = values / temp
            norm = jax.nn.logsumexp(scaled, axis=-1)
            keep = truncate(values, norm, sampling)
            pick = _argmax(jnp.where(keep, values + gumbel(sampling.seeds, positions, ids), -jnp.inf))
            drawn = jnp.where(truncates, jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0], full)
            # rows without top-k whose top-p or min-p support reaches past the candidates
            mass = jnp.sum(jnp.exp(values - norm[:, None]), axis=-1)  # (S,) the candidates' probability
            min_logit = values[:, 0] + jnp.log(jnp.maximum(sampling.min_p, 1e-30))  # (S,) min-p's cut-off
            wide = (
                truncates
                & (sampling.top_k == 0)
                & (values.shape[-1] < vocab)
                & (
                    ((sampling.top_p < 1) & (mass < sampling.top_p))
                    | ((sampling.min_p > 0) & (values[:, -1] >= min_logit))
                )
            )

            def exact(scaled):
                # top-p's cut-off: searched where the nucleus is wider than the candidates, else the last kept one
                inside = jnp.min(jnp.where(keep, values, jnp.inf), axis=-1)
                past = nucleus_floor(scaled, norm, sampling.top_p, values[:, -1])
                floor = jnp.where(sampling.top_p < 1, jnp.where(mass < sampling.top_p, past, inside), -jnp.inf)
                floor = jnp.maximum(floor, jnp.where(sampling.min_p > 0, min_logit, -jnp.inf))
                wide_pick = _argmax(jnp.where(scaled >= floor[:, None], noisy, -jnp.inf))
                return jnp.where(wide, wide_pick, drawn)

            def gated(scaled):
                return jax.lax.cond(jnp.any(wide), exact, lambda _: drawn, scaled)

            return jax.lax.platform_dependent(scaled, tpu=lambda _: drawn, default=gated)

        drawn = _when(jnp.any(truncates), truncated, lambda _: full, scaled)
        return jnp.where(sampled_rows, drawn, greedy)

    tokens = _when(jnp.any(sampled_rows), draw, lambda _: greedy, logits)
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - raw_norm  # (S,)
    wants = sampling.want_top[:, None] > 0

    def top(raw):  # (S, MAX_LOGPROBS) ids and logprobs; zeros for a row that did not ask
        values, ids = top_k(raw, MAX_LOGPROBS)
        return jnp.where(wants, ids.astype(jnp.int32), 0), jnp.where(wants, values - raw_norm[:, None], 0.0)

    top_ids, top_logprobs = _when(jnp.any(wants), top, _no_top, raw)
    return StepOut(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)
