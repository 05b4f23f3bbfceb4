"""ModelConfig: the static description of a decoder-only transformer, built from HF config.json or GGUF metadata.

One dataclass covers every supported family; the families differ only by the flags below
(qkv bias, q/k norm, sliding windows, Gemma's norms and scalings, mixture-of-experts MLPs), so the graph in
transformer.py is one function.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from kiln.models.errors import KilnError

# HF `architectures[0]` / `model_type` -> kiln family.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
}  # fmt: skip
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one kind of layer: base frequency and optional scaling (HF's rope_type)."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The per-pair inverse frequencies (head_dim // 2,), float32, exactly as HF computes them."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)


@dataclass(frozen=True)
class ModelConfig:
    """Static shape and behaviour of a model. Frozen and hashable: it is a static argument of the jitted step."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    rope_local: RopeConfig | None = None  # Gemma 3: rope of the sliding-window layers
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # Llama with attention_bias
    qk_norm: bool = False  # Qwen3, Gemma 3
    sandwich_norms: bool = False  # Gemma 3: post-attention and post-feed-forward norms
    hidden_act: str = "silu"  # silu | gelu_tanh
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    attn_scale: float = 0.0  # 0 -> head_dim ** -0.5
    sliding_window: int | None = None
    layer_sliding: tuple[bool, ...] = ()  # per layer: does it use the sliding window (empty = none does)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture-of-experts (Qwen3-MoE, Mixtral; kiln.models.moe): experts per sparse layer (0 = a dense model), experts
    # per token, the width of one expert's MLP, renormalising the top-k weights, which layers are sparse.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse (empty = every layer is, when num_experts > 0)
    # None: the dispatch follows the batch size and platform (kiln.models.moe); "dense": every token through every
    # expert, the form the SPMD partitioner splits by expert (expert parallelism: experts spread over the devices)
    moe_dispatch: str | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise KilnError(f"Unknown model family {self.family!r}; kiln supports {', '.join(FAMILIES)}.")
        if self.num_heads % self.num_kv_heads:
            raise KilnError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}.")
        if self.layer_sliding and len(self.layer_sliding) != self.num_layers:
            raise KilnError(f"layer types name {len(self.layer_sliding)} layers but the model has {self.num_layers}.")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise KilnError(f"Unsupported activation {self.hidden_act!r}; kiln supports silu and gelu_pytorch_tanh.")
        if self.moe_layers and len(self.moe_layers) != self.num_layers:
            raise KilnError(f"The MoE layer list names {len(self.moe_layers)} layers; the model has {self.num_layers}.")
        if self.moe_dispatch not in (None, "dense"):
            raise KilnError(f"Unknown MoE dispatch {self.moe_dispatch!r}; None or 'dense'.")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise KilnError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and num_experts {self.num_experts}."
            )

    def is_moe(self, layer: int) -> bool:
        """Does this layer's MLP route over experts (kiln.models.moe) rather than run one dense MLP?"""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer in tokens, or None for global attention."""
        if self.sliding_window is None:
            return None
        if not self.layer_sliding:
            return self.sliding_window
        return self.sliding_window if self.layer_sliding[layer] else None

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.rope_local is not None and self.window(layer) is not None:
            return self.rope_local
        return self.rope

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Inverse of to_dict (the artifact manifest stores the config this way)."""
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        d["rope_local"] = RopeConfig(**d["rope_local"]) if d.get("rope_local") else None
        for key in ("layer_sliding", "eos_token_ids", "moe_layers"):
            d[key] = tuple(d.get(key) or ())
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters`)."""
        family = _hf_family(hf)
        if "text_config" in hf and family == "gemma3":
            hf = {**hf["text_config"], "architectures": hf.get("architectures")}
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            d = dict(
                family=family,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3")),
            )
        except KeyError as e:
            raise KilnError(f"The model's config.json lacks the field {e.args[0]!r}.") from None
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        d["hidden_act"] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act, act)
        rope_global, rope_local = _hf_rope(hf, family)
        d["rope"] = rope_global
        d["bos_token_id"] = hf.get("bos_token_id")
        eos = hf.get("eos_token_id")
        d["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if family == "llama":
            d["qkv_bias"] = d["o_bias"] = bool(hf.get("attention_bias", False))
        if family == "qwen2":
            d["qkv_bias"] = True
        if family in ("qwen3", "qwen3_moe", "gemma3"):
            d["qk_norm"] = True
            d["qkv_bias"] = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if family in ("qwen2", "qwen3", "qwen3_moe"):
            if not hf.get("use_sliding_window", False):
                window, layer_types = None, None
            elif not layer_types:
                first = int(hf.get("max_window_layers", layers))
                layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if family == "gemma3":
            d["sandwich_norms"] = True
            d["embed_scale"] = float(np.float32(hidden**0.5))
            d["attn_scale"] = float(hf.get("query_pre_attn_scalar", d["head_dim"])) ** -0.5
            # transformers' Gemma 3 ignores attn_logit_softcapping (released Gemma 3 configs set it null); so do we.
            d["final_logit_softcap"] = hf.get("final_logit_softcapping")
            d["rope_local"] = rope_local
            if not layer_types:
                pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
                layer_types = [
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
                ]
        if window:
            d["sliding_window"] = int(window)
            if layer_types:
                d["layer_sliding"] = tuple(t == "sliding_attention" for t in layer_types)
        if family in ("qwen3_moe", "mixtral"):
            d.update(_hf_moe(hf, family, layers, d["intermediate_size"]))
        return cls(**d)


def _hf_family(hf: dict) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if archs == ["Gemma3ForConditionalGeneration"]:
        return "gemma3"
    if not archs and hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    name = ", ".join(archs) or hf.get("model_type") or "an unnamed architecture"
    raise KilnError(f"Unsupported architecture {name}; kiln supports {', '.join(ARCHITECTURES)}.")


def _hf_moe(hf: dict, family: str, layers: int, intermediate: int) -> dict:
    """The MoE fields of a Qwen3-MoE or Mixtral config.json. Qwen3-MoE: `num_experts` (transformers 5.x writes
    `num_local_experts`), `moe_intermediate_size`, `norm_topk_prob`, and dense layers where `mlp_only_layers` names
    them or `(i + 1) % decoder_sparse_step` is not 0; Mixtral: every layer sparse, experts as wide as
    `intermediate_size`, top-k weights always renormalised. Shared experts (Qwen2-MoE, DeepSeek) are not supported."""
    if hf.get("shared_expert_intermediate_size") or hf.get("n_shared_experts"):
        raise KilnError("kiln's mixture-of-experts layers have no shared experts; this config asks for them.")
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    d = dict(num_experts=experts, num_experts_per_tok=int(hf.get("num_experts_per_tok") or 2))
    if family == "mixtral":
        return {**d, "moe_intermediate_size": intermediate, "norm_topk_prob": True}
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    moe_layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    return {
        **d,
        "moe_intermediate_size": int(hf.get("moe_intermediate_size") or intermediate),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "moe_layers": () if all(moe_layers) else moe_layers,
    }


def _rope_from(params: dict, default_theta: float) -> RopeConfig:
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise KilnError(f"Unsupported rope scaling {kind!r}; kiln supports default, linear and llama3.")
    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _hf_rope(hf: dict, family: str) -> tuple[RopeConfig, RopeConfig | None]:
    theta = float(hf.get("rope_theta", 1_000_000.0 if family == "gemma3" else 10000.0))
    params = hf.get("rope_parameters")
    if params and "full_attention" in params:  # transformers 5.x Gemma 3
        return _rope_from(params["full_attention"], theta), _rope_from(params["sliding_attention"], 10000.0)
    if params:
        return _rope_from(params, theta), None
    scaling = hf.get("rope_scaling") or {}
    rope = _rope_from({**scaling, "rope_theta": theta}, theta)
    local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10000.0))) if family == "gemma3" else None
    return rope, local
