"""Tensor parallelism on 4 fake CPU devices: artifacts compiled with tp=2 and tp=4 give the greedy tokens and
logprobs of tp=1, through the step programs and the multi-step decode program; with int8 and with int4 weights, tp=2
gives tp=1's tokens. Runs in a subprocess because XLA_FLAGS must be set before jax starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[2])
from tiny_models import make_model
from tiny_tokenizer import write_tokenizer
import jax
from jax.sharding import PartitionSpec as P
from kiln.compile import artifact
from kiln.compile.build import compile_artifact
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.sampling import SamplingBatch

root = Path(sys.argv[1])
assert len(jax.devices()) == 4
make_model("llama_tied", root / "model", num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
write_tokenizer(root / "model")

PROMPTS = [[5, 9, 17, 33, 65, 129, 7], [42, 43], [250, 1, 77]]
sampling = SamplingBatch.neutral(4, vocab_size=256)
sampling.want_top[:] = 1


def start(art):  # the three prompts on fresh KV pages: the state that steps() advances
    pages = [list(range(s * art.max_pages_per_seq, (s + 1) * art.max_pages_per_seq)) for s in range(3)]
    chunks = [SeqChunk(list(p), 0, pages[s]) for s, p in enumerate(PROMPTS)]
    return {"kv": art.make_kv(), "seqs": [list(p) for p in PROMPTS], "pages": pages, "chunks": chunks}


def batch(art, st, bucket):
    return make_batch(st["chunks"], art.page_size, bucket, 4, art.max_pages_per_seq)


def steps(art, st, bucket, n):  # n greedy single steps of bucket's program: each step's tokens and top logprobs
    tokens, top = [], []
    for _ in range(n):
        out, st["kv"] = art.programs[bucket](art.weights, st["kv"], batch(art, st, bucket), sampling)
        new = np.asarray(out.tokens)[:3].tolist()
        tokens.append(new)
        top.append(np.asarray(out.top_logprobs)[:3].tolist())
        st["chunks"] = [SeqChunk([t], len(q), st["pages"][s]) for s, (q, t) in enumerate(zip(st["seqs"], new))]
        for q, t in zip(st["seqs"], new):
            q.append(t)
    return tokens, top


results = {}
for tp in (1, 2, 4):
    # tp=1 also runs single steps of 4 tokens (step_t4, whose decode program is decode_t4); tp 2 and 4 compile only
    # the 16-token bucket, whose multi-step decode program (decode_t16, S = max_num_seqs = 4) is the one they run
    dec = 4 if tp == 1 else 16
    path = compile_artifact(root / "model", "cpu", out=root / f"tp{tp}", tp=tp, buckets=(4, 16) if tp == 1 else (16,),
                            max_num_seqs=4, kv_tokens=256, max_model_len=64, decode_steps=4)
    art = artifact.load(path)
    st = start(art)
    wq, wo = art.weights.layers[0].wqkv, art.weights.layers[0].wo  # q|k|v fused (fuse_linears)
    assert len(wq.sharding.device_set) == tp
    if tp > 1:
        assert wq.sharding.spec == P(None, "tp") and wo.sharding.spec == P("tp", None)
        assert art.weights.layers[0].w_gate_up.sharding.spec == P(None, "tp")
        assert st["kv"].k[0].sharding.spec == P("tp") and art.weights.embed.sharding.spec == P("tp", None)
    tokens, top = steps(art, st, 16, 8)
    # then 4 decode steps in one dispatch of the (sharded) multi-step decode program
    assert sorted(art.decode_programs) == [dec]
    out, st["kv"] = art.decode_programs[dec](art.weights, st["kv"], batch(art, st, dec), sampling)
    multi = np.asarray(out.tokens)[:, :3].tolist()
    results[tp] = {"tokens": tokens, "top_logprobs": top, "multi": multi}
    if tp == 1:  # the same 4 steps one by one
        results["single"] = steps(art, st, 4, 4)[0]
# int8 and int4 weights (stored (out, in), column-parallel layers split on dim 0, with their scales): tp=2 gives tp=1's
# greedy tokens
for fmt in ("int8", "int4"):
    for tp in (1, 2):
        path = compile_artifact(root / "model", "cpu", out=root / f"{fmt}-tp{tp}", tp=tp, buckets=(16,),
                                max_num_seqs=4, kv_tokens=256, max_model_len=64, decode_steps=1, quantize=fmt)
        art = artifact.load(path)
        if tp > 1:
            assert art.weights.layers[0].wqkv.sharding.spec == P("tp", None)
            scale = art.weights.layers[0].wqkv.scale  # int8: (out,); int4: (out, in // g)
            assert scale.sharding.spec == (P("tp") if fmt == "int8" else P("tp", None))
        results[f"{fmt}-{tp}"] = steps(art, start(art), 16, 8)[0]
print("RESULTS " + json.dumps(results))
"""


def test_tp2_and_tp4_match_tp1(tmp_path):
    tests = Path(__file__).parent
    # LLVM's -O0 for XLA:CPU's generated code: the tiny model's programs compile faster (67 against 76 s here) and
    # every tp runs under the same flags
    flags = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(tmp_path), str(tests)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS ") :])
    ref = results["1"]
    assert ref["multi"] == results["single"]  # the multi-step program continues exactly like single steps
    assert any(x for row in ref["top_logprobs"] for x in row[0])  # alternatives were computed
    assert results["int8-2"] == results["int8-1"]
    assert results["int4-2"] == results["int4-1"]
    for tp in ("2", "4"):
        assert results[tp]["tokens"] == ref["tokens"], tp
        assert results[tp]["multi"] == ref["multi"], tp
        got, want = results[tp]["top_logprobs"], ref["top_logprobs"]
        diff = max(abs(a - b) for g, w in zip(got, want, strict=True) for x, y in zip(g, w, strict=True)
                   for a, b in zip(x, y, strict=True))  # fmt: skip
        assert diff < 1e-4, (tp, diff)
