"""Tool-call and reasoning parsing (serving/tool_parsers.py, serving/reasoning.py, serving/chat_agent.py) without a
model: whole-text parsing per family, streams that reassemble to the same calls whatever the piece sizes, forced
tool_choice schemas and the assistant message fields."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kiln.serving.chat_agent import ChatFeatures, message
from kiln.serving.reasoning import ReasoningParser
from kiln.serving.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    parse_forced,
    parser_for,
    tool_schema,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
CASES = [
    (HermesParser(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check."),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {}}', ""),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
     '; {"name": "get_time", "parameters": {}}', ""),
    (MistralParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {}}]', ""),
    (MistralParser(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
     ""),
]  # fmt: skip


@pytest.mark.parametrize("parser, text, content", CASES)
def test_parsers_whole_and_streamed(parser, text, content):
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("get_time", {})]
    assert calls[0].id != calls[1].id
    for size in (1, 3, 7, len(text)):
        s = parser.stream()
        sent = "".join(s.push(text[i : i + size]) for i in range(0, len(text), size))
        rest, streamed = s.finish()
        assert (sent + rest).strip() == content
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), MistralParser()])
def test_plain_text_and_broken_calls_stay_content(parser):
    for text in ("The weather is fine.", "Use <tool_call> tags {oops", '[TOOL_CALLS][{"name": 3}]', "{not json"):
        assert parser.parse(text) == (text, [])
        s = parser.stream()
        sent = "".join(s.push(c) for c in text)
        rest, calls = s.finish()
        assert sent + rest == text and not calls


def test_parser_choice_from_template():
    assert isinstance(parser_for(None, "{% if tools %}<tool_call>{% endif %}"), HermesParser)
    assert isinstance(parser_for(None, "[TOOL_CALLS]"), MistralParser)
    assert isinstance(parser_for(None, "<|python_tag|>"), Llama3JsonParser)
    assert parser_for(None, "{{ messages }}") is None
    assert isinstance(parser_for("mistral", "<tool_call>"), MistralParser)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip


def test_forced_tool_schemas():
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = tool_schema(TOOLS, named)
    jsonschema.validate(WEATHER, schema)
    [call] = parse_forced(json.dumps(WEATHER), named)
    assert call.name == "get_weather" and json.loads(call.arguments) == WEATHER
    schema = tool_schema(TOOLS, "required")
    out = [{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(out, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "nope", "parameters": {}}], schema)
    assert [c.name for c in parse_forced(json.dumps(out), "required")] == ["get_weather", "get_time"]
    assert parse_forced('[{"name": "get_weather", "param', "required") == []


@pytest.mark.parametrize(
    "name, text, reasoning, content",
    [
        ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "\n\nParis."),
        ("qwen3", "Paris.", None, "Paris."),
        ("qwen3", "<think>still thinking", "still thinking", ""),
        ("deepseek_r1", "Let me think.</think>Paris.", "Let me think.", "Paris."),
        ("deepseek_r1", "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),
    ],
)
def test_reasoning_whole_and_streamed(name, text, reasoning, content):
    parser = ReasoningParser(name)
    assert parser.parse(text) == (reasoning, content)
    for size in (1, 2, 5):
        s = parser.stream()
        pieces = [s.push(text[i : i + size]) for i in range(0, len(text), size)] + [s.flush()]
        assert "".join(r for r, _ in pieces) == (reasoning or "")
        assert "".join(c for _, c in pieces) == content


def test_message_fields():
    feats = ChatFeatures(tools=TOOLS, choice="auto", parser=HermesParser(), reasoning=ReasoningParser("qwen3"))
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"<think>Weather needed.</think>\n<tool_call>\n{call}\n</tool_call>"
    msg, reason = message(feats, text, "stop")
    assert reason == "tool_calls" and msg["content"] is None and msg["reasoning_content"] == "Weather needed."
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    stream = feats.stream()
    deltas = [d for ch in text for d in stream.push(ch)]
    last, reason = stream.finish("stop")
    deltas += last
    assert reason == "tool_calls" and not any("content" in d for d in deltas)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather needed."
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_weather"]
    plain, reason = message(ChatFeatures(), "Hello.", "length")
    assert plain == {"content": "Hello."} and reason == "length"
