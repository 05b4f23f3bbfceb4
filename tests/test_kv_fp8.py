"""An fp8 (float8_e4m3fn) KV cache (`--kv-dtype fp8`): SmolLM2's logits against a float32 cache along float32's own
greedy path, and a compiled artifact holding an fp8 cache that serves the jit path's tokens. The kernels' fp8 pages
are checked against the reference in tests/test_kernel_gpu.py."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from test_quant import NEW_TOKENS, greedy
from tiny_models import make_model
from tiny_tokenizer import write_tokenizer

from kiln.compile import artifact
from kiln.models.errors import KilnError
from kiln.serving.cli import main
from kiln.serving.llm import LLM, build_engine
from kiln.serving.params import SamplingParams


def test_smollm2_fp8_kv_against_float32(smollm2):
    """Teacher-forced along float32's own greedy path (the session fixture: float32 weights and cache), the same
    float32 weights with an fp8 cache: logit error and argmax agreement per parity prompt."""
    cfg, weights, _, prompts, run, ref_seqs, ref = smollm2
    _, got = greedy(cfg, weights, prompts, run, forced=ref_seqs, kv_dtype=jnp.float8_e4m3fn)
    report = []
    for s in range(len(prompts)):
        err = float(np.linalg.norm(got[s] - ref[s]) / np.linalg.norm(ref[s]))
        agree = int((got[s].argmax(-1) == ref[s].argmax(-1)).sum())
        report.append((agree, round(err, 4)))
    print(f"SmolLM2 fp8 KV vs float32 KV per prompt (argmax agreement of {NEW_TOKENS}, relative logit error): {report}")
    # Measured (2026-11-29, one prompt at a time): relative logit error 6.9%, 6.4%, 9.1%, argmax agreement 31, 31, 30
    # of 32. Each K/V value keeps 3 mantissa bits (2.6-2.9% RMS element error on SmolLM2's K and V in every layer;
    # scaling a layer to fp8's full range changed that by < 0.3 points, so per-tensor scales would not help here).
    for agree, err in report:
        assert err < 0.12, report
        assert agree >= NEW_TOKENS - 4, report


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_fp8")
    make_model("llama", folder / "model")
    write_tokenizer(folder / "model")
    return folder


def test_artifact_with_an_fp8_cache_serves_the_jit_paths_tokens(tiny):
    out = tiny / "art"
    args = ["--kv-tokens", "512", "--max-model-len", "256", "--buckets", "8,32", "--max-num-seqs", "4"]
    assert main(["compile", "--model", str(tiny / "model"), "--target", "cpu", "--out", str(out), "--kv-dtype", "fp8",
                 *args]) == 0  # fmt: skip
    m = json.loads((out / "manifest.json").read_text())
    assert m["geometry"]["kv_dtype"] == "float8_e4m3fn"
    cfg = artifact.load(out).cfg
    assert m["kv"]["bytes"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * m["geometry"]["num_pages"] * 16
    art = artifact.load(out)
    assert art.make_kv().k[0].dtype == jnp.float8_e4m3fn
    prompts = [[5, 9, 17, 33, 65, 129, 7], [42, 7]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.new_token_ids for o in LLM(out).generate(prompts, params)]
    jit = build_engine(tiny / "model", kv_dtype="fp8", max_model_len=256, max_num_seqs=4, kv_tokens=512)
    want = [o.new_token_ids for o in LLM(engine=jit).generate(prompts, params)]
    assert got == want


def test_fp8_kv_user_errors(tiny):
    with pytest.raises(KilnError, match="Unknown KV dtype"):
        build_engine(tiny / "model", kv_dtype="int3")
    with pytest.raises(KilnError, match="fp8 KV cache needs"):
        build_engine(tiny / "model", kv_dtype="fp8", attention="pallas_tpu")
