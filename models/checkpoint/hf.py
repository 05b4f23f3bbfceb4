"""Reader for a Hugging Face model folder: config.json, generation_config.json and safetensors (one file, or shards
listed by model.safetensors.index.json)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from kiln.models.checkpoint.convert import build_weights
from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.transformer import Weights


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KilnError(f"{path} does not exist.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path} is not valid JSON ({e.__class__.__name__} at {getattr(e, 'pos', '?')}).") from None
    if not isinstance(data, dict):
        raise KilnError(f"{path} does not hold a JSON object.")
    return data


def load_config(folder: Path) -> ModelConfig:
    """ModelConfig of an HF folder; generation_config.json's eos_token_id wins over config.json's."""
    hf = read_json(folder / "config.json")
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        gen = read_json(gen_path)
        for key in ("eos_token_id", "bos_token_id"):
            if gen.get(key) is not None:
                hf[key] = gen[key]
    return ModelConfig.from_hf(hf)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise KilnError(f"{index} has no weight_map.")
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.exists():
                raise KilnError(f"{index} names the shard {f.name}, which is missing.")
        return files
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise KilnError(f"{folder} holds no model.safetensors (nor shards with model.safetensors.index.json).")


def iter_tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor of every shard, in HF layout."""
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise KilnError(f"{path} is not a readable safetensors file (corrupt or truncated: {e}).") from None


def load(folder: str | Path, dtype=jnp.float32) -> tuple[ModelConfig, Weights]:
    """Config and weights (numpy leaves in `dtype`) of an HF folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KilnError(f"The model folder {folder} does not exist.")
    cfg = load_config(folder)
    return cfg, build_weights(cfg, iter_tensors(folder), dtype=dtype, source=str(folder))
