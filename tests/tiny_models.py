"""Tiny random-weight Hugging Face models of every family, saved with save_pretrained in float32."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0, tie_word_embeddings=False)),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=24, head_dim=32)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=False)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=32, sliding_window=16, query_pre_attn_scalar=24, sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, final_logit_softcapping=30.0)),
    # mixture of experts: Qwen3-MoE with renormalised top-k and one dense layer (mlp_only_layers), Mixtral
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
}  # fmt: skip


def make_model(family: str, folder: Path, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Create, save (float32 safetensors) and return a tiny random model of `family` (overrides: config fields)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    model = model_cls(config).eval().float()
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma): randomise them so a wrong norm is caught
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # an MoE router: decisive routing, so a wrong expert shows
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return model
