"""A model's tokenizer as its checkpoint holds it: the `tokenizers` backend, chat template, special tokens and
generation defaults, read from a Hugging Face folder (tokenizer.json, tokenizer_config.json, chat_template.jinja,
generation_config.json) or a GGUF file (llama.cpp's tokenizer.ggml.* metadata: byte-level BPE "gpt2" and
SentencePiece "llama"), and saved/loaded in an artifact's form (tokenizer.json + kiln_tokenizer.json).

Reading only: encoding, decoding and chat templates are kiln.serving.tokenizer.Tokenizer, which extends this class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from kiln.models.errors import KilnError

ARTIFACT_FILE = "kiln_tokenizer.json"
# generation_config.json keys that become per-request defaults (as vLLM takes them).
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

# llama.cpp tokenizer.ggml.pre -> the split regex its merges were learned with (as transformers' GGUF loader).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


@dataclass
class TokenizerData:
    """What a tokenizer is made of. eos_token_ids also holds the eos_token's id; special_tokens drops unset names."""

    backend: BackendTokenizer
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: dict = field(default_factory=dict)
    clean_up_tokenization_spaces: bool = False

    def __post_init__(self) -> None:
        self.special_tokens = {k: v for k, v in (self.special_tokens or {}).items() if v is not None}
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = self.backend.token_to_id(bos) if bos else None
        eos = self.special_tokens.get("eos_token")
        eos_id = self.backend.token_to_id(eos) if eos else None
        extra = [int(i) for i in self.eos_token_ids]
        self.eos_token_ids = tuple(dict.fromkeys(([eos_id] if eos_id is not None else []) + extra))
        self.generation_defaults = dict(self.generation_defaults or {})
        self.clean_up_tokenization_spaces = bool(self.clean_up_tokenization_spaces)

    @classmethod
    def from_source(cls, path: str | Path) -> TokenizerData:
        """From an HF model folder, a .gguf file or an artifact's tokenizer folder."""
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path)
        if (path / ARTIFACT_FILE).exists():
            return cls.load(path)
        if path.is_dir():
            return cls.from_hf(path)
        raise KilnError(f"{path} is neither a model folder nor a .gguf file, so it has no tokenizer.")

    @classmethod
    def from_hf(cls, folder: Path) -> TokenizerData:
        file = folder / "tokenizer.json"
        if not file.exists():
            raise KilnError(f"The model folder {folder} has no tokenizer.json.")
        try:
            backend = BackendTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises its own Exception type for bad JSON
            raise KilnError(f"{file} is not a readable tokenizer.json ({str(e).splitlines()[0][:120]}).") from None
        config = _read_json(folder / "tokenizer_config.json")
        special = {k: _token_text(config.get(k)) for k in NAMED_SPECIAL}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
        _add_named_specials(backend, list(special.values()) + [_token_text(t) for t in extra])
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            _set_post_processor(
                backend, special, config.get("add_bos_token", False), config.get("add_eos_token", False)
            )
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif (folder / "chat_template.json").exists():
            template = _read_json(folder / "chat_template.json").get("chat_template", template)
        gen = _read_json(folder / "generation_config.json")
        eos = gen.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            backend,
            chat_template=template,
            special_tokens=special,
            eos_token_ids=eos_ids,
            generation_defaults={k: gen[k] for k in GENERATION_KEYS if gen.get(k) is not None},
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    @classmethod
    def from_gguf(cls, path: Path) -> TokenizerData:
        from kiln.models.checkpoint import gguf

        meta = gguf.metadata(gguf.open_reader(path), path)
        return cls.from_gguf_metadata(meta, str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "the GGUF file") -> TokenizerData:
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise KilnError(f"{source} holds no tokenizer (no tokenizer.ggml.tokens).")
        arch = meta.get("general.architecture")
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
        elif kind == "llama":
            backend = _sentencepiece_bpe(meta, gemma=arch in ("gemma", "gemma2", "gemma3"))
        else:
            raise KilnError(f"{source} uses the tokenizer type {kind!r}; kiln supports gpt2 (BPE) and llama (SPM).")
        types = meta.get("tokenizer.ggml.token_type") or []
        byte_alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types, strict=False)
            if ty == CONTROL and (byte_alphabet is None or set(t) <= byte_alphabet)
        ]
        if control:
            backend.add_special_tokens(control)
        vocab = backend.get_vocab()
        user = [AddedToken(t, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty == USER_DEFINED]
        if user := [a for a in user if a.content in vocab]:
            backend.add_tokens(user)
        ids = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        special = {}
        for name, key in ids.items():
            i = meta.get(f"tokenizer.ggml.{key}_token_id")
            special[name] = tokens[i] if i is not None and 0 <= i < len(tokens) else None
        _add_named_specials(backend, list(special.values()))
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        _set_post_processor(backend, special, add_bos, meta.get("tokenizer.ggml.add_eos_token", False))
        eos_ids = tuple(
            int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta
        )
        return cls(
            backend, chat_template=meta.get("tokenizer.chat_template"), special_tokens=special, eos_token_ids=eos_ids
        )

    @classmethod
    def load(cls, folder: str | Path, backend: BackendTokenizer | None = None) -> TokenizerData:
        """The artifact form written by `save` (backend: tokenizer.json already parsed, by kiln serve's prefetch)."""
        folder = Path(folder)
        extra = _read_json(folder / ARTIFACT_FILE)
        if not extra or not (folder / "tokenizer.json").exists():
            raise KilnError(f"{folder} holds no saved tokenizer (tokenizer.json and {ARTIFACT_FILE}).")
        return cls(
            backend or BackendTokenizer.from_file(str(folder / "tokenizer.json")),
            chat_template=extra.get("chat_template"),
            special_tokens=extra.get("special_tokens"),
            eos_token_ids=tuple(extra.get("eos_token_ids") or ()),
            generation_defaults=extra.get("generation_defaults"),
            clean_up_tokenization_spaces=bool(extra.get("clean_up_tokenization_spaces", False)),
        )

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and kiln_tokenizer.json into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        extra = {
            "chat_template": self.chat_template,
            "special_tokens": self.special_tokens,
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "generation_defaults": self.generation_defaults,
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
        }
        (folder / ARTIFACT_FILE).write_text(json.dumps(extra, indent=2, ensure_ascii=False), encoding="utf-8")


# --- helpers ----------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path} is not valid JSON ({e.__class__.__name__}).") from None
    return data if isinstance(data, dict) else {}


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _add_named_specials(backend: BackendTokenizer, tokens: list[str | None]) -> None:
    """Named special tokens not yet known as added tokens become special added tokens (as transformers does)."""
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    new = [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(tokens) if t and t not in known]
    if new:
        backend.add_special_tokens(new)


def _set_post_processor(backend: BackendTokenizer, special: dict, add_bos: bool, add_eos: bool) -> None:
    """BOS/EOS insertion as transformers' update_post_processor builds it."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = bool(add_bos and bos), bool(add_eos and eos)
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    tokens = ([(bos, backend.token_to_id(bos))] if add_bos else []) + (
        [(eos, backend.token_to_id(eos))] if add_eos else []
    )
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table of byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> BackendTokenizer:
    """GGUF "gpt2": byte-level BPE from the vocabulary and merges, split like the model's original tokenizer."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges]
    backend = BackendTokenizer(
        BPE(
            vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    split = PRE_SPLITS.get(pre or "")
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
    elif pre == "smollm":  # SmolLM's tokenizer splits digits one by one before GPT-2's split
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict[str, Any], gemma: bool) -> BackendTokenizer:
    """GGUF "llama": SentencePiece BPE with byte fallback; merges recovered from the scores (or, for Gemma, from the
    token order), as transformers' GGUF loader and llama.cpp do."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    if gemma:  # Gemma stores runs of spaces as real spaces where its vocabulary spells them with U+2581
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges_from_scores(vocab, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    if gemma:
        backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, byte_fallback=True))
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return backend
    backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged token first (transformers' generate_merges)."""
    merges = []
    for merged, score in scores.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]
