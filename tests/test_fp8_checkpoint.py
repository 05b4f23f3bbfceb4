"""FP8 checkpoints (models/checkpoint/hf.py): a tiny random model quantized here to float8_e4m3fn with per-tensor,
per-channel and 128x128-style block scales (the compressed-tensors and "fp8" layouts), loaded by kiln dequantized:
the weights equal the dequantized float ones exactly, and kiln's greedy tokens through the jit path (LLM) equal
transformers' on those dequantized weights; the logit error against the original float model is printed."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import make_model
from tiny_tokenizer import write_tokenizer

from kiln.models.checkpoint import hf
from kiln.models.errors import KilnError

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # tiny models: compiling costs more than running

FP8_MAX = 448.0
QUANTIZED = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")  # the linear layers (not embed, head, router)
SCHEMES = {
    "per_tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
                                                 "strategy": "tensor"}}}},
    "per_channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
                                                  "strategy": "channel"}}}},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [24, 24]},
}  # fmt: skip


def quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float32 -> (float8_e4m3fn q, float32 scale) with w ~ q * scale under the scheme."""
    if scheme == "per_tensor":
        scale = w.abs().max() / FP8_MAX
        return (w / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    if scheme == "per_channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX  # (out, 1)
        return (w / scale).to(torch.float8_e4m3fn), scale
    b = 24
    out, k = w.shape
    pad = torch.zeros(-(-out // b) * b, -(-k // b) * b)
    pad[:out, :k] = w
    blocks = pad.reshape(pad.shape[0] // b, b, pad.shape[1] // b, b)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # (ceil(out / b), ceil(in / b))
    full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:out, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    if scale.ndim == 2 and scale.shape[1] != 1:
        scale = scale.repeat_interleave(24, 0).repeat_interleave(24, 1)[: shape[0], : shape[1]]
    return q.float() * scale


def fp8_checkpoint(tmp_path, family: str, scheme: str):
    """The original float folder, the FP8 folder and the dequantized float folder of one tiny random model."""
    orig, fp8, deq = tmp_path / "float", tmp_path / "fp8", tmp_path / "dequantized"
    make_model(family, orig)
    tensors = load_file(orig / "model.safetensors")
    quant, dequant = {}, {}
    for name, w in tensors.items():
        if not name.endswith(QUANTIZED):
            quant[name] = dequant[name] = w
            continue
        q, scale = quantize(w, scheme)
        quant[name] = q
        quant[name + ("_scale_inv" if scheme == "block" else "_scale")] = scale
        if scheme == "per_tensor":
            quant[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.05])
        dequant[name] = dequantize(q, scale, w.shape)
    for folder, data in ((fp8, quant), (deq, dequant)):
        folder.mkdir()
        save_file(data, folder / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((orig / "config.json").read_text())
        if folder == fp8:
            config["quantization_config"] = SCHEMES[scheme]
        (folder / "config.json").write_text(json.dumps(config))
        shutil.copy(orig / "generation_config.json", folder)
        write_tokenizer(folder)
    return orig, fp8, deq


@pytest.mark.parametrize("family,scheme", [("llama", "per_tensor"), ("llama", "per_channel"), ("qwen3_moe", "block")])
def test_fp8_checkpoint_loads_dequantized_and_matches_transformers(family, scheme, tmp_path, caplog):
    import jax

    from kiln.serving.llm import LLM, build_engine
    from kiln.serving.params import SamplingParams

    orig, fp8, deq = fp8_checkpoint(tmp_path, family, scheme)
    with caplog.at_level(logging.INFO, logger="kiln.models"):
        cfg, weights = hf.load(fp8)
    assert any("float8 weights dequantized to float32" in r.getMessage() for r in caplog.records), caplog.text
    assert ("input scales dropped" in caplog.text) == (scheme == "per_tensor")
    _, want = hf.load(deq)
    for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)

    ref = transformers.AutoModelForCausalLM.from_pretrained(deq).eval().float()
    ref.generation_config.eos_token_id = None
    original = transformers.AutoModelForCausalLM.from_pretrained(orig).eval().float()
    prompts = [[5, 9, 17, 33, 65, 129, 7, 3, 11], [42, 43, 44]]
    with torch.no_grad():
        want_tokens = [ref.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p) :].tolist()
                       for p in prompts]  # fmt: skip
        fp8_logits = ref(torch.tensor([prompts[0]])).logits[0].numpy()
        float_logits = original(torch.tensor([prompts[0]])).logits[0].numpy()
    llm = LLM(engine=build_engine(str(fp8), max_model_len=64, max_num_seqs=2, buckets=(4, 16)))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == want_tokens
    err = np.linalg.norm(fp8_logits - float_logits) / np.linalg.norm(float_logits)
    agree = sum(a == b for a, b in zip(want_tokens[0], _greedy(original, prompts[0]), strict=True))
    print(f"{family} {scheme}: fp8 vs float logits relative error {err:.2e}, greedy agreement {agree}/32")
    assert err < 0.1


def _greedy(model, prompt):
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()


def test_other_quantization_methods_are_one_sentence(tmp_path):
    make_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KilnError, match="quantized with gptq; kiln reads float and FP8 checkpoints"):
        hf.load(tmp_path)
