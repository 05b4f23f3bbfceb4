"""From named checkpoint tensors (HF names) to kiln's Weights, through one declarative key table.

Every reader (HF safetensors, GGUF) yields tensors under Hugging Face's names in HF's layout; this module maps each
to a Weights field with a shape check. An unmapped, missing or duplicated key is an error.

Mixture-of-experts layers stack their experts into one (X, ...) tensor per projection. Checkpoints name them one expert
at a time (what transformers 5.x's save_pretrained writes, and every released Qwen3-MoE and Mixtral): Qwen3-MoE
`mlp.gate.weight` (router) and `mlp.experts.<j>.{gate,up,down}_proj.weight`, Mixtral `block_sparse_moe.gate.weight`
and `block_sparse_moe.experts.<j>.{w1,w3,w2}.weight` (gate, up, down); transformers 5.x's fused in-memory layout,
`mlp.experts.gate_up_proj` (X, 2F, E) and `mlp.experts.down_proj` (X, E, F), is read too.
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
# Mixture-of-experts layers: router and one expert's projections (gate, up, down) under each family's names.
MOE_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
STACKED = ("experts_gate", "experts_up", "experts_down")  # the stacked LayerWeights fields, (X, ...)
# Buffers some checkpoints carry that are not parameters.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$|^(model\.)?(vision_tower|multi_modal_projector)\.")
# Prefixes under which multimodal wrappers keep the text model.
PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")


def key_table(cfg: ModelConfig) -> dict[str, tuple[str, int | None, str, int | None]]:
    """Every HF tensor name this config reads -> (Weights field, layer index or None, transform, expert index or None
    (one expert of a stacked field)). Transforms: see TOP_KEYS; "stacked" = (X, out, in) -> (X, in, out); "gate_up" =
    the fused (X, 2F, E) gate and up, into experts_gate and experts_up."""
    layer_keys = {**LAYER_KEYS, **(LAYER_KEYS_SANDWICH if cfg.sandwich_norms else LAYER_KEYS_PLAIN)}
    table = {name: (field, None, tr, None) for name, (field, tr) in TOP_KEYS.items()}
    if cfg.tie_word_embeddings:
        del table["lm_head.weight"]
    for i in range(cfg.num_layers):
        used = set(Weights.layer_fields(cfg, layer=i))
        for suffix, (field, tr) in layer_keys.items():
            if field in used:
                table[f"model.layers.{i}.{suffix}"] = (field, i, tr, None)
        if cfg.is_moe(i):
            base, *projections = MOE_NAMES[cfg.family]
            for prefix in dict.fromkeys((base, "mlp")):
                table[f"model.layers.{i}.{prefix}.gate.weight"] = ("router", i, "linear", None)
            for j in range(cfg.num_experts):
                for proj, field in zip(projections, STACKED, strict=True):
                    table[f"model.layers.{i}.{base}.experts.{j}.{proj}.weight"] = (field, i, "linear", j)
            table[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ("experts_gate_up", i, "gate_up", None)
            table[f"model.layers.{i}.mlp.experts.down_proj"] = ("experts_down", i, "stacked", None)
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
    shapes["experts_gate_up"] = shapes["experts_gate"][:2] + (2 * shapes["experts_gate"][2],)
    np_dtype = np.dtype(jnp.dtype(dtype))
    top: dict[str, np.ndarray] = {}
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(cfg.num_layers)]
    filled = [{f: np.zeros(cfg.num_experts, bool) for f in STACKED} for _ in range(cfg.num_layers)]  # experts read
    seen: set[str] = set()

    def stack(raw_name, layer, field, a, expert):  # one expert (expert: int) or all of them (None) of a stacked field
        done = filled[layer][field]
        if done[expert if expert is not None else slice(None)].any():
            raise KilnError(f"{source} holds the tensor {raw_name} and another copy of the same experts.")
        done[expert if expert is not None else slice(None)] = True
        if field not in layers[layer]:
            layers[layer][field] = np.empty(shapes[field], np_dtype)
        layers[layer][field][expert if expert is not None else slice(None)] = a

    for raw_name, array in tensors:
        name = _canonical(raw_name)
        if IGNORED.match(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue  # a tied checkpoint may still carry lm_head; the tied embedding is used
        if name in seen:
            raise KilnError(f"The tensor {raw_name} appears twice in {source}.")
        seen.add(name)
        if name not in table:
            raise KilnError(f"{source} has a tensor kiln does not know for a {cfg.family} model: {raw_name}.")
        field, layer, transform, expert = table[name]
        a = np.asarray(array)
        if transform == "linear":
            a = a.T
        elif transform in ("stacked", "gate_up"):
            a = a.swapaxes(1, 2) if a.ndim == 3 else a
        a = a.astype(np.float32) + 1.0 if (transform == "norm" and norm_offset) else a
        expected = shapes[field][1:] if expert is not None else shapes[field]
        if a.shape != expected:
            raise KilnError(
                f"The tensor {raw_name} in {source} has shape {tuple(np.shape(array))}, "
                f"which does not match the config (expected {expected} after conversion)."
            )
        if transform == "gate_up":
            half = shapes["experts_gate"][2]
            stack(raw_name, layer, "experts_gate", a[..., :half], None)
            stack(raw_name, layer, "experts_up", a[..., half:], None)
        elif field in STACKED:
            stack(raw_name, layer, field, a, expert)
        else:
            target = top if layer is None else layers[layer]
            if field in target:  # an MoE router under both its names
                raise KilnError(f"The tensor {raw_name} appears twice in {source}.")
            target[field] = np.ascontiguousarray(a.astype(np_dtype))

    def have(field, layer, expert) -> bool:
        if field in STACKED:
            return expert is None or bool(filled[layer][field][expert])  # the fused forms are alternatives
        return field == "experts_gate_up" or field in (top if layer is None else layers[layer])

    missing, reported = [], set()
    for name, (field, layer, _, expert) in table.items():
        if not have(field, layer, expert) and (field, layer, expert) not in reported:
            reported.add((field, layer, expert))
            missing.append(name)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise KilnError(f"{source} lacks the tensor {missing[0]}{more}.")
    return Weights(
        embed=top["embed"],
        final_norm=top["final_norm"],
        layers=[LayerWeights(**fields) for fields in layers],
        lm_head=top.get("lm_head"),
    )
