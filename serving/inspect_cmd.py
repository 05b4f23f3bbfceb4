"""`kiln inspect [--model SRC]`: load a model source's config, weights and tokenizer and print a short summary.

It is the quickest check that kiln can read a checkpoint: every tensor is read, dequantized and shape-checked.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from kiln.models.checkpoint import load_checkpoint, resolve_source


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )


def run(args: argparse.Namespace) -> int:
    from kiln.serving.tokenizer import Tokenizer

    path = resolve_source(args.model)
    if path.is_file():  # a GGUF: parse it once for config, weights, tokenizer and tensor types
        from kiln.models.checkpoint import gguf

        reader = gguf.open_reader(path)
        cfg, weights = gguf.load_reader(reader, path)
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata(reader, path), str(path))
        types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    else:
        cfg, weights = load_checkpoint(path)
        tokenizer = Tokenizer.from_source(path)
        types = _safetensors_types(path)
    params = sum(int(leaf.size) for leaf in _leaves(weights))
    lines = [
        ("source", str(path)),
        ("architecture", cfg.family),
        ("layers", str(cfg.num_layers)),
        ("heads", f"{cfg.num_heads} query, {cfg.num_kv_heads} key/value, head_dim {cfg.head_dim}"),
        ("hidden", f"{cfg.hidden_size} (MLP {cfg.intermediate_size})"),
        ("parameters", f"{params:,} ({params / 1e6:.1f}M)"),
        ("tensor types", ", ".join(f"{name} x{n}" for name, n in types.most_common())),
        ("vocab size", f"{cfg.vocab_size} (tokenizer {tokenizer.vocab_size})"),
        ("context", str(cfg.max_position_embeddings)),
        ("chat template", "yes" if tokenizer.chat_template else "no"),
        ("eos ids", ", ".join(map(str, tokenizer.eos_token_ids)) or "none"),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    return 0


def _leaves(weights):
    import jax

    return [leaf for leaf in jax.tree_util.tree_leaves(weights) if leaf is not None]


def _safetensors_types(folder: Path) -> collections.Counter[str]:
    """Count of tensors per stored dtype in a folder's safetensors files."""
    from safetensors import safe_open

    from kiln.models.checkpoint import hf

    counts: collections.Counter[str] = collections.Counter()
    for file in hf.safetensors_files(folder):
        with safe_open(str(file), framework="numpy") as f:
            counts.update(str(f.get_slice(name).get_dtype()) for name in f.keys())
    return counts
