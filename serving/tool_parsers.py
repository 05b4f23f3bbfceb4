"""Tool calls in model output: one parser per family's syntax, whole-text and streaming.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Qwen2.5, Qwen3, SmolLM2, Hermes)
    llama3_json  {"name": ..., "parameters": {...}} (optionally after <|python_tag|>; several joined by ";")
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or  [TOOL_CALLS]name[ARGS]{...}

`parser_for(name, chat_template)` picks one (by name, else from the chat template's own syntax). parse(text) splits
finished text into content and ToolCalls; a Stream fed text pieces yields content pieces until a call may begin,
then holds the text back (and trailing whitespace, which may precede one) and emits each call whole once the output
ends (so a client never sees a half-written call).
Text that looked like a call but does not parse is returned as content, unchanged.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values in text (separated by whitespace, ';' or ','), or None if anything else is there."""
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


class ToolParser:
    """Base: `start` is the text that opens the tool-call part of an output (everything after it is calls)."""

    name = ""
    start = ""

    def calls(self, tail: str) -> list[ToolCall] | None:
        """The calls in the text from `start` on (start included), or None if it does not parse."""
        raise NotImplementedError

    def split(self, text: str) -> int:
        """Where the tool-call part of text begins (len(text) if none)."""
        i = text.find(self.start)
        return len(text) if i < 0 else i

    def hold(self, text: str) -> int:
        """How many trailing characters of text (no call begun yet) may still turn into the start of one."""
        return _partial_prefix(text, self.start)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished output."""
        i = self.split(text)
        if i == len(text):
            return text, []
        calls = self.calls(text[i:])
        if not calls:
            return text, []
        return text[:i].rstrip(), calls

    def stream(self) -> Stream:
        return Stream(self)


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def calls(self, tail: str) -> list[ToolCall] | None:
        out = []
        for body in self._block.findall(tail):
            values = _json_values(body)
            if not values or len(values) != 1 or (c := _call(values[0])) is None:
                return None
            out.append(c)
        rest = self._block.sub("", tail).strip()
        return out if out and not rest else None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "{"

    def split(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>"):
            return len(text) - len(stripped)
        return len(text) - len(stripped) if stripped.startswith("{") else len(text)

    def hold(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if "<|python_tag|>".startswith(stripped) else 0  # a call only opens the output

    def calls(self, tail: str) -> list[ToolCall] | None:
        values = _json_values(tail.strip().removeprefix("<|python_tag|>"))
        calls = [_call(v, "parameters") for v in values or []]
        return calls if calls and all(calls) else None  # type: ignore[return-value]


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def calls(self, tail: str) -> list[ToolCall] | None:
        body = tail[len(self.start) :].strip()
        if "[ARGS]" in body:  # v11+: name[ARGS]{...} per call
            out = []
            for part in body.split(self.start):
                name, sep, args = part.strip().partition("[ARGS]")
                values = _json_values(args)
                c = _call({"name": name, "arguments": values[0]}) if sep and values and len(values) == 1 else None
                if c is None:
                    return None
                out.append(c)
            return out
        values = _json_values(body)
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else values
        calls = [_call(v) for v in items or []]
        return calls if calls and all(calls) else None  # type: ignore[return-value]


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for(name: str | None, chat_template: str | None) -> ToolParser | None:
    """The parser called `name`, else the one whose syntax the chat template uses, else None."""
    if name:
        return PARSERS[name]()
    t = chat_template or ""
    if "<tool_call>" in t:
        return HermesParser()
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<|python_tag|>" in t or "ipython" in t:
        return Llama3JsonParser()
    return None


class Stream:
    """Incremental parsing: push(text) -> content to send now; finish() -> (content left, calls)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text already sent as content

    def push(self, piece: str) -> str:
        self.text += piece
        i = self.parser.split(self.text)
        # a call began: hold everything from it on; else hold a tail that may be the start of one
        end = i if i < len(self.text) else len(self.text) - self.parser.hold(self.text)
        end = max(len(self.text[:end].rstrip()), self.sent)  # whitespace before a call is not content
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.parser.parse(self.text)
        if calls:
            return content[self.sent :] if len(content) > self.sent else "", calls
        return self.text[self.sent :], []


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# ---- tool_choice "required" and a named function: the output is forced by a JSON schema ----------------------------


def tool_schema(tools: list[dict[str, Any]], choice: Any) -> dict[str, Any] | None:
    """vLLM's way to enforce tool_choice: for a named function the output is its arguments object; for "required"
    a non-empty JSON array of {"name", "parameters"} (parse_forced turns either back into calls). None otherwise."""
    funcs = {t["function"]["name"]: t["function"] for t in tools if isinstance(t, dict) and "function" in t}
    if isinstance(choice, dict):
        fn = funcs[choice["function"]["name"]]
        return fn.get("parameters") or {"type": "object"}
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": fn.get("parameters") or {"type": "object"}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, fn in funcs.items()
        ]
        return {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    return None


def parse_forced(text: str, choice: Any) -> list[ToolCall]:
    """The calls of an output forced by tool_schema (empty if it was cut short and does not parse)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if isinstance(choice, dict):
        return [ToolCall(choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    calls = [_call(v, "parameters") for v in value] if isinstance(value, list) else []
    return [c for c in calls if c is not None]
