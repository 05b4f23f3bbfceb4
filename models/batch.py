"""The step program's inputs: the ragged paged Batch and the KV cache, both registered-dataclass pytrees.

One Batch mixes prefill chunks and decodes: sequence s owns query tokens query_start[s]:query_start[s+1] (decode is
the case of one token), and after this step its KV holds seq_lens[s] tokens in the pages block_tables[s].
Every array is padded to its bucket; padding tokens have slot -1, padding sequences have zero length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kiln.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    token_ids: jax.Array  # (T,) int32
    positions: jax.Array  # (T,) int32, position of each token in its sequence
    slot_mapping: jax.Array  # (T,) int32, page * page_size + offset where the token's K/V goes; -1 = padding
    block_tables: jax.Array  # (S, max_pages) int32, the pages of each sequence in order
    seq_lens: jax.Array  # (S,) int32, KV length of each sequence after this step; 0 = padding
    query_start: jax.Array  # (S + 1,) int32, cumulative query lengths
    num_seqs: jax.Array  # (1,) int32, live sequences (the rest is padding)
    logits_index: jax.Array  # (S,) int32, the token whose logits are sampled for each sequence

    @staticmethod
    def abstract(num_tokens: int, num_seqs: int, max_pages: int) -> Batch:
        """Shapes and dtypes of a bucket, for ahead-of-time lowering."""
        i32 = jnp.int32
        s = jax.ShapeDtypeStruct
        return Batch(
            token_ids=s((num_tokens,), i32),
            positions=s((num_tokens,), i32),
            slot_mapping=s((num_tokens,), i32),
            block_tables=s((num_seqs, max_pages), i32),
            seq_lens=s((num_seqs,), i32),
            query_start=s((num_seqs + 1,), i32),
            num_seqs=s((1,), i32),
            logits_index=s((num_seqs,), i32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per layer, K and V pages of shape (num_kv_heads, num_pages, page_size, head_dim). Donated to the step."""

    k: list[jax.Array]
    v: list[jax.Array]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @staticmethod
    def shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        return (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)

    @staticmethod
    def create(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, sharding=None) -> KVCache:
        shape = KVCache.shape(cfg, num_pages, page_size)
        # committed to a device, as every step's output cache is: jit keys its cache on commitment, so an uncommitted
        # first cache made each program compile again at its first call with a step's output (25 s for a tiny model)
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return KVCache(k=[zeros() for _ in range(cfg.num_layers)], v=[zeros() for _ in range(cfg.num_layers)])

    @staticmethod
    def abstract(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, sharding=None) -> KVCache:
        spec = jax.ShapeDtypeStruct(KVCache.shape(cfg, num_pages, page_size), dtype, sharding=sharding)
        return KVCache(k=[spec] * cfg.num_layers, v=[spec] * cfg.num_layers)


@dataclasses.dataclass
class SeqChunk:
    """Host-side description of one sequence's part of a step: new tokens starting at `start` (= KV length before
    this step), and the pages that hold the sequence."""

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]


def make_batch(chunks: Sequence[SeqChunk], page_size: int, num_tokens: int, num_seqs: int, max_pages: int) -> Batch:
    """Pack sequence chunks into a padded Batch of numpy arrays (T = num_tokens, S = num_seqs)."""
    n_tok = sum(len(c.tokens) for c in chunks)
    if n_tok > num_tokens or len(chunks) > num_seqs:
        raise ValueError(f"{n_tok} tokens / {len(chunks)} sequences do not fit the bucket ({num_tokens}, {num_seqs})")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    tables = np.zeros((num_seqs, max_pages), np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    query_start = np.zeros(num_seqs + 1, np.int32)
    logits_index = np.zeros(num_seqs, np.int32)
    t = 0
    for s, c in enumerate(chunks):
        n = len(c.tokens)
        pos = np.arange(c.start, c.start + n)
        pages = np.asarray(c.pages, np.int32)
        token_ids[t : t + n] = c.tokens
        positions[t : t + n] = pos
        slots[t : t + n] = pages[pos // page_size] * page_size + pos % page_size
        tables[s, : len(pages)] = pages
        seq_lens[s] = c.start + n
        logits_index[s] = t + n - 1
        t += n
        query_start[s + 1] = t
    query_start[len(chunks) + 1 :] = t
    return Batch(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=seq_lens,
        query_start=query_start,
        num_seqs=np.array([len(chunks)], np.int32),
        logits_index=logits_index,
    )
