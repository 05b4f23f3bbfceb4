"""Mixture-of-experts (kiln.models.moe, Qwen3-MoE and Mixtral): the dispatches (and the GPU kernel, interpreted) agree
with every expert run densely; routing equals transformers'; config fields and both checkpoint layouts (per expert,
fused) load; and end to end, on 2 fake CPU devices, the jit path (LLM) and CPU artifacts with tp=2 (experts split
like the MLP) give transformers' 32 greedy tokens, and an int8 artifact (experts stay float) nearly. test_parity.py
covers logits on ragged prefill chunks and paged decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_models import COMMON, FAMILIES, make_model

from kiln.models import moe
from kiln.models.checkpoint import hf
from kiln.models.checkpoint.convert import build_weights
from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.kernels.pallas_gpu_moe import (
    experts_grouped,
    experts_single,
    gemv_partials,
    qk_norm_rope,
    router_add_norm,
    router_logits,
)

# tiny configs and interpreted kernels: compiling costs more than running (the in-process tests 26 -> 22 s alone); the
# tp/ep worker process sets its own XLA flags
pytestmark = pytest.mark.usefixtures("cheap_compiles")


def _experts(x=8, e=16, f=12, seed=0):
    rng = np.random.default_rng(seed)
    w = [rng.normal(0, 0.3, s).astype(np.float32) for s in ((e, x), (x, e, f), (x, e, f), (x, f, e))]
    return [jnp.asarray(a) for a in w]


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_gather_and_sorted_dispatch_equal_every_expert_dense(tokens):
    router, gate, up, down = _experts()
    h = jnp.asarray(np.random.default_rng(tokens).normal(size=(tokens, 16)).astype(np.float32))
    weights, experts = moe.route(h, router, 3, True)
    args = (h, gate, up, down, weights, experts, jax.nn.silu)
    dense = np.asarray(moe.experts_dense(*args))
    for run in (moe.experts_gather, moe.experts_sorted):
        np.testing.assert_allclose(np.asarray(jax.jit(run, static_argnums=6)(*args)), dense, rtol=1e-5, atol=1e-5)
    mlp = jax.jit(lambda h: moe.moe_mlp(h, router, gate, up, down, 3, True, jax.nn.silu))  # gather at T = 1
    np.testing.assert_allclose(np.asarray(mlp(h)), dense, rtol=1e-5, atol=1e-5)


def test_grouped_gpu_kernel_equals_every_expert_dense(tokens=40, block_m=4):
    """The grouped Pallas GPU kernel, in the interpreter on fresh random weights: 40 tokens x top-3 over 4 experts in
    chunks of 4 pairs, so every expert runs several chunks and the last one partly masked."""
    router, gate, up, down = _experts(x=4, e=32, f=32, seed=tokens)
    h = jnp.asarray(np.random.default_rng(tokens + 7).normal(size=(tokens, 32)).astype(np.float32))
    weights, experts = moe.route(h, router, 3, True)
    args = (h, gate, up, down, weights, experts)
    got = experts_grouped(*args, jax.nn.silu, interpret=True, block_m=block_m)
    np.testing.assert_allclose(np.asarray(got), np.asarray(moe.experts_dense(*args, jax.nn.silu)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused_route", [True, False])
def test_single_token_gpu_kernels_route_and_equal_every_expert_dense(fused_route):
    """One token through the GPU's single-token kernels (its routing inside gate_up or in a kernel of its own, its k
    pairs unsorted), in the interpreter on fresh random weights: kiln.models.moe.route's experts and weights, every
    expert run densely. Float32 logits (also as router_logits' partial rows, added inside; and with the experts
    stored transposed), and bf16 ones (the router's dtype, cast inside the kernels; 2 rows, of which row 0 routes) over
    128 experts, top 8, rounded so that many tie (ties go to the lower index, as lax.top_k)."""
    router, gate, up, down = _experts(x=16, e=32, f=32, seed=11)
    h = jnp.asarray(np.random.default_rng(12).normal(size=(1, 32)).astype(np.float32))
    weights, experts = moe.route(h, router, 4, True)
    want = moe.experts_dense(h, gate, up, down, weights, experts, jax.nn.silu)
    live = jnp.ones((1,), bool)
    got = experts_single(h, h @ router, live, gate, up, down, 4, True, jax.nn.silu, interpret=True,
                         fused_route=fused_route)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    partial = router_logits(h, router, block=8, interpret=True)  # (4, X): the router in 4 programs, added in the kernel
    np.testing.assert_allclose(np.asarray(partial.sum(0)), np.asarray(h @ router)[0], rtol=1e-5, atol=1e-5)
    got = experts_single(h, partial, live, gate, up, down, 4, True, jax.nn.silu, interpret=True,
                         fused_route=fused_route, partial_logits=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    t = [w.swapaxes(1, 2) for w in (gate, up, down)]  # the experts stored transposed (weights_t)
    got = experts_single(h, h @ router, live, *t, 4, True, jax.nn.silu, interpret=True, fused_route=fused_route,
                         weights_t=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    router, gate, up, down = _experts(x=128, e=32, f=32, seed=13)
    h = jnp.asarray(np.random.default_rng(14).normal(size=(1, 32)).astype(np.float32))
    logits = (jnp.round((h @ router) * 2) / 2).astype(jnp.bfloat16)  # halves: ~10 distinct values over 128 experts
    for renormalize in (True, False):
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, 8)
        if renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        want = moe.experts_dense(h, gate, up, down, weights, experts, jax.nn.silu)
        two = jnp.concatenate([logits, -logits])  # (2, X): the kernels read row 0 (the GPU path's 2-row GEMM)
        got = experts_single(h, two, live, gate, up, down, 8, renormalize, jax.nn.silu, interpret=True,
                             fused_route=fused_route)  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    dead = experts_single(h, logits, ~live, gate, up, down, 8, True, jax.nn.silu, interpret=True,
                          fused_route=fused_route)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(dead), 0)  # a padding row: weight 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_glue_kernels_equal_xla_ops(dtype):
    """The GPU decode layer's glue kernels, in the interpreter on fresh random inputs: router_add_norm gives x + o's
    row 0, its RMSNorm (transformer.rms_norm) and the router's partial logits; qk_norm_rope gives Qwen3's q/k norms and
    RoPE of a fused qkv (v as it is), as moe.qk_norm_rope's XLA branch and transformer's split q, k, v do. bf16: within
    an ulp of the norm's sum in another order."""
    from kiln.models.transformer import rms_norm, rope, rope_tables

    rng = np.random.default_rng(21)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    x, o, norm_w = (jnp.asarray(rng.normal(size=s), dtype) for s in ((1, 64), (2, 64), (64,)))
    router = jnp.asarray(rng.normal(size=(64, 16)), dtype)
    xn, h, partial = router_add_norm(x, o, norm_w, router, 1e-6, block=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(xn), np.asarray(x + o[:1]))
    want_h = rms_norm(x + o[:1], norm_w, 1e-6)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32), **tol)
    want_logits = np.asarray(h, np.float32) @ np.asarray(router, np.float32)
    # (bf16: the interpreter's XLA keeps h's product unrounded inside the kernel, excess precision; Triton rounds it)
    logits_tol = dict(tol, atol=5e-2 if dtype == jnp.bfloat16 else 1e-4)
    np.testing.assert_allclose(np.asarray(partial.sum(0)), want_logits[0], **logits_tol)
    # the o-proj as gemv_partials' float32 split-K rows, added inside router_add_norm
    a, wo = jnp.asarray(rng.normal(size=(1, 256)), dtype), jnp.asarray(rng.normal(size=(256, 64)), dtype)
    parts = gemv_partials(a, wo, splits=4, block_k=32, block_n=16, interpret=True)  # (4, 64): 2 K tiles a program
    want_o = np.asarray(a, np.float64) @ np.asarray(wo, np.float64)
    np.testing.assert_allclose(np.asarray(parts.sum(0)), want_o[0], rtol=1e-4, atol=1e-4)
    xn, h, _ = router_add_norm(x, parts, norm_w, router, 1e-6, block=16, partials=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(xn), np.asarray(x + parts.sum(0).astype(dtype)))
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(rms_norm(xn, norm_w, 1e-6), np.float32), **tol)

    kvh, g, d, t = 2, 3, 32, 3
    qkv = jnp.asarray(rng.normal(size=(t, kvh * (g + 2) * d)), dtype)
    q_norm, k_norm = (jnp.asarray(rng.normal(size=(d,)), dtype) for _ in range(2))
    cos, sin = rope_tables(jnp.arange(t) + 7, 1.0 / 1e4 ** (np.arange(0, d, 2) / d), dtype)
    got = qk_norm_rope(qkv, q_norm, k_norm, cos, sin, 1e-6, kv_heads=kvh, head_dim=d, interpret=True)
    xla = moe.qk_norm_rope(qkv, q_norm, k_norm, cos, sin, 1e-6, kv_heads=kvh, head_dim=d)  # the CPU's branch
    split = qkv.reshape(t, kvh, g + 2, d)
    q = rope(rms_norm(split[:, :, :g].reshape(t, kvh * g, d), q_norm, 1e-6), cos, sin).reshape(t, kvh, g, d)
    k = rope(rms_norm(split[:, :, g], k_norm, 1e-6), cos, sin)
    np.testing.assert_array_equal(np.asarray(xla[:, :, :g]), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(xla[:, :, g]), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(got[:, :, g + 1]), np.asarray(split[:, :, g + 1]))  # v untouched
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(xla, np.float32), **tol)


def test_gpu_decode_glue_forward_equals_xla_path(tmp_path, monkeypatch):
    """transformer.forward in a one-token decode program with the GPU's branches taken (every platform_dependent's cuda
    branch) and the Pallas kernels interpreted: with the glue kernels (router_add_norm, qk_norm_rope, the experts' rows
    into the next norm's add_rms_norm, the o-proj's split-K rows by gemv_partials) it gives the logits and pages it
    gives with them off (XLA's ops), on a tiny Qwen3-MoE of head_dim 32 whose layer 1 (of 2) is dense (float32)."""
    import functools

    from kiln.models import kernels
    from kiln.models.batch import KVCache, SeqChunk, make_batch
    from kiln.models.checkpoint import load_checkpoint
    from kiln.models.kernels import pallas_gpu
    from kiln.models.kernels import pallas_gpu_moe as gpu_moe
    from kiln.models.transformer import forward, fuse_linears, logits

    make_model("qwen3_moe", tmp_path / "m", hidden_size=128, num_experts=16, num_experts_per_tok=4, num_hidden_layers=2)
    cfg, weights = load_checkpoint(tmp_path / "m")
    weights = jax.tree.map(jnp.asarray, fuse_linears(cfg, weights))
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *a, cuda=None, default=None, **kw: (cuda or default)(*a))
    for name in ("router_add_norm", "qk_norm_rope", "experts_single", "router_logits"):
        monkeypatch.setattr(gpu_moe, name, functools.partial(getattr(gpu_moe, name), interpret=True))
    gemv = functools.partial(gpu_moe.gemv_partials, block_k=32, block_n=32, interpret=True)  # o-proj (128, 128)
    monkeypatch.setattr(gpu_moe, "gemv_partials", gemv)
    qkv_fn = functools.partial(pallas_gpu.paged_attention_qkv, interpret=True)
    qkv_fn.takes_rope = True
    qkv_fn.add_norm = functools.partial(pallas_gpu.add_rms_norm, interpret=True)
    attention = functools.partial(pallas_gpu.paged_attention, interpret=True)
    batch = jax.tree.map(jnp.asarray, make_batch([SeqChunk([7], 13, [3, 5])], 16, 1, 1, 4))
    kv = KVCache.create(cfg, num_pages=6, page_size=16)
    rng = np.random.default_rng(3)
    kv = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), kv)
    outs = []
    for on in (False, True):
        for flag in ("GPU_ADD_NORM", "GPU_QK_NORM_ROPE", "GPU_ROWS", "GPU_OPROJ_KERNEL"):
            monkeypatch.setattr(moe, flag, on)

        def run(weights, kv, batch):  # a fresh function per setting: jax caches traces, the flags are not part of them
            with kernels.decode_batch():
                hidden, kv = forward(cfg, weights, kv, batch, attention, qkv_fn)
            return logits(cfg, weights, hidden), kv

        traced = jax.jit(run).trace(weights, kv, batch)
        jaxpr = str(traced.jaxpr)
        names = ("kiln_router_add_norm", "kiln_qk_norm_rope", "kiln_add_rms_norm", "kiln_gemv_partials")
        assert all((name in jaxpr) == on for name in names)
        outs.append(traced.lower().compile()(weights, kv, batch))
    (want, want_kv), (got, got_kv) = outs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_kv), jax.tree.leaves(want_kv), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routing_matches_transformers(family):
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra, "num_hidden_layers": 1})
    torch.manual_seed(0)
    block = model_cls(config).model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.3)
        h = torch.randn(7, config.hidden_size)
        _, want_w, want_idx = block.gate(h)
    got_w, got_idx = moe.route(jnp.asarray(h.numpy()), jnp.asarray(block.gate.weight.detach().numpy().T),
                               config.num_experts_per_tok, family == "mixtral" or config.norm_topk_prob)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got_idx), want_idx.numpy())
    np.testing.assert_allclose(np.asarray(got_w), want_w.float().numpy(), rtol=1e-5)


def test_config_fields():
    base = dict(COMMON, architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=4, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    cfg = ModelConfig.from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True})
    assert [cfg.is_moe(i) for i in range(4)] == [False, True, False, False] and cfg.norm_topk_prob and cfg.qk_norm
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # the manifest round trip
    cfg = ModelConfig.from_hf({**base, "num_local_experts": 8})  # transformers 5.x's name; every layer sparse
    assert cfg.moe_layers == () and all(cfg.is_moe(i) for i in range(4)) and not cfg.norm_topk_prob
    mixtral = ModelConfig.from_hf(dict(COMMON, architectures=["MixtralForCausalLM"], num_local_experts=4))
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 128 and mixtral.num_experts_per_tok == 2
    with pytest.raises(KilnError, match="shared experts"):
        ModelConfig.from_hf({**base, "shared_expert_intermediate_size": 64})


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_loads_like_per_expert(family, tmp_path):
    """transformers 5.x holds experts fused in memory (mlp.experts.gate_up_proj (X, 2F, E), down_proj (X, E, F)) and
    writes them one expert at a time; both layouts give the same Weights, and a missing expert is named."""
    model = make_model(family, tmp_path)
    cfg, per_expert = hf.load(tmp_path)
    fused = [(k, v.numpy()) for k, v in model.state_dict().items()]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k, _ in fused)
    got = build_weights(cfg, fused)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(per_expert), strict=True):
        np.testing.assert_array_equal(a, b)
    names = list(hf.iter_tensors(tmp_path))
    gone = next(k for k, _ in names if ".experts.3." in k)
    with pytest.raises(KilnError, match="lacks the tensor .*experts.3"):
        build_weights(cfg, [(k, v) for k, v in names if k != gone])


WORKER = r"""
import json, sys
from pathlib import Path
import jax, torch
sys.path.insert(0, sys.argv[2])
from tiny_models import make_model
from tiny_tokenizer import write_tokenizer
from jax.sharding import PartitionSpec as P
from kiln.compile.build import compile_artifact
from kiln.serving.llm import LLM, build_engine
from kiln.serving.params import SamplingParams

root = Path(sys.argv[1])
PROMPTS = [[5, 9, 17, 33, 65, 129, 7, 3, 11], [42, 43], [250, 1, 77]]
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
OPTS = dict(max_model_len=64, max_num_seqs=4, buckets=(16,))  # one step program: 4 and 16 rows both sort (uses_gather)
results = {}
for family in ("qwen3_moe", "mixtral"):
    folder = root / family
    model = make_model(family, folder)
    write_tokenizer(folder)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        results[f"{family}-hf"] = [model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):]
                                   .tolist() for p in PROMPTS]
    run = lambda llm: [o.new_token_ids for o in llm.generate(PROMPTS, params)]
    results[f"{family}-jit"] = run(LLM(engine=build_engine(str(folder), **OPTS)))
    for tp, fmt in ((2, "float"), (2, "int8")) if family == "qwen3_moe" else ((2, "float"),):
        path = compile_artifact(folder, "cpu", out=root / f"{family}-{tp}-{fmt}", tp=tp, kv_tokens=256,
                                decode_steps=1, quantize=fmt, **OPTS)
        llm = LLM(str(path))
        lw = llm.engine.runner.weights.layers[0]
        assert lw.experts_gate.dtype == jax.numpy.float32 and lw.router.dtype == jax.numpy.float32, fmt
        if tp == 2:
            assert lw.experts_gate.sharding.spec == P(None, None, "tp"), lw.experts_gate.sharding.spec
            assert lw.experts_down.sharding.spec == P(None, "tp", None)
        results[f"{family}-{tp}-{fmt}"] = run(llm)
# expert parallelism: whole experts per device (8 experts over 2 and 4 devices; 4 KV heads so that tp=4 divides them)
folder = root / "qwen3_moe_kv4"
model = make_model("qwen3_moe", folder, num_key_value_heads=4, mlp_only_layers=[])
write_tokenizer(folder)
model.generation_config.eos_token_id = None
with torch.no_grad():
    results["ep-hf"] = [model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist()
                        for p in PROMPTS]
for ep in (2, 4):
    path = compile_artifact(folder, "cpu", out=root / f"ep{ep}", tp=ep, expert_parallel=True, kv_tokens=256,
                            decode_steps=1, **OPTS)
    llm = LLM(str(path))
    lw = llm.engine.runner.weights.layers[0]
    assert lw.experts_gate.sharding.spec == P("tp", None, None), lw.experts_gate.sharding.spec
    assert lw.experts_down.sharding.spec == P("tp", None, None)
    results[f"ep{ep}"] = run(llm)
print("RESULTS " + json.dumps(results))
"""


def test_jit_and_artifacts_with_tp_and_ep_match_transformers(tmp_path):
    """Greedy tokens of the jit path, tp=2 artifacts (experts split by width) and expert-parallel artifacts over 2 and 4
    devices (whole experts per device) equal transformers' on random tiny Qwen3-MoE and Mixtral models."""
    tests = Path(__file__).parent
    # LLVM's -O0 for XLA:CPU's generated code: the tiny models' programs compile faster
    flags = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(tmp_path), str(tests)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS ") :])
    for family in ("qwen3_moe", "mixtral"):
        want = results[f"{family}-hf"]
        assert all(len(t) == 32 for t in want)
        assert results[f"{family}-jit"] == want, family
        assert results[f"{family}-2-float"] == want, family
    assert len(results["ep-hf"][0]) == 32 and results["ep2"] == results["ep-hf"] and results["ep4"] == results["ep-hf"]
    int8 = results["qwen3_moe-2-int8"]  # int8 attention, float experts: close to, not equal to, the float tokens
    same = sum(a == b for g, w in zip(int8, results["qwen3_moe-hf"], strict=True) for a, b in zip(g, w, strict=True))
    assert same >= 48, same


def test_sorted_dispatch_compiles_for_tpu():
    """The accelerator branch (ragged_dot over sorted pairs) of a whole Qwen3-MoE step program compiles for a
    deviceless v5e (libtpu's compile-only topology), as `kiln compile --target tpu-v5e-*` does."""
    from jax.experimental import topologies

    from kiln.models.batch import Batch, KVCache
    from kiln.models.sampling import SamplingBatch
    from kiln.models.step import jit_step
    from kiln.models.transformer import Weights

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    dev = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    cfg = ModelConfig(family="qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=1024, qk_norm=True,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)  # fmt: skip
    sharding = jax.sharding.SingleDeviceSharding(dev)
    args = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        (Weights.abstract(cfg, jnp.bfloat16), KVCache.abstract(cfg, 32, 16, jnp.bfloat16), Batch.abstract(32, 4, 8),
         SamplingBatch.abstract(4, cfg.vocab_size)),
    )  # fmt: skip
    with jax.default_device(dev):
        lowered = jit_step(cfg, "pallas_tpu").lower(*args)
        assert "ragged_dot" in lowered.as_text()
        lowered.compile()


def test_one_row_float_dots_lower_as_two_row_gemms_for_gpus():
    """A 1-row float dot that XLA's GPU compiler would turn into multiply + reduce ((1 + N) K < 10M: the 1-row bucket's
    o-proj and router of an MoE model) is lowered for GPUs on two rows, a larger one and every CPU dot on one."""
    from kiln.models.quant import linears

    x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)

    def dot_shapes(w_shape, platform):
        w = jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)
        text = jax.jit(linears).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
        return [line.split("->")[-1].strip() for line in text.splitlines() if "stablehlo.dot_general" in line]

    assert dot_shapes((4096, 2048), "cuda") == ["tensor<2x2048xbf16>"]
    assert dot_shapes((4096, 4096), "cuda") == ["tensor<1x4096xbf16>"]  # (1 + 4096) 4096 > 10M: cuBLAS's GEMV
    assert dot_shapes((4096, 2048), "cpu") == ["tensor<1x2048xbf16>"]
