"""Reader for a GGUF file (llama.cpp's and Ollama's format): ModelConfig from its metadata, Weights from its tensors.

Tensors are dequantized to float32 with the gguf package's numpy code, renamed from llama.cpp's names onto Hugging
Face's (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`), and go through the same declarative key
table and shape checks as an HF folder (convert.build_weights). Two things llama.cpp's converter changed are undone
here: the Q/K row permutation of llama-arch models (exactly as transformers' GGUF loader undoes it), and nothing else:
Gemma's GGUF norms already hold 1 + w, which is what kiln stores.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, quants

from kiln.models.checkpoint.convert import build_weights
from kiln.models.config import ModelConfig, RopeConfig
from kiln.models.errors import KilnError
from kiln.models.transformer import Weights

# GGUF general.architecture -> kiln family. llama.cpp writes Mistral models as "llama".
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
# Tensor types kiln dequantizes (each one is tested against an independent encoding in tests/test_gguf.py).
Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)

# llama.cpp tensor name (after blk.N.) -> HF name (after model.layers.N.).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 normalises four times per layer; llama.cpp calls the pre-MLP one ffn_norm.
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Tensors that configure rather than parameterise (llama 3.1's rope factors are read into the config).
SKIPPED = {"rope_freqs.weight"}
# Token ids that end generation (llama.cpp's end-of-generation set).
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def open_reader(path: str | Path) -> GGUFReader:
    """A GGUFReader over `path`; a missing, truncated or corrupt file is a KilnError. The file's layout is checked
    against its size first (check_layout), so a lying length or offset is refused before anything is allocated."""
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"The GGUF file {path} does not exist.")
    check_layout(path)
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises whatever numpy or struct raise on bad bytes
        raise KilnError(f"{path} is not a readable GGUF file (corrupt or truncated: {_short(e)}).") from None


_SCALARS = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
            GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
            GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}  # fmt: skip
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8


class _Lie(Exception):
    """A length, count or offset in the file that its size (or the format) cannot back."""


def check_layout(path: Path) -> None:
    """Walk a GGUF file's header (metadata and tensor table) bounded by the file's size: every string and array
    length, the counts, each tensor's dims and type, and each tensor's extent (aligned, inside the file, no two
    overlapping) must be possible, else one KilnError sentence. Nothing is allocated in proportion to a stated
    length, so a crafted file fails in milliseconds."""
    size = path.stat().st_size
    if size < 24:
        raise KilnError(f"{path} is not a GGUF file (only {size} bytes).")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise KilnError(f"{path} is not a GGUF file (no GGUF magic).")
        end = "<" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF else ">"  # llama.cpp writes both byte orders
        try:
            _walk(m, size, end)
        except _Lie as e:
            raise KilnError(f"{path} is not a valid GGUF file: {e}.") from None
        except struct.error:
            raise KilnError(f"{path} is not a valid GGUF file: it ends inside its header.") from None


def _walk(m: mmap.mmap, size: int, end: str) -> None:
    pos = 8

    def take(fmt: str) -> int:
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise _Lie("the header runs past the end of the file")
        (value,) = struct.unpack_from(end + fmt, m, pos)
        pos += n
        return value

    def skip(n: int, what: str) -> None:
        nonlocal pos
        if n < 0 or pos + n > size:
            raise _Lie(f"{what} of {n} bytes runs past the end of the file ({size} bytes)")
        pos += n

    def string(what: str) -> bytes:
        n = take("Q")
        start = pos
        skip(n, what)
        return bytes(m[start : start + n]) if n <= 256 else b""

    def value(kind: int, key: str, depth: int) -> int | None:
        if kind in _SCALARS:
            width = _SCALARS[GGUFValueType(kind)]
            if width == 4 and kind == GGUFValueType.UINT32:
                return take("I")
            skip(width, f"the value of {key}")
            return None
        if kind == GGUFValueType.STRING:
            string(f"the string {key}")
            return None
        if kind != GGUFValueType.ARRAY or depth > MAX_ARRAY_DEPTH:
            raise _Lie(f"the metadata field {key} has an unknown value type {kind}")
        item, count = take("I"), take("Q")
        if item in _SCALARS:
            skip(count * _SCALARS[GGUFValueType(item)], f"the array {key}")
        else:
            if count * 8 > size - pos:  # each string or array item takes at least 8 bytes
                raise _Lie(f"the array {key} claims {count} items, more than the file can hold")
            for _ in range(count):
                value(item, key, depth + 1)
        return None

    n_tensors, n_kv = take("Q"), take("Q")
    if n_kv * 13 > size or n_tensors * 28 > size:  # the smallest possible entry of each
        raise _Lie(f"it claims {n_kv} metadata fields and {n_tensors} tensors, more than {size} bytes can hold")
    alignment = 32
    for _ in range(n_kv):
        key = string("a metadata key").decode("utf-8", "replace")[:80] or "?"
        got = value(take("I"), key, 0)
        if key == "general.alignment" and got is not None:
            alignment = got
    if alignment < 1 or alignment & (alignment - 1):
        raise _Lie(f"general.alignment {alignment} is not a power of two")
    tensors = []
    for _ in range(n_tensors):
        name = string("a tensor name").decode("utf-8", "replace")[:80] or "?"
        n_dims = take("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _Lie(f"the tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = [take("Q") for _ in range(n_dims)]
        kind, offset = take("I"), take("Q")
        if kind not in GGML_QUANT_SIZES:
            raise _Lie(f"the tensor {name} has an unknown type {kind}")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        count = math.prod(dims)
        if count == 0 or dims[0] % block or count // block * type_size > size:
            raise _Lie(f"the tensor {name} has impossible dimensions {dims} for its type")
        if offset % alignment:
            raise _Lie(f"the tensor {name} starts at offset {offset}, not a multiple of the alignment {alignment}")
        tensors.append((offset, count // block * type_size, name))
    data = -(-pos // alignment) * alignment
    last_end, last_name = 0, ""
    for offset, nbytes, name in sorted(tensors):
        if offset < last_end:
            raise _Lie(f"the tensors {last_name} and {name} overlap")
        if data + offset + nbytes > size:
            raise _Lie(f"the tensor {name} ({nbytes} bytes at offset {offset}) runs past the end of the file")
        last_end, last_name = offset + nbytes, name


def metadata(reader: GGUFReader, path: str | Path = "the GGUF file") -> dict[str, Any]:
    """Every metadata field as a Python value (strings, numbers, lists)."""
    out = {}
    try:
        for key, field in reader.fields.items():
            value = field.contents()
            out[key] = value.item() if isinstance(value, np.generic) else value
    except Exception as e:
        raise KilnError(f"{path} holds unreadable metadata (corrupt or truncated: {_short(e)}).") from None
    return out


def read_config(path: str | Path) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (no tensor is dequantized)."""
    reader = open_reader(path)
    return config_from_metadata(metadata(reader, path), reader, path)


def load(path: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, Weights]:
    """Config and weights (numpy leaves in `dtype`) of a GGUF file."""
    return load_reader(open_reader(path), path, dtype)


def load_reader(reader: GGUFReader, path: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, Weights]:
    """`load` over an already opened reader (opening parses all metadata, which takes seconds for big vocabularies)."""
    cfg = config_from_metadata(metadata(reader, path), reader, path)
    return cfg, build_weights(cfg, iter_tensors(reader, cfg, path), dtype=dtype, norm_offset=False, source=str(path))


def config_from_metadata(meta: dict[str, Any], reader: GGUFReader, path: str | Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise KilnError(
            f"Unsupported GGUF architecture {arch or 'none'} in {path}; kiln supports {', '.join(ARCHITECTURES)}."
        )
    family = ARCHITECTURES[arch]
    if family == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        family = "mistral"
    names = {t.name for t in reader.tensors}

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise KilnError(f"{path} lacks the metadata field {arch}.{key}.")
        return meta[f"{arch}.{key}"]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    layers = int(need("block_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; kiln needs them all equal
        if len(set(kv_heads)) != 1:
            raise KilnError(f"{path} has a different number of KV heads per layer, which kiln does not support.")
        kv_heads = kv_heads[0]
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None and "token_embd.weight" in names:
        vocab = int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1])
    if vocab is None:
        raise KilnError(f"{path} states no vocabulary size (no {arch}.vocab_size and no tokenizer).")
    d: dict[str, Any] = dict(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(meta[k]) for k in EOS_KEYS if k in meta)),
    )
    theta = float(meta.get(f"{arch}.rope.freq_base", 1_000_000.0 if family == "gemma3" else 10000.0))
    d["rope"] = _rope(meta, arch, theta, head_dim, reader, path)
    window = meta.get(f"{arch}.attention.sliding_window")
    if family in ("llama", "mistral") and window:
        d["sliding_window"] = int(window)
    if family == "gemma3":
        d.update(sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=float(np.float32(hidden**0.5)))
        # llama.cpp: Gemma 3 27B (62 layers) scales queries by (hidden / heads) ** -0.5, the others by head_dim.
        d["attn_scale"] = float(hidden // heads if layers == 62 else head_dim) ** -0.5
        d["final_logit_softcap"] = meta.get(f"{arch}.final_logit_softcapping")
        d["rope_local"] = RopeConfig(theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)))
        d["sliding_window"] = int(window or 512)
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            d["layer_sliding"] = tuple(bool(p) for p in pattern)
        else:
            d["layer_sliding"] = tuple((i + 1) % int(pattern) != 0 for i in range(layers))
    return ModelConfig(**d)


def _rope(meta: dict, arch: str, theta: float, head_dim: int, reader: GGUFReader, path) -> RopeConfig:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear" and factor != 1.0:
        return RopeConfig(theta=theta, kind="linear", factor=factor)
    if kind not in ("none", "linear"):
        raise KilnError(f"{path} uses rope scaling {kind!r}; kiln supports linear and llama3 rope scaling.")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return RopeConfig(theta=theta)
    # Llama 3.1+: llama.cpp stores the per-frequency divisors instead of the rope_scaling dict. Recover the dict
    # (Meta's published low/high factors and original context) and check it reproduces the stored divisors.
    stored = np.asarray(dequantize_tensor(freqs, path), np.float32).reshape(-1)  # (head_dim // 2,)
    factor = float(stored.max())
    base = RopeConfig(theta=theta).inv_freq(head_dim)  # (head_dim // 2,)
    origs = (
        [int(meta[f"{arch}.rope.scaling.original_context_length"])]
        if f"{arch}.rope.scaling.original_context_length" in meta
        else [8192]
    )
    medium = (stored > 1.0 + 1e-6) & (stored < factor - 1e-6)
    if medium.any() and factor > 1.0:  # solve smooth = (orig / wavelen - low) / (high - low) from one medium band
        i = int(np.argmax(medium))
        smooth = (1.0 / stored[i] - 1.0 / factor) / (1.0 - 1.0 / factor)
        origs.append(round(2 * math.pi / base[i] * (smooth * (4.0 - 1.0) + 1.0)))
    for orig in origs:
        rope = RopeConfig(theta=theta, kind="llama3", factor=factor, original_max_position=orig)
        if np.allclose(base / rope.inv_freq(head_dim), stored, rtol=1e-3):
            return rope
    raise KilnError(f"{path} has rope frequency factors kiln cannot express as llama3 rope scaling.")


def iter_tensors(reader: GGUFReader, cfg: ModelConfig, path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array in HF layout) for every tensor of the file."""
    layer_names = GEMMA_LAYER_NAMES if cfg.family == "gemma3" else LAYER_NAMES
    permute = cfg.family in ("llama", "mistral")
    for tensor in reader.tensors:
        if tensor.name in SKIPPED:
            continue
        name = hf_name(tensor.name, layer_names)
        if name is None:
            raise KilnError(f"{path} has a tensor kiln does not know for a {cfg.family} model: {tensor.name}.")
        array = dequantize_tensor(tensor, path)
        if permute and ".attn_q." in tensor.name:
            array = reverse_permute(array, cfg.num_heads)
        elif permute and ".attn_k." in tensor.name:
            array = reverse_permute(array, cfg.num_kv_heads)
        yield name, array


def hf_name(name: str, layer_names: dict[str, str] = LAYER_NAMES) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None when there is none."""
    if m := LAYER_RE.match(name):
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{layer_names[part]}.{kind}" if part in layer_names else None
    stem, _, kind = name.rpartition(".")
    return f"{TOP_NAMES[stem]}.{kind}" if stem in TOP_NAMES else None


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute of Q/K rows (it interleaves the two rotary halves per head).

    w: (n_head * head_dim, ...) -> same shape, rows back in HF's rotate_half order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantize_tensor(tensor, path) -> np.ndarray:
    """float32 array of a tensor in numpy order (HF's (out, in) for linear weights)."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise KilnError(
            f"The tensor {tensor.name} in {path} has type {tensor.tensor_type.name}, which kiln cannot dequantize "
            f"(supported: {supported})."
        )
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    try:
        out = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return np.asarray(out, np.float32).reshape(shape)
    except (ValueError, IndexError, TypeError) as e:
        raise KilnError(f"The tensor {tensor.name} in {path} is corrupt or truncated ({_short(e)}).") from None


def _short(e: BaseException) -> str:
    text = str(e).strip().rstrip(".") or e.__class__.__name__
    return text.splitlines()[0][:160]
