"""From named checkpoint tensors (HF names) to kiln's Weights, through one declarative key table.

Every reader (HF safetensors, GGUF) yields tensors under Hugging Face's names in HF's layout; this module maps each
to a Weights field with a shape check. An unmapped, missing or duplicated key is an error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np

from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.transformer import LayerWeights, Weights

# HF name -> (Weights field, transform). Transforms: linear = transpose (out, in) -> (in, out); norm = (1 + w) for
# Gemma's HF checkpoints; plain = as is.
TOP_KEYS = {
    "model.embed_tokens.weight": ("embed", "plain"),
    "model.norm.weight": ("final_norm", "norm"),
    "lm_head.weight": ("lm_head", "linear"),
}
LAYER_KEYS = {
    "input_layernorm.weight": ("attn_norm", "norm"),
    "self_attn.q_proj.weight": ("wq", "linear"),
    "self_attn.k_proj.weight": ("wk", "linear"),
    "self_attn.v_proj.weight": ("wv", "linear"),
    "self_attn.o_proj.weight": ("wo", "linear"),
    "self_attn.q_proj.bias": ("bq", "plain"),
    "self_attn.k_proj.bias": ("bk", "plain"),
    "self_attn.v_proj.bias": ("bv", "plain"),
    "self_attn.o_proj.bias": ("bo", "plain"),
    "self_attn.q_norm.weight": ("q_norm", "norm"),
    "self_attn.k_norm.weight": ("k_norm", "norm"),
    "mlp.gate_proj.weight": ("w_gate", "linear"),
    "mlp.up_proj.weight": ("w_up", "linear"),
    "mlp.down_proj.weight": ("w_down", "linear"),
}
# Llama-style layers normalise before the MLP with post_attention_layernorm; Gemma 3 has four norms per layer.
LAYER_KEYS_PLAIN = {"post_attention_layernorm.weight": ("mlp_norm", "norm")}
LAYER_KEYS_SANDWICH = {
    "post_attention_layernorm.weight": ("post_attn_norm", "norm"),
    "pre_feedforward_layernorm.weight": ("mlp_norm", "norm"),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", "norm"),
}
# Buffers some checkpoints carry that are not parameters.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$|^(model\.)?(vision_tower|multi_modal_projector)\.")
# Prefixes under which multimodal wrappers keep the text model.
PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")


def key_table(cfg: ModelConfig) -> dict[str, tuple[str, int | None, str]]:
    """Every HF tensor name this config needs -> (Weights field, layer index or None, transform)."""
    used = set(Weights.layer_fields(cfg))
    layer_keys = {**LAYER_KEYS, **(LAYER_KEYS_SANDWICH if cfg.sandwich_norms else LAYER_KEYS_PLAIN)}
    table = {name: (field, None, tr) for name, (field, tr) in TOP_KEYS.items()}
    if cfg.tie_word_embeddings:
        del table["lm_head.weight"]
    for i in range(cfg.num_layers):
        for suffix, (field, tr) in layer_keys.items():
            if field in used:
                table[f"model.layers.{i}.{suffix}"] = (field, i, tr)
    return table


def _canonical(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :] if not name.startswith("language_model.lm_head") else name[15:]
    return name


def build_weights(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype=jnp.float32,
    norm_offset: bool | None = None,
    source: str = "the checkpoint",
) -> Weights:
    """Assemble Weights (numpy leaves cast to `dtype`) from (HF name, array) pairs.

    norm_offset: add 1 to norm weights (Gemma's HF checkpoints store w for a (1 + w) norm); defaults to
    cfg.family == "gemma3". GGUF files already hold 1 + w.
    """
    if norm_offset is None:
        norm_offset = cfg.family == "gemma3"
    table = key_table(cfg)
    shapes = Weights.shapes(cfg)
    np_dtype = np.dtype(jnp.dtype(dtype))
    top: dict[str, np.ndarray] = {}
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(cfg.num_layers)]
    seen: set[str] = set()
    for raw_name, array in tensors:
        name = _canonical(raw_name)
        if IGNORED.match(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue  # a tied checkpoint may still carry lm_head; the tied embedding is used
        if name in seen:
            raise KilnError(f"The tensor {raw_name} appears twice in {source}.")
        seen.add(name)
        if name not in table:
            raise KilnError(f"{source} has a tensor kiln does not know for a {cfg.family} model: {raw_name}.")
        field, layer, transform = table[name]
        a = np.asarray(array)
        if transform == "linear":
            a = a.T
        a = a.astype(np.float32) + 1.0 if (transform == "norm" and norm_offset) else a
        if a.shape != shapes[field]:
            raise KilnError(
                f"The tensor {raw_name} in {source} has shape {tuple(np.shape(array))}, "
                f"which does not match the config (expected {shapes[field]} after conversion)."
            )
        a = np.ascontiguousarray(a.astype(np_dtype))
        (top if layer is None else layers[layer])[field] = a
    missing = [name for name in table if name not in seen]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise KilnError(f"{source} lacks the tensor {missing[0]}{more}.")
    return Weights(
        embed=top["embed"],
        final_norm=top["final_norm"],
        layers=[LayerWeights(**fields) for fields in layers],
        lm_head=top.get("lm_head"),
    )
