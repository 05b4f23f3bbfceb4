"""GGUF: the embedded SmolLM2 against transformers loading the same file; every tiny family written as a GGUF and read
back; dequantization of every supported tensor type against an independent encoding."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants
from test_quant import NEW_TOKENS, PAGE, PAGES_PER_SEQ
from tiny_models import make_model

from kiln.models.batch import KVCache, SeqChunk, make_batch
from kiln.models.checkpoint import default_model_path, gguf, hf


# --- SmolLM2 from its GGUF against transformers ----------------------------------------------------------------
def test_smollm2_matches_transformers(smollm2):
    """kiln's float32 greedy run of the three parity prompts (the session fixture `smollm2`, test_quant.greedy: one
    ragged prefill of all three, then 31 greedy decode steps of all three at once) against transformers."""
    from transformers import AutoModelForCausalLM

    cfg, weights, tok, prompts, run, seqs, chosen = smollm2  # chosen: the logits that chose each of the 32 tokens
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # the prefill's logits at every prompt position: greedy's first step again, on a fresh cache
    pages = [list(range(s * PAGES_PER_SEQ, (s + 1) * PAGES_PER_SEQ)) for s in range(len(prompts))]
    kv = KVCache.create(cfg, num_pages=len(prompts) * PAGES_PER_SEQ, page_size=PAGE)
    chunks = [SeqChunk(p, 0, pages[s]) for s, p in enumerate(prompts)]
    out, _ = run(weights, kv, make_batch(chunks, PAGE, num_tokens=128, num_seqs=4, max_pages=PAGES_PER_SEQ))
    out = np.asarray(out)
    starts = np.cumsum([0] + [len(p) for p in prompts])
    got = [[out[starts[s] : starts[s + 1]], chosen[s][1:]] for s in range(len(prompts))]
    for s in range(len(prompts)):
        np.testing.assert_array_equal(got[s][0][-1], chosen[s][0])  # the fixture's own prefill, bit for bit

    errors = []
    for s, p in enumerate(prompts):
        with torch.no_grad():
            ref_logits = model(torch.tensor([seqs[s][:-1]])).logits[0].numpy()  # (len(p) + 31, V)
        # Greedy decoding agrees token for token: transformers' argmax after every prefix of kiln's sequence is
        # kiln's next token (so transformers' greedy generation would produce the same 32 tokens).
        assert ref_logits[len(p) - 1 :].argmax(-1).tolist() == seqs[s][len(p) :], s
        mine = np.concatenate(got[s])  # (len(p) + 31, V)
        errors.append(float(np.linalg.norm(mine - ref_logits) / np.linalg.norm(ref_logits)))
        # Both sides run float32 on bit-identical dequantized weights (transformers dequantizes the same Q4_1/Q8_0
        # blocks to float32); what differs is only the order of float32 accumulations (XLA's dot and fused softmax
        # against PyTorch's), which over 30 layers leaves a relative error of about 2e-6 (measured). 1e-4 is the
        # issue's tolerance for the random-weight families; a wrong dequantization, Q/K permutation or norm gives
        # an error above 1e-1.
        assert errors[-1] < 1e-4, (s, errors[-1])
        np.testing.assert_allclose(mine, ref_logits, atol=2e-3, rtol=0)
    print(f"SmolLM2 GGUF, kiln vs transformers: relative logit error per prompt {[f'{e:.2e}' for e in errors]}")
    # And transformers' own generate() (KV-cached, incremental) on the chat prompt gives the same 32 tokens.
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompts[0]]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ref[0, len(prompts[0]) :].tolist() == seqs[0][len(prompts[0]) :]
    assert "Paris" in tok.decode(seqs[0][len(prompts[0]) :])


# --- tiny families written as GGUF files -------------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written independently of kiln's inverse."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
GEMMA_LAYER = {
    **GGUF_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gguf(model, path, arch: str, qtype: Q = Q.F32) -> None:
    """Write a transformers model as llama.cpp's converter would (names, Q/K permutation, Gemma's 1 + w norms)."""
    c = model.config
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf_rope_linear())
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":  # llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim, rope["rope_theta"]))
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
        w.add_uint32("gemma3.attention.sliding_window_pattern", c.sliding_window_pattern)
        w.add_float32("gemma3.final_logit_softcapping", c.final_logit_softcapping)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    names = GEMMA_LAYER if arch == "gemma3" else GGUF_LAYER
    for name, p in model.state_dict().items():
        a = p.float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch == "gemma3" and "norm" in name:
            a = a + 1.0
        if arch == "llama" and "q_proj" in name:
            a = llama_cpp_permute(a, c.num_attention_heads)
        if arch == "llama" and "k_proj" in name:
            a = llama_cpp_permute(a, c.num_key_value_heads)
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            stem, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[stem]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
                name, "output.weight"
            )
        if a.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gname, quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_rope_factors(rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs computation."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def gguf_rope_linear():
    from gguf import RopeScalingType

    return RopeScalingType.LINEAR


@pytest.mark.parametrize(
    ("family", "arch"), [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gemma3", "gemma3")]
)
def test_tiny_gguf_equals_hf_folder(family, arch, tmp_path):
    model = make_model(family, tmp_path)
    write_gguf(model, tmp_path / "model.gguf", arch)
    cfg_hf, w_hf = hf.load(tmp_path)
    cfg, w = gguf.load(tmp_path / "model.gguf")
    # GGUF carries no query_pre_attn_scalar (llama.cpp derives the query scale from the model size).
    ignore = {"attn_scale", "rms_norm_eps"}
    assert cfg.rms_norm_eps == pytest.approx(cfg_hf.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32
    assert {k: v for k, v in cfg.to_dict().items() if k not in ignore} == {
        k: v for k, v in cfg_hf.to_dict().items() if k not in ignore
    }
    for a, b in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(w_hf), strict=True):
        np.testing.assert_array_equal(a, b)  # bit-exact: names, Q/K un-permutation and 1 + w norms all undone


def test_gguf_read_config_needs_no_tensors(tmp_path):
    model = make_model("llama_tied", tmp_path)
    write_gguf(model, tmp_path / "m.gguf", "llama")
    cfg = gguf.read_config(tmp_path / "m.gguf")
    assert cfg.tie_word_embeddings and cfg.family == "llama" and cfg.num_layers == 3


# --- dequantization of every supported type ---------------------------------------------------------------------
def roundtrip(tmp_path, data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    """Write `data` (already encoded as `qtype` bytes, or float for F32/F16) into a GGUF, read it back through kiln."""
    path = tmp_path / f"{qtype.name}.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("t", data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = GGUFReader(path).tensors
    assert tensor.tensor_type == qtype
    out = gguf.dequantize_tensor(tensor, path)
    assert out.shape == shape and out.dtype == np.float32
    return out


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
def test_dequantize_float_types(qtype, tmp_path):
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    if qtype == Q.BF16:  # bf16 = the top 16 bits of float32, rounded to nearest even
        bits = x.view(np.uint32)
        bf = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out = roundtrip(tmp_path, bf.view(np.uint8).reshape(4, 128), qtype, (4, 64))
        np.testing.assert_array_equal(out, (bf.astype(np.uint32) << 16).view(np.float32))
    else:
        data = x if qtype == Q.F32 else x.astype(np.float16)
        np.testing.assert_array_equal(roundtrip(tmp_path, data, qtype, (4, 64)), data.astype(np.float32))


def blocks_of(x: np.ndarray, n: int) -> np.ndarray:
    return x.reshape(-1, n)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_dequantize_legacy_quants(qtype, tmp_path):
    """gguf.quants quantizes these; kiln's values must equal the block formula on the stored (scale, quant) pairs."""
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    packed = quants.quantize(x, qtype)  # (4, bytes)
    out = roundtrip(tmp_path, packed, qtype, (4, 64))
    b = packed.reshape(-1, packed.shape[-1] // 2)  # one row per 32-element block
    d = b[:, :2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
    if qtype == Q.Q8_0:
        expect = d * b[:, 2:].view(np.int8).astype(np.float32)
    else:
        has_min = qtype in (Q.Q4_1, Q.Q5_1)
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32) if has_min else 0.0
        off = 4 if has_min else 2
        hi = np.zeros((b.shape[0], 32), np.int32)
        if qtype in (Q.Q5_0, Q.Q5_1):  # 32 high bits, little-endian, element j's fifth bit is bit j
            qh = b[:, off : off + 4].copy().view(np.uint32)[:, 0]
            hi = ((qh[:, None] >> np.arange(32)) & 1).astype(np.int32) << 4
            off += 4
        nib = b[:, off : off + 16].astype(np.int32)
        q = np.concatenate([nib & 0xF, nib >> 4], axis=1) | hi  # elements 0..15 low nibbles, 16..31 high
        expect = d * (q - {Q.Q4_0: 8, Q.Q5_0: 16}.get(qtype, 0)).astype(np.float32) + m
    np.testing.assert_allclose(out.reshape(-1, 32), expect, rtol=1e-6, atol=1e-7)
    # and the round trip stays within one quantization step of the input (Q4_0 clamps the far end of its range)
    step = np.abs(blocks_of(x, 32)).max(1, keepdims=True) / {Q.Q8_0: 127, Q.Q4_0: 8, Q.Q5_0: 16}.get(qtype, 7.5)
    assert (np.abs(blocks_of(out, 32) - blocks_of(x, 32)) <= step * 1.01 + 1e-3).all()


def f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float16).reshape(-1, 1).view(np.uint8)  # (blocks, 2)


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's 12-byte layout of eight 6-bit scales and mins (inverse of get_scale_min_k4). sc, m: (blocks, 8)."""
    q = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(4):
        q[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        q[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        q[:, j + 8] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    return q


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantize_k_quants(qtype, tmp_path):
    """Hand-packed super-blocks of 256 (random scales, mins and quants) against the formula y = d*sc*q - dmin*m."""
    rng = np.random.default_rng(int(qtype))
    nb = 4  # one super-block per row, 4 rows of 256
    d = rng.uniform(0.01, 0.1, nb).astype(np.float16)
    if qtype == Q.Q6_K:
        u = rng.integers(0, 64, (nb, 256)).astype(np.uint8)  # 6-bit, value = u - 32
        sc = rng.integers(-128, 128, (nb, 16)).astype(np.int8)
        ql = np.zeros((nb, 128), np.uint8)
        qh = np.zeros((nb, 64), np.uint8)
        for h in range(2):
            for l in range(32):
                u1, u2, u3, u4 = (u[:, 128 * h + l + 32 * k] for k in range(4))
                ql[:, 64 * h + l] = (u1 & 0xF) | ((u3 & 0xF) << 4)
                ql[:, 64 * h + l + 32] = (u2 & 0xF) | ((u4 & 0xF) << 4)
                qh[:, 32 * h + l] = (u1 >> 4) | ((u2 >> 4) << 2) | ((u3 >> 4) << 4) | ((u4 >> 4) << 6)
        packed = np.concatenate([ql, qh, sc.view(np.uint8), f16_bytes(d)], axis=1)
        scale = np.repeat(sc.astype(np.float32), 16, axis=1)  # element i uses scale i // 16
        expect = d.astype(np.float32)[:, None] * scale * (u.astype(np.float32) - 32)
    else:
        bits = 4 if qtype == Q.Q4_K else 5
        dmin = rng.uniform(0.01, 0.1, nb).astype(np.float16)
        sc = rng.integers(0, 64, (nb, 8)).astype(np.uint8)
        mn = rng.integers(0, 64, (nb, 8)).astype(np.uint8)
        u = rng.integers(0, 2**bits, (nb, 256)).astype(np.uint8)
        qs = np.zeros((nb, 128), np.uint8)
        qh = np.zeros((nb, 32), np.uint8)
        for c in range(4):  # 64 elements per chunk: the first 32 in low nibbles, the next 32 in high nibbles
            lo, hi = u[:, 64 * c : 64 * c + 32], u[:, 64 * c + 32 : 64 * c + 64]
            qs[:, 32 * c : 32 * c + 32] = (lo & 0xF) | ((hi & 0xF) << 4)
            qh |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1))
        parts = [f16_bytes(d), f16_bytes(dmin), pack_k_scales(sc, mn)] + ([qh] if bits == 5 else []) + [qs]
        packed = np.concatenate(parts, axis=1)
        sub = np.repeat(np.arange(8), 32)  # element i is in sub-block i // 32
        expect = d.astype(np.float32)[:, None] * sc[:, sub].astype(np.float32) * u.astype(np.float32) - dmin.astype(
            np.float32
        )[:, None] * mn[:, sub].astype(np.float32)
    out = roundtrip(tmp_path, packed, qtype, (nb, 256))
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)


def test_quantized_model_loads_close_to_float(tmp_path):
    """A whole tiny model stored as Q8_0 loads through the key table and stays within quantization error."""
    model = make_model("qwen3", tmp_path)
    write_gguf(model, tmp_path / "q8.gguf", "qwen3", qtype=Q.Q8_0)
    _, w = gguf.load(tmp_path / "q8.gguf")
    _, ref = hf.load(tmp_path)
    for a, b in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, atol=np.abs(b).max() / 127 * 0.51 + 1e-6)


# --- files that lie about their layout ---------------------------------------------------------------------------
def crafted(tmp_path, edit) -> tuple[type[BaseException] | None, str, float, int]:
    """A small valid GGUF (a string array, two float tensors), edited by edit(bytearray, find) where find(name) is the
    offset just after a key's or tensor's name; returns (error type, message, seconds, peak traced bytes) of
    gguf.read_config on it."""
    import time
    import tracemalloc

    path = tmp_path / "lie.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("test.list", ["a", "bb", "ccc"])
    w.add_tensor("first.weight", np.ones((4, 32), np.float32))
    w.add_tensor("second.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    edit(data, lambda name: data.index(name.encode()) + len(name))
    path.write_bytes(bytes(data))
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        gguf.read_config(path)
        error, message = None, ""
    except Exception as e:
        error, message = type(e), str(e)
    seconds = time.monotonic() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return error, message, seconds, peak


def u64(data: bytearray, at: int, value: int) -> None:
    data[at : at + 8] = value.to_bytes(8, "little")


LIES = {
    # string array of 2^40 items (the reader used to grow memory until killed)
    "array length": (lambda d, f: u64(d, f("test.list") + 8, 2**40), "claims 1099511627776 items"),
    "string length": (lambda d, f: u64(d, f("test.list") + 16, 2**62), "runs past the end of the file"),
    "tensor count": (lambda d, f: u64(d, 8, 2**50), "more than"),
    "tensor offset shifted by one alignment": (lambda d, f: u64(d, f("first.weight") + 4 + 16 + 4, 32), "overlap"),
    "tensor offset not aligned": (lambda d, f: u64(d, f("second.weight") + 4 + 16 + 4, 513), "alignment"),
    "tensor past the end": (lambda d, f: u64(d, f("second.weight") + 4 + 16 + 4, 2**30), "past the end"),
    "tensor dims": (lambda d, f: u64(d, f("first.weight") + 4, 2**60), "impossible dimensions"),
    "dimension count": (lambda d, f: d.__setitem__(slice(f("first.weight"), f("first.weight") + 4),
                                                   (99).to_bytes(4, "little")), "dimensions"),
}  # fmt: skip


@pytest.mark.parametrize("lie", LIES, ids=list(LIES))
def test_a_gguf_that_lies_about_its_layout_is_refused_in_one_sentence(tmp_path, lie):
    edit, words = LIES[lie]
    error, message, seconds, peak = crafted(tmp_path, edit)
    assert error is gguf.KilnError and words in message and "\n" not in message, (error, message)
    assert message.count(". ") == 0 and message.endswith(".")
    assert seconds < 10 and peak < 2**30, (seconds, peak)


def test_the_untouched_crafted_file_reads(tmp_path):
    error, message, _, _ = crafted(tmp_path, lambda d, f: None)
    assert error is gguf.KilnError and "lacks the metadata field" in message  # a valid layout, only no model in it
