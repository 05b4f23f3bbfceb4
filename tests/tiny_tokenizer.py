"""A word-level tokenizer.json for the tiny models (token i is the word "t<i>"), so they compile into artifacts."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers


def write_tokenizer(folder: Path, vocab_size: int = 256) -> None:
    """Write tokenizer.json and tokenizer_config.json (<pad>=0, <s>=1, </s>=2) into a tiny model's folder."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
