"""Every family against Hugging Face transformers on the same random weights: ragged prefill chunks, then greedy
decode with the paged cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_runs import logits_step
from tiny_models import FAMILIES, make_model

from kiln.models.batch import KVCache, SeqChunk, make_batch
from kiln.models.checkpoint import hf

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # tiny models: compiling costs more than running

PAGE = 8
PAGES_PER_SEQ = 16


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, tmp_path):
    model = make_model(family, tmp_path)
    cfg, weights = hf.load(tmp_path)
    run = logits_step(cfg)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (37, 5, 20, 1)]
    pages = [list(range(s * PAGES_PER_SEQ, (s + 1) * PAGES_PER_SEQ)) for s in range(len(prompts))]
    kv = KVCache.create(cfg, num_pages=len(prompts) * PAGES_PER_SEQ + 1, page_size=PAGE)

    # Step 1: a ragged mix — the first 24 tokens of prompt 0 (a prefill chunk) and all of prompts 1-3.
    # Step 2: the rest of prompt 0 (a second chunk, reading the first chunk's KV from the pages).
    steps = [
        [SeqChunk(prompts[0][:24], 0, pages[0])] + [SeqChunk(p, 0, pages[s]) for s, p in enumerate(prompts) if s],
        [SeqChunk(prompts[0][24:], 24, pages[0])],
    ]
    got = {s: [] for s in range(len(prompts))}
    for chunks, owners in zip(steps, [[0, 1, 2, 3], [0]], strict=True):
        batch = make_batch(chunks, PAGE, num_tokens=64, num_seqs=8, max_pages=PAGES_PER_SEQ)
        out, kv = run(weights, kv, batch)
        out = np.asarray(out)
        start = 0
        for owner, chunk in zip(owners, chunks, strict=True):
            got[owner].append(out[start : start + len(chunk.tokens)])
            start += len(chunk.tokens)
    for s, p in enumerate(prompts):
        ref = hf_logits(model, p)
        assert rel_err(np.concatenate(got[s]), ref) < 1e-4, family

    # 32 greedy decode steps for every sequence at once, against transformers' generate.
    seqs = [list(p) for p in prompts]
    for _ in range(32):
        chunks = [SeqChunk([seq[-1]], len(seq) - 1, pages[s]) for s, seq in enumerate(seqs)]
        # the last token of each sequence is not in the cache yet; feed it as a decode token
        batch = make_batch(chunks, PAGE, num_tokens=8, num_seqs=8, max_pages=PAGES_PER_SEQ)
        out, kv = run(weights, kv, batch)
        nxt = np.asarray(out)[: len(seqs)].argmax(-1)
        for seq, t in zip(seqs, nxt, strict=True):
            seq.append(int(t))
    for s, p in enumerate(prompts):
        with torch.no_grad():
            model.generation_config.eos_token_id = None  # generate exactly 32 tokens, EOS included
            ref = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)
        assert seqs[s][len(p) :] == ref[0, len(p) :].tolist(), (family, s)
