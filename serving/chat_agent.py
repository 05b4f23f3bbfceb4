"""The chat route's agent features, as functions the route calls: tool_choice, chat_template_kwargs, tool-call and
reasoning parsing of the output into OpenAI's message fields, and their streamed deltas.

    feats = prepare(req, tool_parser, reasoning_parser, chat_template)  # validates tools/tool_choice (APIError)
    ids = adapter.chat_prompt(req.messages, ..., feats.tools, **feats.template_kwargs)
    constrain(llm, req, jobs, feats)        # response_format / structured_outputs / forced tool calls (APIError)
    message(feats, text, finish_reason)     # -> ({"content", "reasoning_content", "tool_calls"}, finish_reason)
    stream = feats.stream(); stream.push(out) -> [delta dicts]; stream.finish(reason) -> ([delta dicts], reason)

tool_choice "required" and a named function are enforced with a JSON schema (tool_parsers.tool_schema), so even a
small model's call parses and its arguments validate; "auto" parses the model's own syntax (tool_parsers.parser_for);
"none" parses nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.serving import structured_api
from kiln.serving.params import StructuredOutputsParams
from kiln.serving.reasoning import ReasoningParser
from kiln.serving.schemas import APIError
from kiln.serving.tool_parsers import HermesParser, ToolCall, ToolParser, parse_forced, parser_for, tool_schema


@dataclass
class ChatFeatures:
    tools: list[dict[str, Any]] | None = None  # what the template sees
    choice: Any = None  # None | "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parser: ToolParser | None = None  # parses calls out of free text (tool_choice auto)
    reasoning: ReasoningParser | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def forced(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, dict)

    def stream(self) -> ChatStream:
        return ChatStream(self)


def _extra(req: Any, name: str) -> Any:
    return structured_api._extra(req, name)


def prepare(req: Any, tool_parser: str | None = None, reasoning_parser: str | None = None,
            chat_template: str | None = None) -> ChatFeatures:  # fmt: skip
    """Check tools and tool_choice, read chat_template_kwargs, and turn assistant tool_calls' JSON-string arguments
    into objects for the template (as transformers' templates expect)."""
    tools = req.tools or None
    choice = req.tool_choice
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError("Each tool is {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}.",
                           param=f"tools[{i}]")  # fmt: skip
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        if name not in names:
            raise APIError(f"tool_choice names the function {str(name)[:100]!r}, which is not among the tools.",
                           param="tool_choice")  # fmt: skip
    elif choice not in (None, "none", "auto", "required"):
        raise APIError("tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}.",
                       param="tool_choice")  # fmt: skip
    if choice == "required" and not tools:
        raise APIError("tool_choice 'required' needs tools.", param="tool_choice")
    kwargs = _extra(req, "chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError("chat_template_kwargs must be an object.", param="chat_template_kwargs")
    for m in req.messages:
        for call in m.tool_calls or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
    parser = None
    if tools and choice in (None, "auto"):
        parser = parser_for(tool_parser, chat_template) or HermesParser()
    reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
    reserved = {"messages", "tools", "add_generation_prompt"}
    template_kwargs = {k: v for k, v in kwargs.items() if k not in reserved}
    return ChatFeatures(tools, choice, parser, reasoning, template_kwargs)


def constrain(llm: Any, req: Any, jobs: list, feats: ChatFeatures) -> None:
    """Attach the request's output constraint to its jobs: a forced tool call's schema, else response_format /
    structured_outputs / guided_* (structured_api)."""
    if not feats.forced:
        structured_api.constrain(llm, req, jobs)
        return
    if structured_api.from_request(req) is not None:
        raise APIError("A forced tool_choice cannot be combined with response_format or structured_outputs.",
                       param="tool_choice")  # fmt: skip
    spec = StructuredOutputsParams(json=tool_schema(feats.tools or [], feats.choice))
    structured_api.check(llm, spec, "tools")
    for job in jobs:
        job.params.structured_outputs = spec


def message(feats: ChatFeatures, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message fields of a finished output, and its finish_reason ("tool_calls" when it calls)."""
    reasoning = None
    if feats.reasoning is not None:
        reasoning, text = feats.reasoning.parse(text)
    calls: list[ToolCall] = []
    if feats.forced:
        calls = parse_forced(text, feats.choice)
        text = "" if calls else text
    elif feats.parser is not None:
        text, calls = feats.parser.parse(text)
    out: dict[str, Any] = {"content": text if (text or not calls) else None}
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = [c.to_openai() for c in calls]
        if finish_reason == "stop" and not isinstance(feats.choice, dict):
            finish_reason = "tool_calls"
    return out, finish_reason


class ChatStream:
    """One choice's streamed deltas: reasoning_content and content as they come, tool calls whole once they parse."""

    def __init__(self, feats: ChatFeatures):
        self.feats = feats
        self.reasoning = feats.reasoning.stream() if feats.reasoning else None
        self.tools = feats.parser.stream() if feats.parser else None
        self.forced_text = ""
        self.calls = 0

    def push(self, piece: str) -> list[dict[str, Any]]:
        """Delta dicts (DeltaMessage fields) for a new piece of output text."""
        reasoning, content = self.reasoning.push(piece) if self.reasoning else ("", piece)
        return self._deltas(reasoning, content)

    def _deltas(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        out = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if content:
            if self.feats.forced:
                self.forced_text += content
            elif self.tools is not None:
                content = self.tools.push(content)
                if content:
                    out.append({"content": content})
            else:
                out.append({"content": content})
        return out

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas (held-back text, the tool calls) and the finish_reason."""
        reasoning, content = self.reasoning.flush() if self.reasoning else ("", "")
        out = self._deltas(reasoning, content)
        calls: list[ToolCall] = []
        if self.feats.forced:
            calls = parse_forced(self.forced_text, self.feats.choice)
            if not calls and self.forced_text:
                out.append({"content": self.forced_text})
        elif self.tools is not None:
            rest, calls = self.tools.finish()
            if rest:
                out.append({"content": rest})
        if calls:
            out.append({"tool_calls": [c.to_openai(index=i) for i, c in enumerate(calls)]})
            if finish_reason == "stop" and not isinstance(self.feats.choice, dict):
                finish_reason = "tool_calls"
        return out, finish_reason
