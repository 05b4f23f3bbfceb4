"""The tokenizer at run time: encoding, decoding (also incrementally) and the chat template of a model.

Reading it from a source (HF folder, GGUF, artifact form) is kiln.models.checkpoint.tokenizer's; this module adds the
behaviour. Encoding, decoding and chat templates follow transformers' semantics so that ids and prompts match it
exactly; transformers itself is not needed at run time.
"""

from __future__ import annotations

import json
import re
import threading
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.models.checkpoint.tokenizer import TokenizerData
from kiln.models.errors import KilnError


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never emitting a broken UTF-8 sequence.

    It re-decodes a short window (from `prefix` to the end) and emits only the text beyond what the window's older
    part already produced; while the window ends in U+FFFD (a character whose bytes are still arriving, e.g. an emoji
    split over byte-fallback tokens) it waits.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids up to here have been emitted

    def push(self, ids: list[int]) -> str:
        """Add ids; return the newly completed text (possibly empty)."""
        self._ids.extend(int(i) for i in ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end decodes as U+FFFD)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]


class Tokenizer(TokenizerData):
    """Text <-> token ids, the chat template and the generation defaults of one model.

    Build with `from_source(path)` (HF folder, .gguf or an artifact's tokenizer folder) or `load(folder)` (artifact
    form); `save(folder)` writes the artifact form (kiln.models.checkpoint.tokenizer reads and writes those).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self._template: jinja2.Template | None = None
        # every encode holds this lock: encode_plain flips the backend's encode_special_tokens for its own call (a
        # copy of the backend for it took from_str's ~0.25 s at the first such message, SmolLM2 on a 2-core CPU)
        self._encode_lock = threading.Lock()
        specials = sorted({t.content for t in self.backend.get_added_tokens_decoder().values() if t.special},
                          key=len, reverse=True)  # fmt: skip
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    # --- properties ---------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # --- text <-> ids -------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized in a worker thread
        # then cannot stall the server's event loop
        with self._encode_lock:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with special-token strings in it encoded as ordinary text (no special tokens result)."""
        with self._encode_lock:
            self.backend.encode_special_tokens = True
            try:
                return self.backend.encode_batch([text], add_special_tokens=False)[0].ids
            finally:
                self.backend.encode_special_tokens = False

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None, **kwargs
    ) -> list[int]:
        """The ids of `messages` rendered with the chat template, where only the template's own text can give special
        tokens: text of a message (or of a tool) that spells one, e.g. "<|im_end|>", is encoded as plain text, so a
        user cannot forge a turn. For messages that spell none the ids are exactly transformers'
        apply_chat_template(..., tokenize=True)."""
        marks: dict[str, str] = {}

        def defang(x):  # special-token strings in message fields -> private-use placeholders
            if isinstance(x, str):
                if self._special_re is None or not self._special_re.search(x):
                    return x

                def mark(m: re.Match) -> str:
                    key = f"\ue000{len(marks)}\ue001"
                    marks[key] = m.group(0)
                    return key

                return self._special_re.sub(mark, x)
            if isinstance(x, dict):
                return {k: defang(v) for k, v in x.items()}
            if isinstance(x, list | tuple):
                return [defang(v) for v in x]
            return x

        safe_messages, safe_tools = defang(messages), defang(tools)
        text = self.apply_chat_template(safe_messages, add_generation_prompt, safe_tools, **kwargs)
        if not marks:
            return self.encode(text, add_special_tokens=False)
        # every special-token string left in the text is the template's: those become special tokens, the text between
        # them (with the message text put back) is encoded as plain text, as the tokenizer splits at special tokens
        ids: list[int] = []
        restore = re.compile("|".join(map(re.escape, marks)))
        for i, piece in enumerate(re.split(f"({self._special_re.pattern})", text)):
            if i % 2:
                ids.append(self.backend.token_to_id(piece))
            elif piece:
                ids += self.encode_plain(restore.sub(lambda m: marks[m.group(0)], piece))
        return ids

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None, **kwargs
    ) -> str:
        """Render `messages` with the model's chat template exactly as transformers' apply_chat_template(...,
        tokenize=False) does. A template error is a KilnError (its message is the template's own)."""
        if not self.chat_template:
            raise KilnError("This model has no chat template; use the completions API with a plain prompt.")
        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.TemplateError as e:
            raise KilnError(f"The chat template rejected the messages: {e}") from None


# --- chat templates ---------------------------------------------------------------------------------------------
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise KilnError(f"The model's chat template is not valid Jinja ({e.message}, line {e.lineno}).") from None


# --- helpers ----------------------------------------------------------------------------------------------------
def _clean_up(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m")):
        text = text.replace(a, b)
    for a, b in ((" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
